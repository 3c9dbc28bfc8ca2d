"""The agent's loop against real native rings written by the tracer's sink, and a fake
publisher (outage, failed delivery, a dead producer)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from ingest import ring
from ingest.agent.agent import Agent, AgentConfig
from ingest.batch import decode_batch
from ingest.torch.comms import CommTable
from ingest.torch.events import OP_CODE
from ingest.torch.sink import RingSink

try:
    ring.load_library()
except ring.RingLibraryMissing as e:  # pragma: no cover - `make build` builds it
    pytest.skip(str(e), allow_module_level=True)


class FakePublisher:
    """Accepts while `up`; delivery fails for what was queued while `failing`."""

    def __init__(self) -> None:
        self.up = True
        self.failing = False
        self.queued: list[tuple[str, bytes, Callable[..., None]]] = []
        self.got: list[tuple[str, bytes]] = []

    def publish(self, kind: str, data: bytes, key: Any = None, topic: Any = None,
                on_delivery: Any = None) -> bool:
        if not self.up:
            return False
        self.queued.append((kind, data, on_delivery))
        return True

    def flush(self, timeout: float = 30.0) -> int:
        for kind, data, cb in self.queued:
            if self.failing:
                cb("broker down", None)
            else:
                self.got.append((kind, data))
                cb(None, None)
        self.queued = []
        return 0


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"/rwt{uuid.uuid4().hex[:8]}"
    yield p
    for name in ring.list_rings(p):
        ring.load_library().rw_ring__unlink(name.encode())


def sink(tmp: Path, prefix: str, rank: int, job: str = "job1") -> RingSink:
    s = RingSink(job, rank, 1024, prefix)
    table = CommTable(tmp / job / f"rank-{rank}.json", job, rank, 2)
    (tmp / job).mkdir(exist_ok=True)
    table.index(object(), "world", [0, 1])
    s.comm("world")
    return s


def config(tmp: Path, prefix: str, **kw: Any) -> AgentConfig:
    return AgentConfig(tmp, prefix=prefix, linger_s=0.0, **kw)


def kinds(pub: FakePublisher, kind: str) -> list[dict[str, Any]]:
    return [decode_batch(d).cols for k, d in pub.got if k == kind]


def test_agent_publishes_ops_stages_beats_and_topology(tmp_path: Path, prefix: str) -> None:
    sinks = [sink(tmp_path, prefix, 0), sink(tmp_path, prefix, 1)]
    t = time.time_ns()
    for s in sinks:
        s.op_start(0, 0, OP_CODE["AllReduce"], 64, -1, t, 0)
        s.op_end(0, 0, t + 5)
        s.stage(0, t, 1, 2, 3, 4, 5, 6, -1)
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix), pub)
    agent.step()
    agent.out.flush(force=True)
    pub.flush()
    ops = kinds(pub, "ops")
    assert sorted(r for c in ops for r in c["rank"].tolist()) == [0, 1]
    assert all(c["t_end"].min() == t + 5 for c in ops)
    assert {x for c in ops for x in c["comm_id"].tolist()} == {"world"}
    beats = kinds(pub, "beats")
    pairs = {(int(r), int(s)) for c in beats
             for r, s in zip(c["rank"], c["last_op_seq"], strict=True)}
    assert pairs == {(0, 0), (1, 0)}
    topo = [orjson.loads(d) for k, d in pub.got if k == "jobs"]
    assert topo and topo[0]["recs"][0]["world_size"] == 2
    assert agent.stats()["delivered_records"] >= 6


def test_outage_spills_bounded_and_counts_drops(tmp_path: Path, prefix: str) -> None:
    s = sink(tmp_path, prefix, 0)
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix, spill_bytes=3000), pub)
    pub.up = False
    t = time.time_ns()
    for step in range(30):
        s.stage(step, t, 1, 2, 3, 4, 5, 6, -1)
        agent.step()
    st = agent.stats()
    assert st["spill_bytes"] <= 3000 and st["spill_dropped_batches"] > 0
    pub.up = True
    agent.step()
    pub.flush()
    steps = sorted(x for c in kinds(pub, "stages") for x in c["step"].tolist())
    assert steps == list(range(30 - len(steps), 30))  # the newest survived, in order
    lost = st["spill_dropped_records"]
    assert lost >= 30 - len(steps) - 1  # what is missing was counted


def test_failed_delivery_is_retried(tmp_path: Path, prefix: str) -> None:
    s = sink(tmp_path, prefix, 0)
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix), pub)
    pub.failing = True
    s.stage(0, time.time_ns(), 1, 2, 3, 4, 5, 6, -1)
    agent.step()
    pub.flush()
    assert agent.stats()["failed_batches"] >= 1 and len(agent.out.spill) >= 1
    pub.failing = False
    agent.step()
    pub.flush()
    assert [c["step"].tolist() for c in kinds(pub, "stages")] == [[0]]


def test_dead_producer_ring_is_drained_and_unlinked(tmp_path: Path, prefix: str) -> None:
    pid = os.fork()
    if pid == 0:  # the producer: writes a start, dies without an end
        s = sink(tmp_path, prefix, 0)
        t = time.time_ns()
        s.op_start(0, 0, OP_CODE["AllReduce"], 8, -1, t, 0)
        os._exit(0)
    os.waitpid(pid, 0)
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix), pub)
    agent.step()
    agent.out.flush(force=True)
    pub.flush()
    assert [c["t_end"].tolist() for c in kinds(pub, "ops")] == [[0]]  # in flight when it died
    assert ring.list_rings(prefix) == [] and not (tmp_path / "job1" / "rank-0.json").exists()
