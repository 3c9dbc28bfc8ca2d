"""The agent through a real broker outage: records written while the broker is down wait in the
bounded spill and all arrive after it comes back (at least once: a batch the broker wrote but
never acknowledged before it stopped is sent again; ClickHouse's insert tokens dedupe).

A private broker (not the session's: this test stops it) on its own ports and data directory,
restarted on the same ones; the agent keeps running in this process throughout.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from ingest import ring
from ingest.agent.agent import Agent, AgentConfig
from ingest.batch import decode_batch
from ingest.publish import BatchPublisher
from ingest.topics import Topics
from ingest.torch.comms import CommTable
from ingest.torch.sink import RingSink
from rankwatch.kafka.admin import ensure_topics
from rankwatch.kafka.broker import Broker
from rankwatch.kafka.jars import ensure_jars

pytestmark = pytest.mark.slow


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"/rwo{uuid.uuid4().hex[:8]}"
    yield p
    for name in ring.list_rings(p):
        ring.load_library().rw_ring__unlink(name.encode())


def steps_in(bootstrap: str, topic: str, want: int, timeout: float = 60) -> list[int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    got: list[int] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(got) < want:
            msg = c.poll(0.5)
            value = msg.value() if msg is not None and msg.error() is None else None
            if value is not None:
                got += decode_batch(value).cols["step"].tolist()
    finally:
        c.close()
    return sorted(got)


def test_records_written_during_an_outage_arrive_after_it(settings_factory, tmp_path: Path,
                                                          prefix: str) -> None:
    settings = settings_factory(kafka_partitions=1)
    broker = Broker(settings, ensure_jars(settings))
    broker.start(timeout=90, progress=lambda m: None)
    topics = Topics.with_prefix(f"o{uuid.uuid4().hex[:8]}")
    ensure_topics(broker.bootstrap, topics.specs(1))
    sink = RingSink("outage", 0, 4096, prefix)
    (tmp_path / "outage").mkdir()
    CommTable(tmp_path / "outage" / "rank-0.json", "outage", 0, 1).write()
    pub = BatchPublisher(broker.bootstrap, topics, block_s=0.0, config={
        "message.timeout.ms": 4000, "reconnect.backoff.max.ms": 500})
    agent = Agent(AgentConfig(tmp_path, prefix=prefix, linger_s=0.05), pub)
    t = time.time_ns()

    def write_and_pump(steps: range, seconds: float) -> None:
        for s in steps:
            sink.stage(s, t, 1, 2, 3, 4, 5, 6, -1)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            agent.step()
            time.sleep(0.05)

    try:
        write_and_pump(range(0, 10), 3)
        assert agent.stats()["delivered_records"] >= 10
        broker.stop()
        write_and_pump(range(10, 40), 8)  # past message.timeout.ms: deliveries fail, spill
        down = agent.stats()
        assert down["failed_batches"] + down["spill_batches"] > 0, down
        assert down["spill_dropped_records"] == 0
        broker.start(timeout=90, progress=lambda m: None)
        write_and_pump(range(40, 50), 10)
        assert sorted(set(steps_in(broker.bootstrap, topics.stages, 50))) == list(range(50))
        assert agent.stats()["spill_batches"] == 0
    finally:
        sink.close()
        broker.stop()
