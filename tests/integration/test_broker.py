"""The local broker speaks to every client rankwatch uses, and the stack manages it.

Kafka 3.9 is pinned because both confluent-kafka (librdkafka) and aiokafka (Faust's transport)
must work against it: these tests cross the two clients in both directions with zstd-compressed
record batches, run a real Faust worker against it, and drive `rankwatch up/down/status`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from ingest.batch import decode_batch, encode_batch
from rankwatch import stack
from rankwatch.cli import main
from rankwatch.commands.stack import format_status
from rankwatch.daemon import Daemon
from rankwatch.kafka import BrokerError
from rankwatch.kafka.admin import delete_topics
from rankwatch.kafka.broker import Broker
from rankwatch.kafka.jars import ensure_jars, jars_dir

ROOT = Path(__file__).resolve().parents[2]
ZSTD = 4  # the compression codec in bits 0-2 of a v2 record batch's attributes


def ops_batch(job_id: str, n: int = 1000, seq: int = 0) -> bytes:
    rank = np.arange(n) % 64
    return encode_batch("ops", job_id, {
        "rank": rank,
        "comm_id": ["dp0"] * n,
        "op_seq": np.arange(n) // 64,
        "op": ["AllReduce"] * n,
        "bytes": np.full(n, 1 << 20),
        "t_enqueue": 1_700_000_000_000_000_000 + np.arange(n) * 1000,
        "t_start": 1_700_000_000_000_000_000 + np.arange(n) * 1000 + 10,
    }, producer="test", seq=seq)


def stored_codec(broker: Broker, topic: str, partition: int = 0) -> int:
    """The compression codec of the first record batch the broker stored for a partition."""
    segment = broker.data_dir / f"{topic}-{partition}" / "00000000000000000000.log"
    head = segment.read_bytes()[:23]
    # baseOffset i64, batchLength i32, partitionLeaderEpoch i32, magic i8, crc u32, attributes i16
    magic, = struct.unpack_from(">b", head, 16)
    attributes, = struct.unpack_from(">h", head, 21)
    assert magic == 2
    return int(attributes & 0x7)


def test_confluent_produces_zstd_and_aiokafka_consumes(kafka, topics):
    batches = [ops_batch("job-a", seq=i) for i in range(3)]
    p = Producer({"bootstrap.servers": kafka.bootstrap, "compression.type": "zstd",
                  "linger.ms": 0})
    for b in batches:
        p.produce(topics.ops, b, key=b"job-a/0", partition=0)
    assert p.flush(10) == 0
    assert stored_codec(kafka.broker, topics.ops) == ZSTD

    async def consume() -> list[bytes]:
        c = AIOKafkaConsumer(topics.ops, bootstrap_servers=kafka.bootstrap,
                             auto_offset_reset="earliest", enable_auto_commit=False)
        await c.start()
        try:
            got: list[bytes] = []
            deadline = time.monotonic() + 20
            while len(got) < len(batches) and time.monotonic() < deadline:
                for msgs in (await c.getmany(timeout_ms=500)).values():
                    got += [m.value for m in msgs]
            return got
        finally:
            await c.stop()

    got = asyncio.run(consume())
    assert got == batches
    decoded = [decode_batch(v) for v in got]
    assert [d.seq for d in decoded] == [0, 1, 2]
    assert decoded[0].n == 1000
    assert decoded[0].cols["rank"][:3].tolist() == [0, 1, 2]


def test_aiokafka_produces_zstd_and_confluent_consumes(kafka, topics):
    batches = [ops_batch("job-b", n=500, seq=i) for i in range(3)]

    async def produce() -> None:
        p = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, compression_type="zstd")
        await p.start()
        try:
            for b in batches:
                await p.send_and_wait(topics.ops, b, key=b"job-b/0", partition=0)
        finally:
            await p.stop()

    asyncio.run(produce())
    assert stored_codec(kafka.broker, topics.ops) == ZSTD
    c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": f"g{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.assign([TopicPartition(topics.ops, 0, OFFSET_BEGINNING)])  # no group join: quicker
    got: list[bytes] = []
    deadline = time.monotonic() + 20
    try:
        while len(got) < len(batches) and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None:
                assert m.error() is None, m.error()
                value = m.value()
                assert value is not None
                got.append(value)
    finally:
        c.close()
    assert got == batches
    assert decode_batch(got[2]).seq == 2


FAUST_APP = textwrap.dedent('''
    """A one-agent Faust app: decodes each batch of a topic and appends a line to a file."""
    import os

    import faust

    from ingest.batch import decode_batch

    app = faust.App(
        os.environ["APP_ID"],
        broker="kafka://" + os.environ["BOOTSTRAP"],
        store="memory://",
        web_enabled=False,
        datadir=os.environ["DATADIR"],
        consumer_auto_offset_reset="earliest",
    )
    source = app.topic(os.environ["TOPIC"], value_serializer="raw")


    @app.agent(source)
    async def count(stream):
        async for value in stream:
            batch = decode_batch(value)
            with open(os.environ["OUT"], "a") as f:
                f.write(f"{batch.kind} {batch.job_id} {batch.seq} {batch.n}\\n")


    if __name__ == "__main__":
        app.main()
''')


def test_the_workers_faust_producer_is_idempotent(kafka, topics):
    """The worker's Faust app sends through an idempotent producer: the broker granted it a
    producer id (sequence numbers on every batch, so a retried send is written once), and
    the message arrives."""
    from streams.app import App, IdempotentProducer

    async def main() -> int:
        app = App(f"rwtest-{uuid.uuid4().hex[:8]}", broker="kafka://" + kafka.bootstrap,
                  store="memory://", web_enabled=False, autodiscover=False)
        producer = app.producer
        await producer.start()
        try:
            await producer.send_and_wait(topics.dlq, b"idem", b"once", None, None, None)
            assert isinstance(producer, IdempotentProducer)
            aio = producer._ensure_producer()
            assert aio._txn_manager is not None, "idempotence is off"
            return int(aio._txn_manager.producer_id)
        finally:
            await producer.stop()

    assert asyncio.run(main()) >= 0
    c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    got: list[bytes | None] = []
    try:
        c.assign([TopicPartition(topics.dlq, p, OFFSET_BEGINNING)
                  for p in c.list_topics(topics.dlq, timeout=10).topics[topics.dlq].partitions])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not got:
            m = c.poll(0.5)
            if m is not None and m.error() is None and m.key() == b"idem":
                got.append(m.value())
    finally:
        c.close()
    assert got == [b"once"]


def test_a_faust_agent_consumes_from_the_broker(kafka, topics, tmp_path):
    p = Producer({"bootstrap.servers": kafka.bootstrap, "compression.type": "zstd"})
    for seq in range(2):
        p.produce(topics.ops, ops_batch("job-f", n=100, seq=seq), key=b"job-f")
    assert p.flush(10) == 0

    app, out = tmp_path / "faust_app.py", tmp_path / "out.txt"
    app.write_text(FAUST_APP)
    env = dict(os.environ, APP_ID=f"rwtest-{uuid.uuid4().hex[:8]}", BOOTSTRAP=kafka.bootstrap,
               TOPIC=topics.ops, OUT=str(out), DATADIR=str(tmp_path / "faust-data"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = tmp_path / "faust.log"
    with log.open("wb") as log_f:
        proc = subprocess.Popen([sys.executable, str(app), "worker", "--without-web",
                                 "--loglevel", "warn"], cwd=tmp_path, env=env,
                                stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            lines = out.read_text().splitlines() if out.exists() else []
            if len(lines) >= 2:
                break
            time.sleep(0.2)
        assert sorted(lines) == ["ops job-f 0 100", "ops job-f 1 100"], log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# ---------------------------------------------------------------------------------------------
# Jars


def _path_with(tmp_path: Path, **scripts: str) -> str:
    """A PATH holding only the given shell scripts (name=body) and the real java's directory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    java = shutil.which("java")
    assert java
    return os.pathsep.join([str(bin_dir), str(Path(java).resolve().parent)])


