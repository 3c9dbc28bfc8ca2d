"""The first end-to-end path: producer -> real Kafka broker -> Faust worker -> embedded ClickHouse.

Each test runs its own worker process (`rankwatch worker`, started by the same code as
`rankwatch up`) against the session's broker, with its own topics and its own embedded database,
and stops it at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from confluent_kafka import Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from ingest.agent.capture import read_capture
from ingest.batch import BatchError, decode_batch, encode_batch, encode_topology
from ingest.publish import BatchPublisher
from ingest.records import Communicator, JobTopology
from ingest.synthetic import ops_columns
from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from rankwatch.settings import Settings
from tests.conftest import KafkaService, SettingsFactory


def message_json(m: Message) -> Any:
    """A consumed message's JSON value (every message these tests read has one)."""
    value = m.value()
    assert value is not None, "a message without a value"
    return orjson.loads(value)


@dataclass
class Pipeline:
    settings: Settings

    def sql(self, query: str) -> str:
        req = urllib.request.Request(stack.sql_endpoint(self.settings) + "/", method="POST",
                                     data=query.encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            return str(r.read().decode()).strip()

    def count(self, table: str, where: str = "1") -> int:
        return int(self.sql(f"SELECT count() FROM {table} WHERE {where}"))

    def wait_count(self, table: str, n: int, where: str = "1", timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        got = -1
        while time.monotonic() < deadline:
            got = self.count(table, where)
            if got >= n:
                return got
            time.sleep(0.2)
        return got

    def why_not(self, job: str) -> str:
        """What a failed wait leaves to read: the job's stored rows and the worker's own lines
        (triggers, diagnoses, warnings), for a failure seen only in CI."""
        counts = {t: self.count(t, f"job_id = '{job}'")
                  for t in ("jobs", "ops", "beats", "stages", "progress", "iterations",
                            "diagnoses")}
        log = stack.worker_daemon(self.settings).log_file
        text = log.read_text(errors="replace") if log.exists() else ""
        mine = [ln for ln in text.splitlines()
                if "diagnosis." in ln or " WARNING " in ln or " ERROR " in ln]
        return f"rows of {job}: {counts}; worker log ({log}):\n" + "\n".join(mine[-60:])

    def publisher(self) -> BatchPublisher:
        return BatchPublisher(self.settings.bootstrap, self.settings.topics)

    def start_worker(self) -> None:
        stack.up(self.settings, progress=lambda m: None)

    def kill_worker(self) -> None:
        pid = stack.worker_daemon(self.settings).pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and stack.worker_daemon(self.settings).pid() == pid:
            time.sleep(0.1)


@pytest.fixture
def pipeline(kafka: KafkaService, settings_factory: SettingsFactory) -> Iterator[Pipeline]:
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"p{uuid.uuid4().hex[:10]}", kafka_partitions=3)
    p = Pipeline(settings)
    try:
        p.start_worker()
        yield p
    finally:
        stack.down(settings, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [s.name for s in settings.topics.specs(3)])


def ops_batch(job: str, start: int, n: int, seq: int) -> bytes:
    return encode_batch("ops", job, ops_columns(8, start, n, 1_763_000_000_000_000_000),
                        producer="test", seq=seq)


def test_published_batches_of_every_kind_appear_as_rows(pipeline: Pipeline) -> None:
    pub = pipeline.publisher()
    pub.publish("ops", ops_batch("j1", 0, 500, 0), key="a")
    pub.publish("chunks", encode_batch("chunks", "j1", {
        "rank": [3, 4], "comm_id": ["dp0", "dp0"], "op_seq": [7, 7], "channel": [0, 1],
        "ts": [10**18, 10**18 + 1], "total_chunks": [64, 64], "gpu_ready": [64, 40],
        "rdma_transmitted": [64, 20], "rdma_done": [60, 20]}))
    pub.publish("beats", encode_batch("beats", "j1", {"rank": [0, 1], "ts": [10**18, 10**18],
                                                      "comm_id": ["dp0", "dp0"],
                                                      "last_op_seq": [6, 7]}))
    topo = JobTopology(job_id="j1", ts=1, world_size=2, dp=2, hosts=["h0", "h0"],
                       communicators=[Communicator(comm_id="dp0", kind="dp", members=[0, 1])])
    pub.publish("jobs", encode_topology(topo), key="j1")
    assert pub.flush(30) == 0
    assert pipeline.wait_count("ops", 500) == 500
    assert pipeline.wait_count("chunks", 2) == 2
    assert pipeline.wait_count("beats", 2) == 2
    assert pipeline.wait_count("jobs", 1) == 1
    assert pipeline.sql("SELECT rank, gpu_ready, rdma_transmitted, rdma_done FROM chunks "
                        "ORDER BY rank") == "3\t64\t64\t60\n4\t40\t20\t20"
    assert pipeline.sql("SELECT uniqExact(rank, op_seq), min(op), max(bytes) FROM ops") == (
        f"500\tAllReduce\t{256 << 20}")
    assert pipeline.sql("SELECT world_size, dp FROM jobs") == "2\t2"


def test_bad_batch_goes_to_the_dlq_and_its_neighbours_are_stored(pipeline: Pipeline) -> None:
    pub = pipeline.publisher()
    bad = ops_batch("j2", 100, 10, 1).replace(b'"AllReduce"', b'"Teleport"')
    for data in (ops_batch("j2", 0, 100, 0), bad, ops_batch("j2", 200, 100, 2)):
        pub.publish("ops", data, key="same-partition")
    pub.publish("ops", b"not json at all", key="same-partition")
    assert pub.flush(30) == 0
    assert pipeline.wait_count("dlq", 2) == 2
    assert pipeline.wait_count("ops", 200) == 200
    rows = pipeline.sql("SELECT field, row, reason FROM dlq ORDER BY offset FORMAT TSVRaw"
                        ).splitlines()
    assert rows[0].startswith("op\t0\t'Teleport' is not one of")
    assert "not valid JSON" in rows[1]
    # the dead letters are in the DLQ topic too, with the original bytes
    c = Consumer({"bootstrap.servers": pipeline.settings.bootstrap, "group.id": "dlq-check",
                  "auto.offset.reset": "earliest"})
    c.subscribe([pipeline.settings.topics.dlq])
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        m = c.poll(1.0)
        if m is not None and not m.error():
            got.append(message_json(m))
    c.close()
    assert sorted(d["reason"][:20] for d in got) == sorted(r.split("\t")[2][:20] for r in rows)
    assert any(d["payload_b64"] and d["field"] == "op" and d["row"] == 0 for d in got)


def test_framed_and_json_batches_across_partitions_with_a_bad_one(pipeline: Pipeline) -> None:
    """Both wire framings side by side, spread over every partition (one insert per consumed
    buffer): a truncated framed batch goes to the DLQ naming its column; nothing else is lost
    or doubled."""
    pub = pipeline.publisher()
    cols = [ops_columns(8, i * 50, 50, 1_763_000_000_000_000_000) for i in range(24)]
    for i, c in enumerate(cols):
        framing = "binary" if i % 2 else "json"
        pub.publish("ops", encode_batch("ops", "j6", c, seq=i, framing=framing), key=str(i))
    bad = encode_batch("ops", "j6", ops_columns(8, 0, 10, 1), framing="binary")[:-8]
    with pytest.raises(BatchError, match="runs past the body") as err:
        decode_batch(bad)
    pub.publish("ops", bad, key="bad")
    assert pub.flush(30) == 0
    assert pipeline.wait_count("ops", 1200, "job_id = 'j6'") == 1200
    assert pipeline.wait_count("dlq", 1) == 1
    assert pipeline.sql("SELECT field, reason FROM dlq FORMAT TSVRaw") == (
        f"{err.value.field}\t{err.value.reason}")
    assert pipeline.sql("SELECT uniqExact(rank, op_seq), uniqExact(src_partition) FROM ops "
                        "WHERE job_id = 'j6'") == "1200\t3"


def test_redelivered_messages_are_stored_once(pipeline: Pipeline, kafka: KafkaService) -> None:
    pub = pipeline.publisher()
    for i in range(30):
        pub.publish("ops", ops_batch("j3", i * 100, 100, i), key=str(i))
    assert pub.flush(30) == 0
    assert pipeline.wait_count("ops", 3000) == 3000
    stack.down(pipeline.settings, progress=lambda m: None)
    # rewind the worker's consumer group to the start: Kafka delivers every message again
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    group = f"rankwatch-{pipeline.settings.topic_prefix}"
    rewind = [TopicPartition(pipeline.settings.topics.ops, p, 0) for p in range(3)]
    from confluent_kafka import ConsumerGroupTopicPartitions
    for fut in admin.alter_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group, rewind)]).values():
        fut.result(30)
    pipeline.start_worker()
    pub.publish("ops", ops_batch("j3", 3000, 100, 30), key="last")
    assert pub.flush(30) == 0
    assert pipeline.wait_count("ops", 3100) == 3100
    time.sleep(2)  # give a wrongly re-inserted batch time to show up
    assert pipeline.sql("SELECT count(), uniqExact(rank, op_seq) FROM ops") == "3100\t3100"


