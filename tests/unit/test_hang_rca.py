"""hang_rca on simulator records: a hang that already recovered (a transient hang) is analysed
as of inside the stall and names the hung rank and its pass, not the peer that waited for it."""

from __future__ import annotations

import functools

import numpy as np

from diagnosis import hang_rca
from diagnosis.window import Window
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect

S = 1_000_000_000


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
