"""A rank starved of CPU against a rank slower at one pass (diagnosis/slow/own_time.py): all of
its phases slower by a like ratio is its CPU only where no scheduler counter can say, and only
when the ratios are alike; one pass far slower than the others is that pass."""

from __future__ import annotations

import numpy as np
import pytest

from diagnosis import slow
from diagnosis.slow import context, own_time
from diagnosis.window import Window

MS = 1_000_000


def _window(slow_rank: int, fwd: float, bwd: float, optim: float, *, counters: bool,
            from_step: int = 25, steps: int = 40) -> Window:
    """A 4-rank data-parallel job on one host: each step data 1 ms, forward 5 ms, backward
    (5 ms of compute, then the gradient all-reduce, which ends when the slowest rank's compute
    is done), optimizer 2 ms. From `from_step`, `slow_rank`'s forward, backward compute and
    optimizer take `fwd`, `bwd`, `optim` times as long. `counters`: the stage records carry
    the steps' CPU wait (`sched_wait_ns`), flat at 0.2 ms on every rank."""
    from ingest.records import Communicator, JobTopology

    world = 4
    topo = JobTopology(job_id="o", ts=0, world_size=world, dp=world, hosts=["h"] * world,
                       communicators=[Communicator(comm_id="dp0", kind="dp",
                                                   members=list(range(world)))])
    cols = ("rank", "step", "t_start", "data_next_wait", "model_fwd_loss", "model_backward",
            "callbacks", "optim_step", "step_other") + (("sched_wait_ns",) if counters else ())
    st_rows: dict[str, list[int]] = {k: [] for k in cols}
    op_rows: dict[str, list[object]] = {k: [] for k in (
        "rank", "comm_id", "op_seq", "op", "bytes", "peer", "stream", "t_enqueue", "t_start",
        "t_end", "step")}
    rng = np.random.default_rng(7)
    t = 10**18
    for s in range(steps):
        f = [(fwd, bwd, optim) if (r == slow_rank and s >= from_step) else (1.0, 1.0, 1.0)
             for r in range(world)]
        fw = [int(5 * MS * f[r][0] + rng.normal(0, 0.05 * MS)) for r in range(world)]
        bw = [int(5 * MS * f[r][1] + rng.normal(0, 0.05 * MS)) for r in range(world)]
        op = [int(2 * MS * f[r][2] + rng.normal(0, 0.02 * MS)) for r in range(world)]
        issue = [t + MS + fw[r] + bw[r] for r in range(world)]
        done = max(issue) + MS  # the all-reduce ends 1 ms after the last joins
        for r in range(world):
            row = {"rank": r, "step": s, "t_start": t, "data_next_wait": MS,
                   "model_fwd_loss": fw[r], "model_backward": done - (t + MS + fw[r]),
                   "callbacks": 0, "optim_step": op[r], "step_other": 0,
                   "sched_wait_ns": 200_000}
            for k in cols:
                st_rows[k].append(int(row[k]))
            for k, x in (("rank", r), ("comm_id", "dp0"), ("op_seq", s), ("op", "AllReduce"),
                         ("bytes", 4096), ("peer", -1), ("stream", 0), ("t_enqueue", issue[r]),
                         ("t_start", issue[r]), ("t_end", done), ("step", s)):
                op_rows[k].append(x)
        t = done + max(op) + MS
    tables = {"stages": {k: np.asarray(v, dtype=np.int64) for k, v in st_rows.items()},
              "ops": {k: np.asarray(v, dtype=object if k in ("comm_id", "op") else np.int64)
                      for k, v in op_rows.items()}}
    return Window(topo, tables, 10**18, t)


def _suspects(w: Window) -> list[tuple[tuple[int, ...], str | None]]:
    cfg = slow.SlowConfig()
    steps, step_ns, job = context.judged_steps(w, cfg)
    ctx = context.Ctx(w, cfg, steps, step_ns, slow.peer_stages(w),
                      int(np.asarray(w.get("stages")["t_start"]).min()), job, frozenset())
    return [(s.ranks, s.stage) for s in own_time.suspects(ctx)]