def test_a_missing_mvn_says_what_to_install(settings_factory, tmp_path, monkeypatch):
    s = settings_factory(cache_dir=tmp_path / "cache")
    monkeypatch.setenv("PATH", _path_with(tmp_path))
    with pytest.raises(BrokerError, match="apt install maven"):
        ensure_jars(s, progress=lambda _: None)


def test_a_failed_fetch_is_retried_and_concurrent_callers_fetch_once(
        settings_factory, tmp_path, monkeypatch):
    s = settings_factory(cache_dir=tmp_path / "cache")
    monkeypatch.setenv("PATH", _path_with(tmp_path, mvn="echo 'Could not resolve kafka'; exit 1"))
    with pytest.raises(BrokerError, match="Could not resolve kafka"):
        ensure_jars(s, progress=lambda _: None)
    assert not (jars_dir(s).parent / ".complete").exists()
    monkeypatch.undo()

    notes: list[str] = []
    with ThreadPoolExecutor(3) as pool:
        libs = list(pool.map(lambda _: ensure_jars(s, progress=notes.append), range(3)))
    assert len(set(libs)) == 1
    assert (libs[0] / "kafka_2.13-3.9.1.jar").exists()
    assert sum(n.startswith("fetching Kafka") for n in notes) == 1
    assert Broker(s).lib == libs[0]


