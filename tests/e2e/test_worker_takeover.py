"""Two workers share the jobs (`rankwatch up --workers 2`: a store process owns the embedded
ClickHouse and serves it to both over ClickHouse's HTTP interface); the worker that owns a job
is killed (SIGKILL) while the job's hang incident is open. The other worker takes the job over
from ClickHouse: the incident is announced once, every raw row is stored exactly once (counted
against the simulator's own counts) and the derived rows have no gap.

The simulated job (8 ranks, real time) hangs 4 s in and runs 30 s more; the workers' consumer
sessions last 6 s, so the survivor owns the job about 6 s after the kill."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer

from diagnosis.model import Diagnosis
from ingest.keys import batch_key
from rankwatch import stack
from rankwatch.commands.stack import format_status
from rankwatch.daemon import Daemon
from rankwatch.kafka.admin import delete_topics, ensure_topics
from rankwatch.settings import Settings
from streams.db import Database
from streams.ownership import job_partition
from tests.conftest import free_ports
from tests.integration.job_checks import poll_diagnosis, published_rows, wait_derived, wait_stored

PARTITIONS = 4
_ASSIGNED = re.compile(r"assigned partitions \[([0-9, ]*)\] of (\d+) of (\S+?):")


@pytest.fixture
def two_workers(kafka, settings_factory) -> Iterator[Settings]:
    store_port, = free_ports(1)
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"w{uuid.uuid4().hex[:10]}",
                                kafka_partitions=PARTITIONS, kafka_session_timeout_s=6,
                                store_port=store_port, store_token=uuid.uuid4().hex,
                                metrics_port=0, page_port=0)
    specs = settings.topics.specs(PARTITIONS)
    ensure_topics(kafka.bootstrap, specs)
    try:
        stack.up(settings, progress=lambda m: None, workers=2, timeout=120)
        yield settings
    finally:
        stack.down(settings, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [s.name for s in specs])


def assignments(d: Daemon, ops_topic: str) -> set[int] | None:
    """The worker's last assignment of the ops topic, from its log."""
    last = None
    for m in _ASSIGNED.finditer(d.log_file.read_text(errors="replace")):
        if m.group(3) == ops_topic:
            last = {int(p) for p in m.group(1).split(",") if p.strip()}
    return last


def wait_split(settings: Settings, timeout: float) -> list[set[int]]:
    """Wait until the two workers' assignments are disjoint and cover every partition."""
    daemons = stack.worker_daemons(settings)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [assignments(d, settings.topics.ops) for d in daemons]
        have = [g for g in got if g]
        if len(have) == len(got) and set().union(*have) == set(range(PARTITIONS)) \
                and sum(len(g) for g in have) == PARTITIONS:
            return have
        time.sleep(0.5)
    raise AssertionError(f"the workers did not split the partitions: {got}")


def spread_over(job: str, split: list[set[int]]) -> bool:
    """Whether `job`'s 4 uploaders' spread kinds land on both workers' partitions."""
    parts = {job_partition(batch_key("ops", job, f"sim/{job}/{u}"), PARTITIONS)
             for u in range(4)}
    return all(parts & mine for mine in split)


def test_killing_a_jobs_owner_mid_incident_hands_the_job_over(two_workers: Settings) -> None:
    settings = two_workers
    daemons = stack.worker_daemons(settings)
    assert len(daemons) == 2 and all(d.pid() for d in daemons)
    split = wait_split(settings, 60)
    st = stack.status(settings)
    assert st["healthy"] and st["store"]["healthy"], st
    assert [w["healthy"] for w in st["workers"]] == [True, True]
    assert "store" in format_status(st) and "worker-2" in format_status(st)
    # a job whose calls, flows, chunks and work requests (4 hosts, one producer each:
    # ingest/keys.py) are stored by both workers, the owner's share reported by the other
    job = next(j for j in (f"takeover-{i}" for i in range(1000)) if spread_over(j, split))
    home = job_partition(job, PARTITIONS)
    owner = next(i for i, parts in enumerate(split) if home in parts)
    survivor = daemons[1 - owner]

    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"t-{job}",
                  "auto.offset.reset": "earliest"})
    c.subscribe([settings.topics.diagnoses])
    sim = subprocess.Popen(
        [sys.executable, "-m", "rankwatch.cli", "simulate", "--tp", "2", "--pp", "2", "--dp", "2",
         "--steps", "30", "--job-id", job, "--fault", "hang rank=5 stage=bwd mb=2 at=4s",
         "--ranks-per-host", "2", "--uploaders", "4",
         "--speed", "realtime", "--out", "kafka", "--quiet", "--json"],
        env=stack.child_env(settings), stdout=subprocess.PIPE)
    got: list[Diagnosis] = []
    killed_at, killed_ns = None, 0
    db = Database(stack.store_url(settings), settings.clickhouse_database, create=False)

    def rows(sql: str) -> list[tuple[int, ...]]:
        return [tuple(r) for r in db.query(sql).result_rows]

    try:
        deadline = time.monotonic() + 80
        # until the job ends, or later while no incident was announced yet (a loaded machine)
        while time.monotonic() < deadline and (sim.poll() is None or killed_at is None):
            if (d := poll_diagnosis(c, job, 0.5)) is not None:
                got.append(d)
            if got and killed_at is None:  # the incident is open: kill its owner
                pid = daemons[owner].pid()
                assert pid is not None
                Daemon._signal(pid, signal.SIGKILL)
                killed_at, killed_ns = time.monotonic(), time.time_ns()
        out, _ = sim.communicate(timeout=30)
        want = published_rows(json.loads(out))
        # every raw row stored once: wait for the survivor to drain the job's partition
        stored = wait_stored(rows, job, want, deadline + 30 - time.monotonic())
        for _ in range(8):  # later versions (re-checks on the survivor), if any
            if (d := poll_diagnosis(c, job, 0.5)) is not None:
                got.append(d)
        gaps = wait_derived(rows, job, 21, 20)
        if gaps and killed_at is not None:  # where the kill fell, for the reader of a failure
            first = rows("SELECT toUnixTimestamp64Nano(min(window_end)) FROM progress "
                         f"WHERE job_id = '{job}'")[0][0]
            gaps.append(f"the owner was killed {(killed_ns - int(first)) / 1e9:.1f} s after "
                        "the first window's end (wall clock; the job runs in real time)")
    finally:
        sim.kill()
        c.close()
        db.close()
    assert killed_at is not None, "no diagnosis arrived before the job ended"
    st = stack.status(settings)
    assert not st["healthy"] and not st["workers"][owner]["running"]
    assert got[0].status == "open" and got[0].kind == "hang" and got[0].culprit_ranks == [5]
    opened = {d.incident_id for d in got if d.status == "open" and d.version == 1}
    assert len(opened) == 1, f"announced more than once: {[d.summary for d in got]}"
    assert {d.incident_id for d in got} == opened
    # the survivor announces the version it took over again, under the same id (deduplicated)
    assert len({d.id for d in got if d.version == 1}) == 1
    log = survivor.log_file.read_text(errors="replace")
    assert "took over 1 open incident(s) of 1 job(s)" in log
    assert re.search(rf"assigned partitions \[[0-9, ]*\b{home}\b", log.split("took over")[0]) \
        or home in (assignments(survivor, settings.topics.ops) or set())
    assert stored == want, f"raw rows stored {stored}, published {want}"
    assert not gaps, f"derived rows incomplete: {gaps}"
