"""A small scenario published to the real broker lands on its topics and decodes with the
contract; the ground truth lands on the truth topic and nowhere else."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer

from ingest.batch import FRAME_MAGIC, decode_batch
from ingest.sim.config import JobConfig
from ingest.sim.runner import KafkaSink, run
from ingest.sim.simulation import Simulation
from ingest.topics import Topics

pytestmark = pytest.mark.integration


def _drain(bootstrap: str, topic: str, expect: int, timeout_s: float = 60.0) -> list[bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g{uuid.uuid4().hex[:8]}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    out: list[bytes] = []
    waited = 0.0
    try:
        while len(out) < expect and waited < timeout_s:
            msg = c.poll(1.0)
            waited += 1.0
            if msg is None or msg.error():
                continue
            value = msg.value()
            assert value is not None
            out.append(value)
    finally:
        c.close()
    return out


def test_scenario_lands_on_the_broker(kafka: Any, topics: Topics) -> None:
    cfg = JobConfig(job_id="sim-it", tp=2, pp=2, dp=2, steps=6, hang_tail_s=2.0)
    sim = Simulation(cfg, ["hang rank=5 stage=bwd mb=1 at=2s"])
    sink = KafkaSink(kafka.bootstrap, topics, cfg.job_id)
    stats = run(sim, sink, "max")
    assert sink.publisher.stats.delivered == sink.publisher.stats.sent
    got = _drain(kafka.bootstrap, topics.ops, stats.batches["ops"])
    assert len(got) == stats.batches["ops"]
    for data in got:
        assert data.startswith(FRAME_MAGIC)  # Kafka gets framed batches (docs/records.md)
        b = decode_batch(data)
        assert b.kind == "ops" and b.job_id == "sim-it"
    jobs = _drain(kafka.bootstrap, topics.jobs, 1)
    assert decode_batch(jobs[0]).topologies[0].world_size == 8
    truth = [orjson.loads(m) for m in _drain(kafka.bootstrap, topics.truth, 1)]
    assert truth[0]["ranks"] == [5] and truth[0]["component"] == "gpu"
    for data in got:  # ground truth never travels inside the records
        assert b"hang" not in data
