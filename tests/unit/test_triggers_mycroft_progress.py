"""Mycroft's straggler test on the progress feed (diagnosis/triggers/mycroft_progress.py), with
hand-built progress rows (one per (rank, comm) and 1 s window) and an explicit clock."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from diagnosis.agents import progress_as_ops
from diagnosis.evaluate import ProgressRows
from diagnosis.triggers.base import Trigger
from diagnosis.triggers.mycroft_progress import (
    ProgressStragglerState,
    progress_straggler_trigger,
)
from diagnosis.triggers.watch import JobWatch
from ingest.units import MILLISECOND as MS
from ingest.units import SECOND as S
from tests.unit.topo_fixtures import megatron_topology

T0 = 1_700_000_000 * S
MB = 1 << 20



def comms(evidence: Mapping[str, object]) -> list[dict[str, Any]]:
    """A straggler trigger's per-communicator evidence."""
    got = evidence["comms"]
    assert isinstance(got, list) and all(isinstance(c, dict) for c in got)
    return got

def completions(t0: float, t1: float, interval: float, jitter: float = 0.0,
                seed: int = 0) -> np.ndarray:
    """Completion times (s after T0) every `interval` s in [t0, t1), each moved by ±jitter."""
    t = np.arange(t0, t1, interval)
    rng = np.random.default_rng(seed)
    return np.sort(t + rng.uniform(-jitter, jitter, t.size))


class Feed:
    """Progress rows of a few (rank, comm) keys, window by window, into one trigger state."""

    def __init__(self) -> None:
        self.st = ProgressStragglerState("j")
        self.keys: dict[tuple[int, str], list[tuple[np.ndarray, int]]] = {}
        self.fired: list[Trigger] = []
        self.t = 0  # next window start, s after T0

    def ops(self, rank: int, comm: str, times: np.ndarray, nbytes: int = 64 * MB) -> None:
        self.keys.setdefault((rank, comm), []).append((times, nbytes))

    def run(self, until: int, step_ns: float | None = 0.7 * S) -> list[Trigger]:
        out: list[Trigger] = []
        for ws in range(self.t, until):
            rows: dict[str, list[object]] = {k: [] for k in (
                "window_end", "rank", "comm_id", "completed_ops", "bytes_per_s")}
            for (rank, comm), parts in self.keys.items():
                n, b = 0, 0
                for times, nbytes in parts:
                    k = int(((times >= ws) & (times < ws + 1)).sum())
                    n, b = n + k, b + k * nbytes
                rows["window_end"].append(T0 + (ws + 1) * S)
                rows["rank"].append(rank)
                rows["comm_id"].append(comm)
                rows["completed_ops"].append(n)
                rows["bytes_per_s"].append(b)
            cols = {k: np.asarray(v, dtype=object if k == "comm_id" else np.int64)
                    for k, v in rows.items()}
            out += progress_straggler_trigger(self.st, cols, T0 + (ws + 1) * S, step_ns=step_ns,
                                              delta_ns=3 * S)
        self.t = until
        self.fired += out
        return out


def test_dp_throughput_halving_fires_once_on_that_rank() -> None:
    f = Feed()
    for r in (3, 7):
        f.ops(r, "dp:pp0:tp0", completions(0, 40, 0.7, 0.1, seed=r))
        f.ops(r, "tp:pp0:dp0", completions(0, 120, 0.05, 0.01, seed=10 + r), nbytes=4 * MB)
    f.ops(7, "dp:pp0:tp0", completions(40, 120, 0.7, 0.1, seed=1))
    f.ops(3, "dp:pp0:tp0", completions(40, 120, 0.7, 0.1, seed=2), nbytes=24 * MB)  # 0.375 ×
    assert f.run(40) == []
    out = f.run(120)
    assert [(t.kind, t.ranks) for t in out] == [("straggler", (3,))]
    assert out[0].ts <= T0 + 46 * S  # within a span (3 steps ≈ 3 s) plus a window or two
    ev = out[0].evidence
    assert ev["rule"] == "mycroft.alg1.progress"
    (c,) = comms(ev)
    assert c["rank"] == 3 and c["comm_id"] == "dp:pp0:tp0"
    assert c["throughput_Bps"] <= 0.5 * c["throughput_base_Bps"]
    assert 0.5 * S < c["interval_base_ns"] < 0.9 * S


def test_op_interval_doubling_fires() -> None:
    f = Feed()
    f.ops(5, "dp:pp1:tp0", completions(0, 30, 0.7, 0.1))
    f.ops(5, "dp:pp1:tp0", completions(30, 80, 1.6, 0.1, seed=3))  # interval × 2.3
    assert f.run(30) == []
    out = f.run(80)
    assert [(t.kind, t.ranks) for t in out] == [("straggler", (5,))]
    (c,) = comms(out[0].evidence)
    assert c["interval_ns"] >= 2 * c["interval_base_ns"]


def test_steady_noisy_progress_with_empty_windows_does_not_fire() -> None:
    f = Feed()
    # one DP all-reduce per 0.7 s step (windows with 0, 1 or 2), a sparse one every 1.9 s (mostly
    # empty windows), a busy TP comm; heavy jitter
    f.ops(1, "dp:pp0:tp0", completions(0, 400, 0.7, 0.3, seed=4))
    f.ops(1, "pp:tp0:dp0", completions(0, 400, 1.9, 0.6, seed=5), nbytes=16 * MB)
    f.ops(1, "tp:pp0:dp0", completions(0, 400, 0.02, 0.009, seed=6), nbytes=2 * MB)
    # bytes per op vary ×2 from op to op on another rank's DP comm
    t = completions(0, 400, 0.7, 0.2, seed=7)
    f.ops(2, "dp:pp1:tp0", t[::2], nbytes=96 * MB)
    f.ops(2, "dp:pp1:tp0", t[1::2], nbytes=48 * MB)
    assert f.run(400) == []
    assert f.run(0) == [] and not f.st.straggling.any()


