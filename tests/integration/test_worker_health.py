"""The worker's health as /ping and `rankwatch status` tell it, against the real worker: a
stalled consumer (the database refuses every insert: a full disk) and a stuck query (one the
engine cannot stop at its time limit) each turn /ping to 503 and `status` to unhealthy with
the reason, and both answer healthy again once the cause is gone. The stall thresholds are
settings (worker_stall_s, sql_stuck_grace_s), set short here."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ingest.batch import encode_batch
from ingest.units import SECOND as SEC
from rankwatch import stack
from rankwatch.commands.stack import format_status
from rankwatch.kafka.admin import delete_topics
from rankwatch.settings import Settings
from tests.integration.test_disk_full import fill, small_disk  # noqa: F401 (a fixture)
from tests.integration.test_ingest_pipeline import Pipeline
from tests.unit.test_poison_decode import valid_columns

#: One block of one row: the engine checks its time limit between blocks, so this runs for
#: seconds past a 1 s limit — 4.8 s on a quiet core, ~1 GB (a query of half the work took
#: 1.06 s there, too short a window to read the status while it is stuck).
STUCK_SQL = ("SELECT length(arraySort(arrayMap(x -> sipHash64(toString(x), x), "
             "range(40000000))))")


def ping(settings: Settings) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{stack.sql_endpoint(settings)}/ping", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_ping(settings: Settings, status: int, timeout: float, *saying: str
              ) -> tuple[int, str]:
    """Poll /ping until it answers `status` with every one of `saying` in its body (or
    `timeout` s)."""
    deadline, got = time.monotonic() + timeout, (0, "")
    while time.monotonic() < deadline:
        got = ping(settings)
        if got[0] == status and all(s in got[1] for s in saying):
            return got
        time.sleep(0.2)
    return got


def status_cli(settings: Settings) -> tuple[int, str, dict]:  # type: ignore[type-arg]
    """`rankwatch status` and `rankwatch status --json`: (exit code, text, JSON)."""
    cmd = [sys.executable, "-m", "rankwatch.cli", "status"]
    env = stack.child_env(settings)
    text = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    js = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, timeout=60)
    return text.returncode, text.stdout, json.loads(js.stdout)


@pytest.fixture
def settings(kafka: Any, settings_factory: Any) -> Iterator[Settings]:
    s = settings_factory(kafka_bootstrap=kafka.bootstrap, topic_prefix=f"h{uuid.uuid4().hex[:10]}",
                         kafka_partitions=1, worker_stall_s=3.0, sql_max_execution_time_s=1,
                         sql_stuck_grace_s=0.0)
    try:
        yield s
    finally:
        stack.down(s, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [t.name for t in s.topics.specs(1)])


@pytest.fixture
def disk_settings(kafka: Any, settings_factory: Any,
                  small_disk: Path) -> Iterator[Settings]:  # noqa: F811
    s = settings_factory(kafka_bootstrap=kafka.bootstrap, topic_prefix=f"h{uuid.uuid4().hex[:10]}",
                         kafka_partitions=1, worker_stall_s=3.0,
                         clickhouse_url=f"chdb://{small_disk / 'clickhouse'}")
    try:
        yield s
    finally:
        stack.down(s, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [t.name for t in s.topics.specs(1)])


def test_a_stalled_consumer_is_reported_and_recovery_clears_it(disk_settings: Settings,
                                                               small_disk: Path) -> None:  # noqa: F811
    p = Pipeline(disk_settings)
    p.start_worker()
    pub = p.publisher()
    t0 = time.time_ns()
    pub.publish("ops", encode_batch("ops", "before", valid_columns("ops", 100, t0)))
    assert pub.flush(30) == 0
    assert p.wait_count("ops", 100, "job_id = 'before'") == 100
    assert ping(disk_settings) == (200, "Ok.\n")
    filler = small_disk / "filler"
    fill(filler)  # every insert now fails and is retried: nothing is stored or committed
    for i in range(3):
        pub.publish("ops", encode_batch("ops", "during", valid_columns("ops", 100, t0 + i * SEC)))
    assert pub.flush(30) == 0
    # both clocks run out within a second or so of each other, in either order: the insert
    # retrying for worker_stall_s, and the partition's commit standing still for worker_stall_s
    # from the health check's first look on
    code, body = wait_ping(disk_settings, 503, 60, "consumer stalled on", "ingest of ops stalled")
    assert code == 503 and "consumer stalled on" in body, body
    assert "ingest of ops stalled" in body and "NOT_ENOUGH_SPACE" in body, body
    exit_code, text, js = status_cli(disk_settings)
    assert exit_code == 1 and "stalled" in text, text
    assert js["healthy"] is False and "stalled" in js["worker"]["detail"]
    print(f"\n/ping while the disk is full: {body.strip()[:300]}")
    filler.unlink()
    assert p.wait_count("ops", 300, "job_id = 'during'", timeout=90) == 300
    code, body = wait_ping(disk_settings, 200, 60)
    assert (code, body) == (200, "Ok.\n")
    exit_code, _, js = status_cli(disk_settings)
    assert exit_code == 0 and js["healthy"] is True and js["worker"]["detail"] == "ok"


def test_a_stuck_query_is_reported_until_it_ends(settings: Settings) -> None:
    p = Pipeline(settings)
    p.start_worker()
    assert ping(settings) == (200, "Ok.\n")
    done: list[str] = []

    def run() -> None:
        try:
            done.append(p.sql(STUCK_SQL))
        except urllib.error.HTTPError as e:
            done.append(e.read().decode())

    query = threading.Thread(target=run)
    query.start()
    try:
        code, body = wait_ping(settings, 503, 30)
        assert code == 503 and "a SQL query has run" in body and "arraySort" in body, body
        st = stack.status(settings)  # what `rankwatch status` prints (in process: no startup)
        assert not done, "the query ended before the status was read"
        assert st["healthy"] is False and "a SQL query has run" in st["worker"]["detail"]
        assert "a SQL query has run" in format_status(st)
    finally:
        query.join(120)
    assert done and "TIMEOUT_EXCEEDED" in done[0], done  # stopped at the block's end
    assert wait_ping(settings, 200, 30) == (200, "Ok.\n")
    assert p.sql("SELECT 1") == "1"
