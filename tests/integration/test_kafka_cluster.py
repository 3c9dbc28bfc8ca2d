"""`rankwatch up --brokers 3`: a real 3-node KRaft cluster from the broker's jars, the real
worker, and one broker SIGKILLed while records stream: every raw row stored once, the worker
never restarted. The group coordinator is the node killed: the worst one for the consumers."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from ingest.batch import encode_batch
from ingest.publish import BatchPublisher
from ingest.synthetic import ops_columns
from rankwatch import stack
from rankwatch.daemon import Daemon
from rankwatch.kafka.broker import KafkaCluster, local_nodes
from rankwatch.settings import Settings
from tests.conftest import SettingsFactory

ROWS_PER_BATCH = 400
BATCHES = 60
T0 = 1_763_000_000_000_000_000


def sql(settings: Settings, query: str) -> str:
    req = urllib.request.Request(stack.sql_endpoint(settings) + "/", method="POST",
                                 data=query.encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return str(r.read().decode()).strip()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


@pytest.fixture
def cluster_stack(settings_factory: SettingsFactory) -> Iterator[Settings]:
    settings = settings_factory(kafka_brokers=3, kafka_heap="256m", kafka_partitions=3,
                                metrics_port=0, page_port=0)
    started: list[int] = []
    try:
        t0 = time.monotonic()
        stack.up(settings, progress=lambda m: print(f"{time.monotonic() - t0:5.1f} s {m}"),
                 timeout=180)  # three JVMs on a loaded 2-core CI machine
        started += [p for p in KafkaCluster(settings).pids() if p]
        started.append(stack.worker_daemon(settings).pid() or 0)
        yield settings
    finally:
        stack.down(settings, progress=lambda m: None)
        left = [p for p in started if p and alive(p)]
        for pid in left:  # never leave a JVM behind, even when down failed
            Daemon._signal(pid, signal.SIGKILL)
        assert not left, f"processes still running after `down`: {left}"


def coordinator(settings: Settings, group: str) -> int:
    """The group coordinator's node id. librdkafka may fail a request in flight on a bootstrap
    connection it decommissions (_DESTROY_BROKER); such an attempt is made again."""
    for attempt in range(5):
        admin = AdminClient({"bootstrap.servers": settings.bootstrap})
        try:
            return int(admin.describe_consumer_groups([group])[group].result(30).coordinator.id)
        except KafkaException as e:
            if attempt == 4 or not (e.args[0].retriable() or e.args[0].name() in (
                    "_DESTROY_BROKER", "_TRANSPORT")):
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def test_three_brokers_lose_one_mid_stream_and_store_every_row_once(
        cluster_stack: Settings) -> None:
    s = cluster_stack
    st = stack.status(s)
    assert st["healthy"], st
    assert len(st["kafka"]["brokers"]) == 3
    topics = {n: t for n, t in AdminClient({"bootstrap.servers": s.bootstrap})
              .list_topics(timeout=10).topics.items() if n.startswith("rw.")}
    ops = topics[s.topics.ops]
    assert all(len(p.replicas) == 3 for p in ops.partitions.values())
    worker_pid = stack.worker_daemon(s).pid()

    pub = BatchPublisher(s.bootstrap, s.topics, block_s=30.0)
    sent = threading.Event()
    delivered: list[float] = []  # when each batch was acknowledged (for the printed stall)

    def on_delivery(err: object, msg: object) -> None:
        pub._on_delivery(err, msg)  # type: ignore[arg-type]
        if err is None:
            delivered.append(time.monotonic())

    def stream() -> None:
        for i in range(BATCHES):
            cols = ops_columns(8, i * ROWS_PER_BATCH, ROWS_PER_BATCH, T0)
            pub.publish("ops", encode_batch("ops", "cluster-job", cols, producer="test", seq=i),
                        key=f"cluster-job/{i % 8}", on_delivery=on_delivery)
            time.sleep(0.2)
        sent.set()

    producer = threading.Thread(target=stream, daemon=True)
    producer.start()
    deadline, before = time.monotonic() + 20, 0
    while time.monotonic() < deadline and not before:  # some rows stored, more on the way
        before = int(sql(s, "SELECT count() FROM ops WHERE job_id = 'cluster-job'"))
        time.sleep(0.2)
    assert before and not sent.is_set(), "the stream was not under way when the broker died"
    victim = coordinator(s, f"rankwatch-{s.topic_prefix}")
    node = KafkaCluster(s).nodes[victim - 1]
    victim_pid = node.pid()
    assert victim_pid is not None
    os.killpg(victim_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    producer.join(60)
    assert sent.is_set()
    assert pub.flush(60) == 0
    assert pub.stats.failed == 0 and pub.stats.dropped == 0, pub.stats.errors
    want = BATCHES * ROWS_PER_BATCH
    after = sorted(t for t in delivered if t > killed_at)
    gaps = [b - a for a, b in zip([killed_at, *after], after, strict=False)]
    print(f"broker {victim} killed; longest wait for an acknowledgement after it: "
          f"{max(gaps, default=0):.1f} s ({len(after)} of {BATCHES} batches acknowledged after)")

    deadline, got = time.monotonic() + 60, -1
    while time.monotonic() < deadline and got < want:
        got = int(sql(s, "SELECT count() FROM ops WHERE job_id = 'cluster-job'"))
        time.sleep(0.5)
    distinct = int(sql(s, "SELECT uniqExact(src_partition, src_offset, rank, op_seq, comm_id) "
                          "FROM ops WHERE job_id = 'cluster-job'"))
    assert (got, distinct) == (want, want)  # every row, none twice
    assert not alive(victim_pid)
    st = stack.status(s)  # the lost node shows as down; the other two answer
    assert [(b["node"], b["running"], b["healthy"]) for b in st["kafka"]["brokers"]] == [
        (i, i != victim, i != victim) for i in (1, 2, 3)]
    assert [b.node for b in local_nodes(s) if b.pid() is not None] == [
        i for i in (1, 2, 3) if i != victim]
    assert stack.worker_daemon(s).pid() == worker_pid  # the worker kept going
    assert not stack.exits_file(s).exists()