def test_recovery_rearms() -> None:
    f = Feed()
    dp = "dp:pp0:tp0"
    f.ops(3, dp, completions(0, 40, 0.7, 0.1))
    f.ops(3, dp, completions(40, 60, 1.8, 0.1, seed=1))  # slow
    f.ops(3, dp, completions(60, 120, 0.7, 0.1, seed=2))  # normal again
    f.ops(3, dp, completions(120, 150, 1.8, 0.1, seed=3))  # slow again
    assert f.run(40) == []
    assert [t.ranks for t in f.run(60)] == [(3,)]  # once per episode
    assert f.run(120) == []
    assert not f.st.straggling.any()  # recovered: re-armed
    assert [t.ranks for t in f.run(150)] == [(3,)]


def test_a_hang_is_not_a_straggler_nor_its_recovery() -> None:
    for burst in (True, False):
        f = Feed()
        dp = "dp:pp0:tp0"
        for r in (3, 7):
            f.ops(r, dp, completions(0, 30, 0.7, 0.1, seed=r))
            f.ops(r, dp, completions(38.2, 100, 0.7, 0.1, seed=r + 1))  # 8 s without completion
            if burst:  # after the stall the rank catches up, then goes on as before
                f.ops(r, dp, np.linspace(38, 38.9, 5))
        assert f.run(30) == []
        assert f.run(38) == []  # the windows with no completion: the failure path's business
        assert f.st.stalled.all()
        assert f.run(100) == [], burst  # the span over the gap is not read as a slowdown


def test_job_watch_feeds_progress_rows_hang_is_failure_path() -> None:
    """Through JobWatch as the trigger agent calls it: a DP throughput halving on one sampled
    rank fires the progress straggler; a job that stops fires hang, no straggler."""
    w = JobWatch(megatron_topology(2, 2, 2, job_id="w"))
    ranks = np.asarray(w.sample.ranks)
    slow = int(ranks[0])
    steps = {"rank": np.repeat(ranks, 20), "step": np.tile(np.arange(20), ranks.size),
             "step_ns": np.full(20 * ranks.size, 700 * MS),
             "t_end": np.tile(T0 + np.arange(1, 21) * 700 * MS, ranks.size)}
    w.observe(T0 + 14 * S, steps=steps)
    fired: list[Trigger] = []
    rng = np.random.default_rng(0)
    for i in range(15, 120):
        stop = i >= 100
        done = np.zeros(ranks.size, np.int64) if stop else rng.integers(1, 3, ranks.size)
        per = np.where((ranks == slow) & (i >= 60), 16 * MB, 64 * MB)
        rows = {"window_end": np.full(ranks.size, T0 + i * S), "rank": ranks,
                "comm_id": np.asarray([f"dp:{r}" for r in ranks], dtype=object),
                "completed_ops": done, "bytes_per_s": done * per,
                "op_interval_ns": np.full(ranks.size, -1), "inflight_ops": np.full(
                    ranks.size, 1 if stop else 0),
                "oldest_inflight_age_ns": np.full(ranks.size, (i - 99) * S if stop else 0),
                "last_beat_ts": np.full(ranks.size, T0 + i * S - S // 2)}
        ops, beats = progress_as_ops(rows)
        fired += w.observe(T0 + i * S, ops=ops, beats=beats, progress=rows)
    strag = [t for t in fired if t.evidence.get("rule") == "mycroft.alg1.progress"]
    assert [t.ranks for t in strag] == [(slow,)]
    assert T0 + 60 * S < strag[0].ts < T0 + 66 * S
    assert [t for t in fired if t.kind in ("hang", "failure") and t.ts > T0 + 100 * S]


def test_in_process_progress_rows_follow_the_feed_definitions() -> None:
    """The in-process eval's progress rows (diagnosis/evaluate.py) count as streams/progress.py:
    completions in [ws, we), their bytes per second, calls in flight at we and the oldest's age;
    an op published in flight and again completed counts once; every key gets a row."""
    feed = ProgressRows()
    ops = {"rank": np.asarray([1, 1, 1, 1, 2]),
           "comm_id": np.asarray(["c", "c", "c", "c", "d"], dtype=object),
           "op_seq": np.asarray([0, 1, 2, 1, 0]), "bytes": np.asarray([10, 20, 30, 20, 5]),
           "t_start": T0 + np.asarray([100, 500, 800, 500, 100]) * MS,
           "t_end": np.asarray([T0 + 300 * MS, 0, 0, T0 + 1500 * MS, T0 + 200 * MS])}
    feed.add(ops, np.asarray([1, 2]))
    assert feed.windows(T0 + 1900 * MS) is None  # a window comes `lag` after its end
    rows = feed.windows(T0 + 3 * S)
    assert rows is not None
    got = sorted(zip(rows["window_end"].tolist(), rows["rank"].tolist(),
                     rows["completed_ops"].tolist(), rows["bytes_per_s"].tolist(),
                     rows["inflight_ops"].tolist(), rows["oldest_inflight_age_ns"].tolist(),
                     strict=True))
    assert got == [(T0 + S, 1, 1, 10, 2, 500 * MS), (T0 + S, 2, 1, 5, 0, 0),
                   (T0 + 2 * S, 1, 1, 20, 1, 1200 * MS), (T0 + 2 * S, 2, 0, 0, 0, 0)]
