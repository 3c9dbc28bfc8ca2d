"""hang_rca on simulator records: a hang that already recovered (a transient hang) is analysed
as of inside the stall and names the hung rank and its pass, not the peer that waited for it."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from diagnosis import hang_rca
from diagnosis.window import Window
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect
from ingest.units import SECOND as S


@functools.cache
def window(fault: str) -> tuple[Window, int]:
    cfg = JobConfig(job_id="t", tp=2, pp=4, dp=2, steps=14, hang_tail_s=2.0)
    d = collect(Simulation(cfg, [fault]).batches())
    topo = d.pop("jobs")["topology"][0]
    now = int(max(d["beats"]["ts"].max(), d["ops"]["t_enqueue"].max()))
    return Window(topo, d, 0, now), now


def test_recovered_stall_names_the_hung_rank_and_pass() -> None:
    w, now = window("hang rank=11 stage=bwd mb=2 at=3s for=6s")
    assert hang_rca.analyze(w, now) is None  # nothing is stuck any more
    c = hang_rca.analyze_past_stall(w, now)
    assert c is not None and c.kind == "hang"
    # rank 11 = tp 1 + 2·(dp 1 + 2·stage 2)
    assert (c.ranks, c.stage, c.component) == ((11,), "bwd mb=2 pp=2", "gpu_compute")
    assert {"transient", "recovered", "min_op"} <= set(c.labels)
    # the halt point reads the same reached calls: its TP peer completed its part of the pass
    halt = [f for f in c.findings if f.rule == "venustrace.halt_point"]
    assert [f.culprit_ranks for f in halt] == [(11,)]


def test_stalled_steps_are_the_steps_the_stall_overlaps() -> None:
    w, _ = window("hang rank=11 stage=bwd mb=2 at=3s for=6s")
    a, b = hang_rca.past_stall(w) or (0, 0)
    steps = hang_rca.stalled_steps(w)
    assert b - a > 4 * S and steps.size >= 1
    st = w.get("stages")
    hit = np.isin(st["step"], steps)
    assert (st["t_start"][hit] < b).all()  # every named step began before the stall ended
    clean, _ = window("hang rank=11 stage=bwd mb=2 at=3s for=10ms")
    assert hang_rca.past_stall(clean) is None and hang_rca.stalled_steps(clean).size == 0


def test_completion_gap_matches_the_sorted_definition() -> None:
    """`Window.completion_gap` (binned, no sort of all completions) against the definition:
    the largest difference between consecutive sorted completion times, if ≥ min_ns."""
    w0, _ = window("hang rank=3 stage=bwd mb=1 at=5s for=4s")
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(2, 400))
        ends = rng.integers(1, 10**6, n) * int(rng.choice([1, 1000, 10**6]))
        if trial % 3 == 0:  # a planted stall
            ends = np.concatenate([ends, ends.max() + rng.integers(10**3, 10**9, 5)])
        ends[rng.random(ends.size) < 0.1] = 0  # in flight
        min_ns = int(rng.integers(2, 10**9))
        w = Window(w0.topo, {"ops": {"rank": np.zeros(ends.size, np.int64), "t_end": ends}}, 0,
                   int(ends.max()) + 1)
        s = np.unique(ends[ends > 0])
        want = None
        if s.size >= 2 and int(np.diff(s).max()) >= min_ns:
            i = int(np.argmax(np.diff(s)))
            want = (int(s[i]), int(s[i + 1]))
        got = w.completion_gap(min_ns)
        if want is None:
            assert got is None, (trial, got)
        else:  # ties may pick another gap of the same length
            assert got is not None and got[1] - got[0] == want[1] - want[0], (trial, got, want)


@pytest.mark.parametrize(("ranks", "world", "capped"), [
    (tuple(range(64)), 64, True),   # a deadlock cycle through every rank
    ((3, 4, 5), 4, True),           # most of a small job
    ((27,), 64, False),             # one rank: narrowed
    ((0, 1), 4, False),             # half of it: a group, still a place to look
])
def test_a_hang_naming_most_of_the_job_is_a_suspect_set(ranks: tuple[int, ...], world: int,
                                                        capped: bool) -> None:
    from diagnosis.hang_rca import WIDE_CONFIDENCE, _min_data
    from diagnosis.rules.base import Finding

    f = Finding(rule="mycroft.alg2.deadlock", culprit_ranks=ranks, stage="dp_allreduce",
                component="host_software", score=1.0, labels=("deadlock",), kind="hang")
    c = _min_data([f], [], [], world)
    assert c.ranks == ranks
    assert (c.confidence <= WIDE_CONFIDENCE) is capped
    assert ("culprit_not_narrowed" in c.labels) is capped