def test_an_unsupported_kafka_version_is_refused(settings_factory):
    with pytest.raises(BrokerError, match=r"3\.x release"):
        ensure_jars(settings_factory(kafka_version="4.0.0"), progress=lambda _: None)


# ---------------------------------------------------------------------------------------------
# The broker's own failures


@pytest.mark.parametrize("which", ["kafka_port", "kafka_controller_port"])
def test_a_taken_port_is_refused(settings_factory, which):
    s = settings_factory()
    port = getattr(s, which)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(BrokerError, match=f"port {port} is in use.*{which.upper()}"):
            Broker(s).start(progress=lambda _: None)


def test_a_broker_that_dies_while_starting_shows_its_log(settings_factory):
    b = Broker(settings_factory(kafka_heap="1k"))  # the JVM refuses to start
    with pytest.raises(BrokerError) as e:
        b.start(timeout=30, progress=lambda _: None)
    assert "exited while starting" in str(e.value), str(e.value)
    assert "kafka.out" in str(e.value)
    assert "heap" in str(e.value).lower()
    assert not b.is_running() and not b.daemon.pid_file.exists()


# ---------------------------------------------------------------------------------------------
# The stack


def test_status_reports_the_running_broker(kafka):
    st = stack.status(kafka.settings)
    assert st["kafka"]["healthy"] and st["kafka"]["managed"]
    assert st["kafka"]["pid"] == kafka.broker.pid()
    assert st["kafka"]["bootstrap"] == kafka.bootstrap
    assert not st["worker"]["running"]
    assert not st["healthy"]  # no worker
    assert st["clickhouse"]["url"].startswith("chdb://")
    text = format_status(st)
    assert "kafka   up" in text and "worker  down" in text


def test_the_cli_creates_and_lists_topics_and_reports_status(kafka, monkeypatch, capsys):
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    s = kafka.settings.model_copy(update={"topic_prefix": prefix})
    for k, v in stack.settings_env(s).items():
        monkeypatch.setenv(k, v)
    try:
        assert main(["topics", "create"]) == 0
        assert f"created {len(s.topics.specs())} topics" in capsys.readouterr().out
        assert main(["topics", "list"]) == 0
        out = capsys.readouterr().out
        assert f"{prefix}.ops" in out and "missing" not in out
    finally:
        delete_topics(kafka.bootstrap, [t.name for t in s.topics.specs()])
    assert main(["status", "--json"]) == 1  # no worker
    st = json.loads(capsys.readouterr().out)
    assert st["kafka"]["healthy"] and st["kafka"]["pid"] == kafka.broker.pid()


def test_status_of_an_external_cluster(kafka):
    external = kafka.settings.model_copy(update={"kafka_bootstrap": kafka.bootstrap,
                                                 "home": kafka.settings.home / "elsewhere"})
    k = stack.status(external)["kafka"]
    assert (k["managed"], k["healthy"], k["pid"]) == (False, True, None)