def test_killing_the_worker_mid_stream_loses_and_duplicates_nothing(pipeline: Pipeline) -> None:
    total, per_message = 200_000, 2_000
    env = stack.child_env(pipeline.settings)
    publisher = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from ingest.batch import encode_batch\n"
            "from ingest.publish import BatchPublisher\n"
            "from ingest.synthetic import ops_columns\n"
            "from ingest.topics import Topics\n"
            f"p = BatchPublisher({pipeline.settings.bootstrap!r}, "
            f"Topics.with_prefix({pipeline.settings.topic_prefix!r}))\n"
            f"for i in range({total // per_message}):\n"
            f"    cols = ops_columns(1024, i * {per_message}, {per_message}, 10**18)\n"
            "    p.publish('ops', encode_batch('ops', 'j4', cols, seq=i), key=str(i))\n"
            "    time.sleep(0.03)\n"
            "assert p.flush(60) == 0\n")],
        env=env)
    try:
        assert pipeline.wait_count("ops", 20_000, timeout=60) >= 20_000
        pipeline.kill_worker()
        time.sleep(1.0)  # messages keep arriving while no worker runs
        pipeline.start_worker()
        assert publisher.wait(120) == 0
    finally:
        publisher.kill()
    assert pipeline.wait_count("ops", total, timeout=120) == total
    time.sleep(2)
    assert pipeline.sql("SELECT count(), uniqExact(rank, op_seq) FROM ops") == (
        f"{total}\t{total}")


