"""Runner: realtime pacing follows simulated time (injected clock), DirSink writes what decodes."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ingest.batch import decode_batch
from ingest.sim.config import JobConfig
from ingest.sim.runner import DirSink, NullSink, run
from ingest.sim.simulation import Simulation


def test_realtime_sleeps_until_release_time() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    sim = Simulation(JobConfig(tp=2, pp=2, dp=2, steps=5))
    stats = run(sim, NullSink(), "realtime", sleep=sleep, clock=lambda: now[0])
    assert slept and abs(now[0] - stats.sim_s) < 1e-6  # wall clock tracked simulated time


def test_dir_sink_writes_batches_and_truth(tmp_path: Path) -> None:
    sim = Simulation(JobConfig(tp=2, pp=2, dp=2, steps=3), ["gpu_slow rank=1 factor=2"])
    run(sim, DirSink(tmp_path))
    for line in (tmp_path / "ops.jsonl").read_bytes().splitlines():
        assert decode_batch(line).kind == "ops"
    truth = orjson.loads((tmp_path / "truth.json").read_bytes())
    assert truth[0]["ranks"] == [1] and truth[0]["component"] == "gpu"


def test_kinds_keeps_only_those_kinds_and_counts_them() -> None:
    """`rankwatch simulate --kinds` (benchmarks of one kind's path): the same records of the kept
    kinds as a full run, the topology first, the others neither encoded nor counted."""
    full = Simulation(JobConfig(tp=2, pp=2, dp=2, steps=3))
    every = [(k, decode_batch(d)) for _, k, d in full.batches()]
    some = Simulation(JobConfig(tp=2, pp=2, dp=2, steps=3))
    kept = [(k, decode_batch(d)) for _, k, d in some.batches(kinds={"ops", "chunks"})]
    assert kept[0][0] == "jobs" and {k for k, _ in kept[1:]} == {"ops", "chunks"}
    for kind in ("ops", "chunks"):
        want = sum(len(b.cols["rank"]) for k, b in every if k == kind)
        got = sum(len(b.cols["rank"]) for k, b in kept if k == kind)
        assert got == want == some.rows_by_kind[kind]
    assert some.rows == sum(some.rows_by_kind.values()) < full.rows
    assert set(full.rows_by_kind) > {"ops", "chunks", "kernels"}


def test_unknown_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown record kinds \\['opz'\\]"):
        next(iter(Simulation(JobConfig(tp=2, pp=2, dp=2, steps=1)).batches(kinds={"opz"})))