def test_a_stale_pid_file_reads_as_stopped(settings_factory):
    s = settings_factory()
    s.run_dir.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (s.run_dir / "kafka.pid").write_text(f"{gone.pid}\n")  # a process that has exited
    (s.run_dir / "worker.pid").write_text(f"{os.getpid()}\n")  # a live pid, another program
    st = stack.status(s)
    assert not st["kafka"]["running"] and not st["worker"]["running"]
    assert not (s.run_dir / "kafka.pid").exists()
    assert not (s.run_dir / "worker.pid").exists()
    assert stack.down(s, progress=lambda _: None) is False


FAKE_WORKER = textwrap.dedent('''
    """Stands in for `rankwatch worker`: records the settings it sees, answers /ping."""
    import sys
    import time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from rankwatch.settings import Settings

    s = Settings.load()
    if "--fail" in sys.argv:
        sys.exit("boom: the fake worker refuses to start")
    if "--never-ready" in sys.argv:  # still joining its consumer group: no SQL endpoint yet
        print("fake worker: joining the consumer group", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    (s.home / "worker-settings.json").write_text(s.model_dump_json())


    class Ping(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Ok.\\n")


    HTTPServer((s.bind_host, s.sql_port), Ping).serve_forever()
''')


@pytest.fixture
def fake_worker(tmp_path, monkeypatch):
    """Make `stack.up` start FAKE_WORKER; returns a function to make it fail instead (or,
    given "--never-ready", keep starting and never answer /ping)."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    flags: list[str] = []
    # The marker argument lets the stack's pid check recognise it as a worker.
    monkeypatch.setattr(stack, "worker_command",
                        lambda s: [sys.executable, str(script), "--as", "rankwatch.cli", *flags])
    return lambda flag="--fail": flags.append(flag)


def test_up_status_down_through_the_cli_functions(settings_factory, fake_worker):
    s = settings_factory(kafka_heap="256m")
    notes: list[str] = []
    try:
        st = stack.up(s, progress=notes.append)
        assert st["healthy"], st
        broker_pid, worker_pid = st["kafka"]["pid"], st["worker"]["pid"]
        # the child saw exactly our settings, through RANKWATCH_* variables
        assert (s.home / "worker-settings.json").read_text() == s.model_dump_json()
        n = len(s.topics.specs())  # every topic rankwatch reads or writes
        assert any(note.startswith(f"topics: created {n}") for note in notes)

        notes.clear()
        st = stack.up(s, progress=notes.append)  # idempotent
        assert (st["kafka"]["pid"], st["worker"]["pid"]) == (broker_pid, worker_pid)
        assert any("already running" in n for n in notes if n.startswith("kafka"))
        assert any("already running" in n for n in notes if n.startswith("worker"))
        assert f"topics: all {n} present" in notes
    finally:
        assert stack.down(s, progress=notes.append)
    st = stack.status(s)
    assert not st["kafka"]["running"] and not st["worker"]["running"]
    for pid in (broker_pid, worker_pid):
        assert not Daemon("x", s.run_dir / "none", s.home / "none", "").is_alive(pid)


def test_up_interrupted_while_the_broker_starts_leaves_nothing_running(settings_factory,
                                                                      fake_worker):
    """A SIGTERM raised as SystemExit (what `rankwatch eval` does with one) while `up` waits
    for the broker it just launched: the broker is stopped before the exit goes on — the
    caller's `finally` has no stack to stop yet."""
    s = settings_factory(kafka_heap="256m")
    launched: list[str] = []

    def progress(note: str) -> None:
        if note.startswith("kafka: starting"):
            launched.append(note)
            raise SystemExit(143)

    try:
        with pytest.raises(SystemExit):
            stack.up(s, progress=progress)
        assert launched, "the broker was never launched"
        st = stack.status(s)
        assert not st["kafka"]["running"] and not st["worker"]["running"], st
    finally:
        stack.down(s, progress=lambda _: None)


def test_up_shows_the_log_of_a_worker_that_fails(settings_factory, fake_worker):
    s = settings_factory(kafka_heap="256m")
    fake_worker()
    try:
        with pytest.raises(stack.StackError, match="boom: the fake worker refuses"):
            stack.up(s, progress=lambda _: None, timeout=20)
        assert stack.status(s)["kafka"]["healthy"]  # the broker stays up for `down`
    finally:
        stack.down(s, progress=lambda _: None)


