"""The agent's loop against rings written by the tracer's writer and a fake publisher."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from ingest.agent.agent import Agent, AgentConfig
from ingest.batch import decode_batch
from ingest.torch.comms import CommTable
from ingest.torch.events import OP_CODE, OP_END, OP_START, STAGE
from ingest.torch.spool import SpoolWriter


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


def ring(tmp: Path, rank: int) -> SpoolWriter:
    w = SpoolWriter(tmp / "job1" / f"rank-{rank}.ring", 1024)
    CommTable(tmp / "job1" / f"rank-{rank}.json", "job1", rank, 2).index(object(), "world", [0, 1])
    return w


def kinds(pub: FakePublisher, kind: str) -> list[dict[str, Any]]:
    return [decode_batch(d).cols for k, d in pub.got if k == kind]


def test_agent_publishes_ops_stages_beats_and_topology(tmp_path: Path) -> None:
    w0, w1 = ring(tmp_path, 0), ring(tmp_path, 1)
    t = time.time_ns()
    for w, r in ((w0, 0), (w1, 1)):
        w.write((OP_START, r, 0, 0, OP_CODE["AllReduce"], 64, -1, t, t, 0))
        w.write((OP_END, r, 0, 0, t + 5))
        w.write((STAGE, r, 0, t, 1, 2, 3, 4, 5, 6, -1))
    pub = FakePublisher()
    agent = Agent(AgentConfig(tmp_path, linger_s=0.0), pub)
    agent.step()
    agent.flush_buffers(force=True)
    pub.flush()
    ops = kinds(pub, "ops")
    assert sorted(r for c in ops for r in c["rank"].tolist()) == [0, 1]
    assert all(c["t_end"].min() > 0 for c in ops)
    beats = kinds(pub, "beats")
    pairs = {(int(r), int(s)) for c in beats
             for r, s in zip(c["rank"], c["last_op_seq"], strict=True)}
    assert pairs == {(0, 0), (1, 0)}
    topo = [orjson.loads(d) for k, d in pub.got if k == "jobs"]
    assert topo and topo[0]["recs"][0]["world_size"] == 2
    assert agent.stats()["delivered_records"] >= 6


def test_outage_spills_bounded_and_counts_drops(tmp_path: Path) -> None:
    w = ring(tmp_path, 0)
    pub = FakePublisher()
    agent = Agent(AgentConfig(tmp_path, linger_s=0.0, spill_bytes=3000), pub)
    pub.up = False
    t = time.time_ns()
    for step in range(30):
        w.write((STAGE, 0, step, t, 1, 2, 3, 4, 5, 6, -1))
        agent.step()
    s = agent.stats()
    assert s["spill_bytes"] <= 3000 and s["spill_dropped_batches"] > 0
    assert s["spill_dropped_records"] == s["spill_dropped_batches"]  # one stage per batch here
    pub.up = True
    agent.step()
    pub.flush()
    steps = sorted(x for c in kinds(pub, "stages") for x in c["step"].tolist())
    assert steps == list(range(30 - len(steps), 30))  # the newest survived, in order


def test_failed_delivery_is_retried(tmp_path: Path) -> None:
    w = ring(tmp_path, 0)
    pub = FakePublisher()
    agent = Agent(AgentConfig(tmp_path, linger_s=0.0), pub)
    pub.failing = True
    w.write((STAGE, 0, 0, time.time_ns(), 1, 2, 3, 4, 5, 6, -1))
    agent.step()
    pub.flush()
    assert agent.stats()["failed_batches"] >= 1 and len(agent.spill) >= 1
    pub.failing = False
    agent.step()
    pub.flush()
    assert [c["step"].tolist() for c in kinds(pub, "stages")] == [[0]]


def test_dead_process_ring_is_drained_and_removed(tmp_path: Path) -> None:
    w = ring(tmp_path, 0)
    t = time.time_ns()
    w.write((OP_START, 0, 0, 0, OP_CODE["AllReduce"], 8, -1, t, t, 0))
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    w._words[5] = pid  # the ring now belongs to a process that is gone
    pub = FakePublisher()
    agent = Agent(AgentConfig(tmp_path, linger_s=0.0), pub)
    agent.step()
    agent.flush_buffers(force=True)
    pub.flush()
    ops = kinds(pub, "ops")
    assert [c["t_end"].tolist() for c in ops] == [[0]]  # in flight when it died
    assert not (tmp_path / "job1" / "rank-0.ring").exists()
