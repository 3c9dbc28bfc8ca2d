"""The agent's loop against real native rings written by the tracer's sink, and a fake
publisher (outage, failed delivery, a dead producer)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from ingest import ring
from ingest.agent.agent import Agent, AgentConfig
from ingest.batch import FRAME_MAGIC, decode_batch
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
    assert all(d.startswith(FRAME_MAGIC) for k, d in pub.got if k == "ops")  # framed batches
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
    t_dead = time.time_ns()
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix), pub)
    agent.step()
    agent.out.flush(force=True)
    pub.flush()
    assert [c["t_end"].tolist() for c in kinds(pub, "ops")] == [[0]]  # in flight when it died
    (last,) = kinds(pub, "beats")  # one row: the rank's process ended
    assert (last["rank"].tolist(), last["exited"].tolist()) == ([0], [1])
    assert last["ts"][0] >= t_dead and (last["step"][0], last["stage"][0]) == (-1, "")
    assert ring.list_rings(prefix) == [] and not (tmp_path / "job1" / "rank-0.json").exists()
    assert not (tmp_path / "job1").exists()  # the job's last producer here is gone: tidied


def test_a_ranks_exit_row_carries_when_its_process_ended(tmp_path: Path, prefix: str) -> None:
    """The exit row's time is when the process was seen ended (its pidfd, slept on by the
    loop), not the later beat; and a process seen ended is dead at the next beat, though its
    ring's own check still finds it until its parent reaps it."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd on this platform")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the producer: one stage record, then waits to be told to end
        os.close(w)
        s = sink(tmp_path, prefix, 0)
        s.stage(0, time.time_ns(), 1, 2, 3, 4, 5, 6, -1)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    deadline = time.monotonic() + 10
    while not ring.list_rings(prefix) and time.monotonic() < deadline:
        time.sleep(0.01)
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix), pub)
    agent.step()  # attaches the ring; its first beat watches the live producer
    told = time.time_ns()
    os.write(w, b"x")
    assert agent.exits.check(10.0) == 1  # woken by the exit
    woke = time.time_ns()
    time.sleep(0.3)
    beat = time.time_ns()
    agent.beat(beat)  # not reaped yet (its ring's check still finds it): dead all the same
    os.waitpid(pid, 0)
    agent.out.flush(force=True)
    pub.flush()
    rows = [c for c in kinds(pub, "beats") if 1 in c["exited"].tolist()]
    assert len(rows) == 1
    ts = int(rows[0]["ts"][rows[0]["exited"] == 1][0])
    assert told <= ts <= woke < beat - 250_000_000


def test_each_agent_has_its_own_state_file_removed_when_it_stops(tmp_path: Path,
                                                                 prefix: str) -> None:
    agent = Agent(config(tmp_path, prefix), FakePublisher())
    agent.write_stats()
    own = tmp_path / f"agent.{os.getpid()}.json"
    assert agent.stats_path == own and orjson.loads(own.read_bytes())["rings"] == 0
    assert not (tmp_path / "agent.json").exists()
    agent.run(stop=lambda: True)
    assert not own.exists()


