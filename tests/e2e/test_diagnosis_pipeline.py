"""Diagnosis through the whole pipeline: simulator (separate process, real time) → broker →
Faust worker (raw sinks, derived progress/iterations, trigger and root-cause agents) →
ClickHouse → rw.diagnoses and the diagnoses table. One hang and one slowdown, each on a small
job (8 ranks, ~0.5 s steps) so a test takes well under two minutes."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer

from diagnosis.model import Diagnosis
from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from rankwatch.settings import Settings


@pytest.fixture
def pipeline(kafka, settings_factory) -> Iterator[Settings]:
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"d{uuid.uuid4().hex[:10]}", kafka_partitions=2)
    try:
        stack.up(settings, progress=lambda m: None)
        yield settings
    finally:
        stack.down(settings, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [s.name for s in settings.topics.specs(2)])


def run_job(settings: Settings, job: str, fault: str, steps: int, until: float
            ) -> list[Diagnosis]:
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"t-{job}",
                  "auto.offset.reset": "earliest"})
    c.subscribe([settings.topics.diagnoses])
    sim = subprocess.Popen(
        [sys.executable, "-m", "rankwatch.cli", "simulate", "--tp", "2", "--pp", "2", "--dp", "2",
         "--steps", str(steps), "--job-id", job, "--fault", fault, "--speed", "realtime",
         "--out", "kafka", "--quiet"], env=stack.child_env(settings))
    got: list[Diagnosis] = []
    try:
        deadline = time.monotonic() + until
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and not m.error():
                got.append(Diagnosis.model_validate_json(m.value() or b"{}"))
            if got and sim.poll() is not None:
                break
    finally:
        sim.kill()
        c.close()
    return [d for d in got if d.job_id == job]


def test_a_hang_is_diagnosed_with_rank_and_stage(pipeline: Settings) -> None:
    diags = run_job(pipeline, "e2e-hang", "hang rank=5 stage=bwd mb=2 at=6s", 30, 90)
    assert diags, "no diagnosis arrived"
    d = diags[0]
    assert (d.status, d.kind, d.culprit_ranks, d.component) == ("open", "hang", [5],
                                                                "gpu_compute")
    assert d.stage == "bwd mb=2 pp=1" and d.sql and d.rules


def test_a_slowdown_is_diagnosed_with_rank_and_component(pipeline: Settings) -> None:
    diags = run_job(pipeline, "e2e-slow", "gpu_slow rank=3 factor=1.8 at=5s", 60, 100)
    assert diags, "no diagnosis arrived"
    d = diags[0]
    assert d.kind in ("slowdown", "jitter") and d.culprit_ranks == [3]
    assert (d.stage, d.component) == ("compute", "gpu_compute")