def test_rankwatch_sql_answers_while_the_worker_owns_the_database(pipeline: Pipeline) -> None:
    pub = pipeline.publisher()
    pub.publish("ops", ops_batch("j5", 0, 16, 0))
    assert pub.flush(30) == 0
    assert pipeline.wait_count("ops", 16) == 16
    env = stack.child_env(pipeline.settings)
    cli = [sys.executable, "-m", "rankwatch.cli", "sql"]
    out = subprocess.run([*cli, "SELECT rank, count() AS n FROM ops GROUP BY rank ORDER BY rank",
                          "--format", "JSONEachRow"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert rows == [{"rank": r, "n": "2"} for r in range(8)] or rows == [
        {"rank": r, "n": 2} for r in range(8)]
    bad = subprocess.run([*cli, "SELECT nope FROM ops"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1
    assert "UNKNOWN_IDENTIFIER" in bad.stderr and "Traceback" not in bad.stderr
    write = subprocess.run([*cli, "DROP TABLE ops"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert write.returncode == 1 and "readonly" in write.stderr.lower()
    assert np.int64(pipeline.count("ops")) == 16


GPU_CAPTURE = Path(__file__).parents[1] / "fixtures" / "gpu" / "h100-nccl-2.28.9-loopback.rwcap"


def test_a_capture_of_a_real_gpu_job_replays_into_the_tables(pipeline: Pipeline,
                                                             tmp_path: Path) -> None:
    """Records of a real job, captured on an H100 by `native/gpu/check.sh`: two ranks on one
    GPU as two NCCL "hosts" (socket transport), 50 steps of matmuls and a 64 MiB AllReduce,
    NCCL 2.28.9's profiler plugin, CUDA 13's CUPTI injector and the Python tracer, drained by
    `rankwatch agent --capture`. `rankwatch replay` puts them in the tables as if the agent had
    been connected, and refuses to replay the same file to the same broker twice."""
    want: dict[str, int] = {}
    for frame in read_capture(GPU_CAPTURE):
        if frame.kind != "jobs":
            want[frame.kind] = want.get(frame.kind, 0) + decode_batch(frame.data).n
    assert set(want) == {"ops", "flows", "chunks", "kernels", "stages", "beats"}
    env = stack.child_env(pipeline.settings)
    capture = tmp_path / GPU_CAPTURE.name
    capture.write_bytes(GPU_CAPTURE.read_bytes())
    replay = [sys.executable, "-m", "rankwatch", "replay", str(capture), "--json"]
    out = subprocess.run(replay, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["undelivered"] == 0
    again = subprocess.run(replay, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "records twice" in again.stderr
    for kind, n in want.items():
        assert pipeline.wait_count(kind, n, "job_id = 'gpu-capture'") == n, kind
    assert pipeline.wait_count("jobs", 1, "job_id = 'gpu-capture'") >= 1
    time.sleep(2)  # nothing more arrives
    for kind, n in want.items():
        assert pipeline.count(kind, "job_id = 'gpu-capture'") == n, kind
    q = pipeline.sql
    # NCCL's ops (communicator comm-<hash>): every one but each rank's first has its kernel
    # start from the plugin's kernel-channel events, and ends after it starts
    nccl = "job_id = 'gpu-capture' AND startsWith(comm_id, 'comm-')"
    n_nccl = int(q(f"SELECT count() FROM ops WHERE {nccl}"))
    assert n_nccl > 0
    assert q(f"SELECT countIf(t_start = 0 OR t_end < t_start) FROM ops WHERE {nccl} "
             "AND op_seq > 0") == "0"
    # one NCCL AllReduce kernel (CUPTI) per NCCL op, per rank
    assert q("SELECT rank, count() FROM kernels WHERE job_id = 'gpu-capture' AND "
             "kernel LIKE '%ncclDevKernel_AllReduce%' GROUP BY rank ORDER BY rank") == q(
        f"SELECT rank, count() FROM ops WHERE {nccl} GROUP BY rank ORDER BY rank")
    # every flow belongs to a stored op; chunk counters never pass the transfer's chunks
    assert q("SELECT count() FROM flows AS f LEFT ANTI JOIN ops AS o ON o.job_id = f.job_id "
             "AND o.rank = f.rank AND o.comm_id = f.comm_id AND o.op_seq = f.op_seq "
             "WHERE f.job_id = 'gpu-capture'") == "0"
    assert q("SELECT countIf(rdma_done > total_chunks OR gpu_ready > total_chunks) FROM chunks "
             "WHERE job_id = 'gpu-capture'") == "0"


GPU_STALL = GPU_CAPTURE.with_name("h100-nccl-2.28.9-data-stall.rwcap")


def test_a_real_gpu_stall_is_diagnosed_by_the_worker(pipeline: Pipeline, tmp_path: Path) -> None:
    """The whole pipeline on a real GPU fault: rank 1's data loading stalled 8 s at step 25
    (H100 capture, native/gpu/check.sh) while rank 0 waited in the step's AllReduce. Replayed,
    the worker's triggers fire in event time and the root-cause agent publishes a hang of rank
    1 in data loading — transient, recovered — to rw.diagnoses and the diagnoses table."""
    capture = tmp_path / GPU_STALL.name
    capture.write_bytes(GPU_STALL.read_bytes())
    out = subprocess.run([sys.executable, "-m", "rankwatch", "replay", str(capture)],
                         env=stack.child_env(pipeline.settings), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    where = "job_id = 'gpu-stall' AND kind = 'hang'"
    assert pipeline.wait_count("diagnoses", 1, where, timeout=90) >= 1, \
        pipeline.why_not("gpu-stall")
    first = pipeline.sql(f"SELECT culprit_ranks, stage, component FROM diagnoses WHERE {where} "
                         "ORDER BY detected_ns, version LIMIT 1")
    assert first == "[1]\tdata\tdata_loader", first
    c = Consumer({"bootstrap.servers": pipeline.settings.bootstrap, "group.id": "diag-check",
                  "auto.offset.reset": "earliest"})
    c.subscribe([pipeline.settings.topics.diagnoses])
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        m = c.poll(1.0)
        if m is not None and not m.error() and message_json(m)["kind"] == "hang":
            got.append(message_json(m))
    c.close()
    d = got[0] if got else {}
    assert (d.get("job_id"), d.get("kind"), d.get("culprit_ranks"), d.get("stage"),
            d.get("component")) == ("gpu-stall", "hang", [1], "data", "data_loader"), d