def test_every_native_kind_becomes_valid_batches(tmp_path: Path, prefix: str) -> None:
    """A ring as the NCCL plugin / CUPTI injector write it: names, ops with the start time known
    only at the end, flows, chunk snapshots, work requests, beats and kernels."""
    from ingest.torch.sink import fnv1a64

    w = ring.RingWriter(ring.ring_name("job1", 3, "nccl", prefix), capacity=1024, rank=3,
                        job_id="job1", source="nccl")
    comm, nic, kern = fnv1a64("0xabc"), fnv1a64("mlx5_0:1"), fnv1a64("ncclDevKernel_AllReduce")
    t = time.time_ns()
    for text, h, ns in (("0xabc", comm, 1), ("mlx5_0:1", nic, 3),
                        ("ncclDevKernel_AllReduce", kern, 2)):
        n = w.records("name", 1)
        n["hash"], n["ns"], n["nparts"], n["len"], n["total_len"] = h, ns, 1, len(text), len(text)
        n["text"] = text.encode()
        w.write(n)
    op = w.records("op", 2)
    op["comm_hash"], op["op_seq"], op["func"], op["bytes"] = comm, 7, 1, 1 << 20
    op["t_enqueue"], op["peer"], op["root"], op["step"] = t, -1, -1, -1
    op["flags"][1], op["t_start"][1], op["t_end"][1] = ring.F_END, t + 10, t + 99
    w.write(op)
    rec: dict[str, dict[str, int]] = {
        "flow": {"comm_hash": comm, "op_seq": 7, "bytes": 4096, "t_start": t, "t_end": t + 50,
                 "peer": 4, "channel": 1},
        "chunk": {"comm_hash": comm, "op_seq": 7, "channel": 1, "peer": 4, "total_chunks": 8,
                  "gpu_ready": 8, "rdma_transmitted": 6, "rdma_done": 5, "ts": t},
        "wr": {"nic_hash": nic, "inflight": 3, "bytes_done": 1 << 30, "ts": t},
        "beat": {"comm_hash": comm, "last_op_seq": 7, "dropped": 0, "ts": t},
        "kernel": {"name_hash": kern, "t_start": t, "duration": 1234, "stream": 7},
    }
    for kind, fields in rec.items():
        r = w.records(kind, 1)
        for k, v in fields.items():
            r[k] = v
        w.write(r)
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix), pub)
    agent.step()
    agent.out.flush(force=True)
    pub.flush()
    got = {k: kinds(pub, k)[0] for k in ("ops", "flows", "chunks", "wr", "beats", "kernels")}
    assert got["ops"]["t_start"].tolist() == [t + 10] and got["ops"]["t_end"].tolist() == [t + 99]
    assert got["ops"]["comm_id"].tolist() == ["0xabc"] and got["ops"]["rank"].tolist() == [3]
    assert got["flows"]["peer"].tolist() == [4] and got["chunks"]["rdma_done"].tolist() == [5]
    assert got["wr"]["nic"].tolist() == ["mlx5_0:1"]
    assert got["beats"]["last_op_seq"].tolist() == [7]
    assert got["kernels"]["kernel"].tolist() == ["ncclDevKernel_AllReduce"]
    w.close()


def test_full_ring_drops_and_counts_never_raises(tmp_path: Path, prefix: str) -> None:
    s = RingSink("job1", 0, 64, prefix)
    for step in range(100):  # nobody drains: 64 fit, 36 are dropped
        s.stage(step, 1, 2, 3, 4, 5, 6, 7, -1)
    assert s.dropped == 36
    agent = Agent(config(tmp_path, prefix), FakePublisher())
    agent.discover()
    assert agent.stats()["tracer_dropped"] == 36 and agent.stats()["ring_backlog"] == 64
    s.close()


def test_beats_carry_the_stage_the_rank_is_inside(tmp_path: Path, prefix: str) -> None:
    """A rank's stage clock publishes its position into its ring header; every beat carries it:
    inside backward of step 7 (a step that has not ended, so no stage record says so), then
    between stages once backward is left."""
    from ingest.torch.stages import StageClock

    s = sink(tmp_path, prefix, 0)
    clock = StageClock()
    clock.publish_position(s.writer.position())
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix, beat_s=0.0), pub)

    def last_beat() -> dict[str, Any]:
        agent.step()
        agent.out.flush(force=True)
        pub.flush()
        return kinds(pub, "beats")[-1]

    with clock.step(7):
        with clock.data():
            pass
        before = time.time_ns()
        with clock.backward():
            b = last_beat()
            assert b["step"].tolist() == [7] and b["stage"].tolist() == ["model.backward"]
            # the rank's perf clock reads as wall time by an offset taken with two clock reads
            # (`StageClock.publish_position`): early by the gap between them, tens of ns when
            # the thread runs on, more when it is preempted there (20 ns failed an 8 ns bound)
            assert before - 1_000_000 <= int(b["stage_ts"][0]) <= time.time_ns()
        left = time.time_ns()
        b = last_beat()
        assert b["step"].tolist() == [7] and b["stage"].tolist() == [""]
        assert int(b["stage_ts"][0]) >= left - 10_000_000  # when backward was left
    clock.publish_position(None)
    s.close()


def test_beats_without_a_stage_clock_say_unknown(tmp_path: Path, prefix: str) -> None:
    s = sink(tmp_path, prefix, 0)
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix), pub)
    agent.step()
    agent.out.flush(force=True)
    pub.flush()
    b = kinds(pub, "beats")[-1]
    assert (b["step"].tolist(), b["stage"].tolist(), b["stage_ts"].tolist()) == ([-1], [""], [0])
    s.close()


def test_beats_carry_the_producers_scheduler_counters(tmp_path: Path, prefix: str) -> None:
    """The producer here is this process: its beats carry its main thread's schedstat, and
    the counters grow between beats while it burns CPU."""
    import os

    from ingest.agent.decode import schedstat

    s = sink(tmp_path, prefix, 0)
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix, beat_s=0.0), pub)

    def last_beat() -> dict[str, Any]:
        agent.step()
        agent.out.flush(force=True)
        pub.flush()
        return kinds(pub, "beats")[-1]

    first = last_beat()
    run0 = int(first["sched_run_ns"][0])
    assert run0 > 0 and int(first["sched_wait_ns"][0]) >= 0
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:  # 50 ms on a CPU
        pass
    assert int(last_beat()["sched_run_ns"][0]) >= run0 + 10_000_000
    assert schedstat(os.getpid())[0] > 0
    assert schedstat(2**22 + 12345) == (-1, -1)  # no such process: unknown, not an error
    s.close()