def test_a_private_stack_whose_up_fails_stops_its_broker(settings_factory, fake_worker):
    """`up` leaves a broker it started for `down` when its worker fails (above): a harness
    with a private stack (the real-workload runner, the benches, the demo) must call that
    `down` itself — its caller's `with` has no stack to stop when the entry raised."""
    from bench.real.harness import Runner

    s = settings_factory(kafka_heap="256m")
    fake_worker()
    try:
        with pytest.raises(stack.StackError, match="boom: the fake worker refuses"), \
                Runner(s.home, say=lambda _: None, settings=s):
            pass
        st = stack.status(s)
        assert not st["kafka"]["running"] and not st["worker"]["running"], st
    finally:
        stack.down(s, progress=lambda _: None)


def test_up_gives_up_on_a_worker_never_ready_and_leaves_it_running(settings_factory, kafka,
                                                                  fake_worker):
    """A worker still starting (rejoining its group after an unclean stop can take the session
    timeout) is not killed when `up` stops waiting: that would only start the rejoin over."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    s = settings_factory(kafka_bootstrap=kafka.bootstrap, topic_prefix=prefix)
    fake_worker("--never-ready")
    d = stack.worker_daemon(s)
    pid = None
    try:
        t0 = time.monotonic()
        with pytest.raises(stack.StackError) as err:
            stack.up(s, progress=lambda _: None, timeout=3)
        waited = time.monotonic() - t0
        pid = d.pid()
        assert pid is not None, "the starting worker was stopped"
        msg = str(err.value)
        assert msg.startswith("worker: not ready within 3 s")
        assert f"still running (pid {pid}) and was not stopped" in msg
        assert "rankwatch status" in msg and "rankwatch down" in msg
        assert "fake worker: joining the consumer group" in msg  # the end of its log
        assert 3 <= waited < 30, waited
        time.sleep(1)
        assert d.is_alive(pid)
        st = stack.status(s)["worker"]
        assert st["running"] and not st["healthy"] and st["pid"] == pid
    finally:
        stack.down(s, progress=lambda _: None)
        delete_topics(kafka.bootstrap, [t.name for t in s.topics.specs(s.kafka_partitions)])
    assert pid is not None and not d.is_alive(pid)
    assert d.pid() is None


def test_storage_formats_with_a_cluster_id_that_starts_with_a_dash(settings_factory, monkeypatch):
    """One random cluster id in 64 starts with "-"; the storage tool must not read it as a flag."""
    import rankwatch.kafka.broker as broker_module

    s = settings_factory()
    monkeypatch.setattr(broker_module, "_kafka_uuid", lambda: "-" + "Q" * 21)
    b = Broker(s, ensure_jars(s, progress=lambda _: None))
    b._prepare()
    assert (b.data_dir / "meta.properties").exists()
    assert "-QQQ" in (b.data_dir / "meta.properties").read_text()


def test_job_keyed_batches_land_on_the_jobs_home_partition_from_both_clients(kafka, topics):
    """The premise of streams.ownership: a batch keyed by the bare job id lands on
    job_partition(job, P), whether BatchPublisher (librdkafka) or Faust's aiokafka sends it."""
    from ingest.publish import BatchPublisher
    from streams.ownership import job_partition

    partitions = kafka.settings.kafka_partitions
    jobs = [f"job-{i}" for i in range(24)]
    pub = BatchPublisher(kafka.bootstrap, topics)
    landed: dict[str, int] = {}
    for job in jobs:
        pub.publish("ops", ops_batch(job, n=4), key=job,
                    on_delivery=lambda err, msg: landed.__setitem__(msg.key().decode(),
                                                                    msg.partition()))
    assert pub.flush(30) == 0
    assert landed == {job: job_partition(job, partitions) for job in jobs}

    async def send() -> dict[str, int]:
        p = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
        await p.start()
        try:
            return {job: (await p.send_and_wait(topics.ops, b"x", key=job.encode())).partition
                    for job in jobs}
        finally:
            await p.stop()

    assert asyncio.run(send()) == landed
    assert len(set(landed.values())) > 1