@pytest.mark.parametrize(("ratios", "want"), [
    ((2.0, 2.1, 1.9), True),      # every phase slower alike
    ((1.98, 4.03, 1.34), False),  # the backward twice as slow as the others: one pass
    ((1.2, 1.25, 1.3), False),    # alike, but too little to tell from noise
    ((2.0, float("nan"), 2.0), False),
])
def test_alike_asks_every_ratio_large_and_close(ratios: tuple[float, ...], want: bool) -> None:
    assert own_time.alike(ratios) is want


def test_phases_alike_without_counters_are_the_ranks_cpu() -> None:
    w = _window(2, 2.0, 2.0, 2.0, counters=False)
    got = _suspects(w)
    assert got and {s for _, s in got} == {"host cpu"} and {r for r, _ in got} == {(2,)}, got


def test_one_pass_far_slower_is_that_pass_not_the_cpu() -> None:
    """Forward 2×, backward 4.5×, optimizer 1.6×: each of them passes `ALIKE_RATIO`, but the
    backward stands apart — a slower backward (whose effects reach the other phases), not a
    starved process, which slows all alike."""
    w = _window(2, 2.0, 4.5, 1.6, counters=False)
    got = _suspects(w)
    assert ((2,), "bwd pp=0") in got and all(s != "host cpu" for _, s in got), got
    c = slow.analyze(w, w.now_ns)
    assert c is not None and (c.ranks, c.stage, c.component) == ((2,), "bwd pp=0",
                                                                  "gpu_compute"), c


def test_with_counters_the_counters_judge_the_cpu() -> None:
    """The same alike slowdown where the steps carry the scheduler's counters and they show
    no waiting: no "host cpu" from the ratios — the rank's work is slower, not its CPU."""
    w = _window(2, 2.0, 2.0, 2.0, counters=True)
    got = _suspects(w)
    assert got and all(s != "host cpu" for _, s in got) and {r for r, _ in got} == {(2,)}, got
    c = slow.analyze(w, w.now_ns)
    assert c is not None and c.ranks == (2,) and c.stage != "host cpu", c


def _ctx(w: Window) -> context.Ctx:
    cfg = slow.SlowConfig()
    steps, step_ns, job = context.judged_steps(w, cfg)
    return context.Ctx(w, cfg, steps, step_ns, slow.peer_stages(w),
                       int(np.asarray(w.get("stages")["t_start"]).min()), job, frozenset())


def test_a_few_ranks_own_times_are_their_columns_of_every_ranks() -> None:
    """A pipeline (TP 2 × PP 2 × DP 2, its point-to-point calls given to a pass by direction
    and cut at the rank's next call): asked for some ranks only, their columns are exactly
    those of the whole computation — a rank's own time reads only its own rows and calls."""
    from ingest.sim.config import JobConfig
    from ingest.sim.simulation import Simulation, collect

    d = collect(Simulation(JobConfig(job_id="o", tp=2, pp=2, dp=2, steps=30),
                           ["gpu_slow rank=5 factor=1.6 at=4s"]).batches())
    topo = d.pop("jobs")["topology"][0]
    d.pop("kernels", None)
    now = int(d["ops"]["t_enqueue"].max())
    for name in ("model_fwd_loss", "model_backward"):
        whole = own_time.own_times(_ctx(Window(topo, d, 0, now)), name)
        assert np.isfinite(whole).sum() > 100  # a real computation, not all nan
        for ranks in ([5], [0, 3, 6], [7, 2]):
            part = own_time.own_times(_ctx(Window(topo, d, 0, now)), name, np.asarray(ranks))
            np.testing.assert_array_equal(part[:, ranks], whole[:, ranks])


@pytest.mark.parametrize("seed", range(5))
def test_by_rank_time_is_the_stable_lexsort(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rank = rng.integers(0, 6, 500)
    t = 10**18 + rng.integers(0, 40, 500)  # many ties
    np.testing.assert_array_equal(context.by_rank_time(rank, t), np.lexsort((t, rank)))
    t[3] = 0  # a span past 40 bits: the lexsort itself
    np.testing.assert_array_equal(context.by_rank_time(rank, t), np.lexsort((t, rank)))