def test_idle_passes_look_at_nothing_until_the_shm_directory_changes(
        tmp_path: Path, prefix: str) -> None:
    """A pass attaches no ring while /dev/shm is unchanged; a ring created (or re-created by a
    new producer under the same name) is attached at the next pass; a beat rescans anyway."""
    pub = FakePublisher()
    agent = Agent(config(tmp_path, prefix, beat_s=3600.0), pub)
    agent.step()  # beat + full scan
    assert agent.rings == {}
    s0 = sink(tmp_path, prefix, 0)
    agent.step()
    assert list(agent.rings) == [s0.name]
    first = agent.rings[s0.name]
    calls: list[str] = []
    real = ring.RingReader

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, name: str, **kw: Any) -> None:
            calls.append(name)
            super().__init__(name, **kw)

    ring.RingReader = Counting  # type: ignore[misc]
    try:
        for _ in range(5):
            agent.step()
        assert calls == []  # nothing attached while nothing changed
        s0.close(unlink=True)
        s0b = sink(tmp_path, prefix, 0)  # a new producer, same name
        agent.step()
        assert calls == [s0b.name] and agent.rings[s0b.name] is not first
        agent._shm_stamp = None  # as if a change hid under a coarse mtime
        agent.discover(force=True)
        assert calls == [s0b.name]  # the known ring is recognised by its inode, not re-opened
    finally:
        ring.RingReader = real  # type: ignore[misc]
    s0b.close()


def test_polls_slowly_only_when_idle_and_never_past_a_beat(tmp_path: Path, prefix: str) -> None:
    agent = Agent(config(tmp_path, prefix, beat_s=1.0, poll_s=0.05, idle_after_s=2.0,
                         idle_poll_s=0.25), FakePublisher())
    agent._last_record, agent._next_beat = 100.0, 1000.0
    assert agent.pause(101.0) == 0.05  # records came a second ago: keep polling fast
    assert agent.pause(103.0) == 0.25  # idle
    agent._next_beat = 103.1
    assert agent.pause(103.0) == pytest.approx(0.1)  # the beat is due before
    agent._next_beat = 1000.0
    agent.out.append("j", "beats", {"rank": np.array([0]), "ts": np.array([1])})
    assert agent.pause(103.0) == 0.05  # a batch lingers: its flush must not wait


def test_stats_file_written_only_when_they_change(tmp_path: Path, prefix: str) -> None:
    agent = Agent(config(tmp_path, prefix), FakePublisher())
    agent.write_stats()
    path = agent.stats_path  # agent.<pid>.json
    first = path.stat().st_mtime_ns
    path.write_text("{}")  # would be overwritten by a write
    agent.write_stats()
    assert path.read_text() == "{}" and path.stat().st_mtime_ns >= first
    agent.counters.read += 1
    agent.write_stats()
    assert orjson.loads(path.read_text())["read"] == 1


def test_stage_records_calls_and_beats_linger_less_than_the_bulk_kinds(
        tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's stage record, a call and a beat wait `latency_linger_s` in the outbox, the
    bulk kinds `linger_s`: the triggers, a slowdown's analysis and a hang's silence wait on
    the first three."""
    pub = FakePublisher()
    agent = Agent(AgentConfig(tmp_path, prefix=prefix, linger_s=0.25, latency_linger_s=0.05),
                  pub)
    clock, sent = [100.0], []

    def flush_one(job: str, kind: str) -> None:
        sent.append(kind)
        agent.out.buffers.pop((job, kind))

    monkeypatch.setattr("ingest.agent.outbox.time.monotonic", lambda: clock[0])
    monkeypatch.setattr(agent.out, "_flush_one", flush_one)
    for kind in ("stages", "beats", "ops", "kernels", "flows"):
        agent.out.append("j", kind, {"rank": np.array([0])})
    clock[0] += 0.04
    agent.out.flush()
    assert sent == []
    clock[0] += 0.02
    agent.out.flush()
    assert sorted(sent) == ["beats", "ops", "stages"]
    clock[0] += 0.2
    agent.out.flush()
    assert sorted(sent) == ["beats", "flows", "kernels", "ops", "stages"]
    assert agent.out.buffers == {}

