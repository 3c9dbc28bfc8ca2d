"""Slowdown root cause (diagnosis/slow_rca.py): its vectorized helpers against their plain
definitions, and how a kernel-class excess is named — a shift of the class's typical kernel
names the kernel, a tail of long kernels (ECC-like spikes) names the pass they ran in."""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnosis import slow_rca
from diagnosis.window import Window, assign_steps
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect


@functools.cache
def window(fault: str, steps: int = 16) -> tuple[Window, int]:
    cfg = JobConfig(job_id="t", tp=2, pp=4, dp=2, steps=steps)
    d = collect(Simulation(cfg, [fault]).batches())
    topo = d.pop("jobs")["topology"][0]
    now = int(max(d["beats"]["ts"].max(), d["ops"]["t_enqueue"].max()))
    return Window(topo, d, 0, now), now


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_packed_step_assignment_matches_the_record_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranks, steps = int(rng.integers(1, 6)), int(rng.integers(1, 12))
    st_rank = np.repeat(np.arange(ranks), steps)
    st_step = np.tile(np.arange(steps), ranks)
    st_start = np.sort(rng.integers(0, 10**12, st_rank.size)).astype(np.int64)
    if rng.random() < 0.3:  # starts out of step order on some rank: the searchsorted path
        rng.shuffle(st_start)
    keep = rng.random(st_rank.size) < 0.8  # some (rank, step) rows missing
    t = rng.integers(0, 10**12, 200).astype(np.int64)
    r = rng.integers(0, ranks + 1, 200).astype(np.int64)  # one rank without stages
    got = slow_rca._assign_steps(t, r, st_rank[keep], st_step[keep], st_start[keep])
    want = assign_steps(t, r, st_rank[keep], st_step[keep], st_start[keep])
    np.testing.assert_array_equal(got, want)


def _persistence_of_one_column(m: np.ndarray, ref: np.ndarray, c: int) -> float:
    with np.errstate(all="ignore"):
        x = (m[:, c] - ref[:, c]) / ref[:, c]
    x = x[np.isfinite(x)]
    hit = np.flatnonzero(x > 0.05)
    return float(np.mean(x[hit[0]:] > 0.05)) if hit.size else 0.0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_persistence_matches_the_per_column_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = rng.uniform(0.8, 1.3, (int(rng.integers(1, 12)), int(rng.integers(1, 9))))
    m[rng.random(m.shape) < 0.2] = np.nan
    ref = np.ones_like(m)
    got = slow_rca._persistence(m, ref)
    want = [_persistence_of_one_column(m, ref, c) for c in range(m.shape[1])]
    np.testing.assert_allclose(got, want)


def test_a_slower_kernel_class_names_the_kernel() -> None:
    w, now = window("kernel_slow rank=9 kernel=attn factor=3 at=1s")
    c = slow_rca.analyze(w, now)
    assert c is not None and (c.ranks, c.stage, c.component) == ((9,), "kernel attn",
                                                                 "gpu_compute")


def test_ecc_like_spikes_name_the_pass_not_the_kernel() -> None:
    w, now = window("ecc_jitter rank=9 p=0.05 factor=10 at=1s")
    c = slow_rca.analyze(w, now)
    assert c is not None and c.ranks == (9,) and c.component == "gpu_compute"
    stage = int(w.grid.stage[9])
    assert c.stage in (f"fwd pp={stage}", f"bwd pp={stage}"), c.stage
    assert c.kind == "jitter"


def test_a_change_inside_the_window_is_measured_since_it_began() -> None:
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    steps = np.arange(20)
    ctx = slow_rca._Ctx(w, slow_rca.SlowConfig(), steps, 1e9, w.grid.stage)
    rng = np.random.default_rng(3)
    m = 100e6 * (1 + 0.01 * rng.standard_normal((20, world)))
    m[-7:, 1] *= 1.4  # +40 ms for the last 7 steps: 14 ms over all 20, under the 30 ms floor
    m[-3:, 2] *= 1.4  # a run too short to count
    m[:, 3] *= 1.4  # a rank always this much slower is flagged by the plain mean
    flag, exc, _ = slow_rca._flag(ctx, m, 1.05)
    assert flag[1] and exc[1] > 35e6
    assert not flag[2]
    assert flag[3]
    assert not flag[[0, *range(4, world)]].any()


def test_pp_calls_get_their_microbatch_from_the_1f1b_plan() -> None:
    from diagnosis.rules.pipeline_ops import pp_call_microbatch, pp_plan

    pp, mbs = 4, 6
    for s in range(pp):
        plan = pp_plan(pp, mbs, s)
        seq = np.arange(2 * len(plan))  # two steps
        send = np.asarray([op == "Send" for op, _, _ in plan] * 2)
        fwd = np.asarray([kind == "F" for _, kind, _ in plan] * 2)
        mb, ok = pp_call_microbatch(pp, mbs, np.full(seq.size, s), seq, send, fwd)
        assert ok.all()
        assert mb.tolist() == [m for _, _, m in plan] * 2
        _, bad = pp_call_microbatch(pp, mbs, np.full(seq.size, s), seq, ~send, fwd)
        assert not bad.any()


def test_an_intermittent_phase_excess_is_measured_from_its_first_occurrence() -> None:
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    ctx = slow_rca._Ctx(w, slow_rca.SlowConfig(), np.arange(20), 1e9, w.grid.stage)
    m = np.full((20, world), 8e6)
    m[[-3, -1], 1] += 180e6  # two slow batches in the last three steps: 18 ms over all 20
    m[-1, 2] += 180e6  # one: too little evidence
    flag, exc, _ = slow_rca._flag(ctx, m, 1.05, sparse=True)
    assert flag[1] and exc[1] > 100e6
    assert not flag[2] and not slow_rca._flag(ctx, m, 1.05)[0][1]


def test_a_tiny_phase_at_a_high_ratio_does_not_make_a_data_stall_host_cpu() -> None:
    """"host cpu" needs two CPU-side phases in excess, each by a material share of the step: a
    callbacks phase of microseconds that is 8x its peers' (noise) leaves a slow data loader a
    data-loader finding; the same callbacks excess at 10 % of the step is host CPU."""
    w, now = window("data_tail rank=10 p=1.0 delay=80ms at=1s")
    st_ = dict(w.tables["stages"])
    rank = np.asarray(st_["rank"])
    cb = np.asarray(st_["callbacks"], dtype=np.int64).copy()
    cb[:] = 5_000  # 5 µs
    cb[rank == 10] = 40_000  # 8x, +35 µs a step
    st_["callbacks"] = cb
    tiny = Window(w.topo, {**w.tables, "stages": st_}, w.start_ns, w.now_ns)
    c = slow_rca.analyze(tiny, now)
    assert c is not None and c.ranks == (10,) and c.stage == "data", c
    big = cb.copy()
    step_ns = float(np.median(sum(np.asarray(st_[k], dtype=np.int64) for k in (
        "data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step",
        "step_other"))))
    big[rank == 10] = 5_000 + int(0.1 * step_ns)
    st_["callbacks"] = big
    c = slow_rca.analyze(Window(w.topo, {**w.tables, "stages": st_}, w.start_ns, w.now_ns), now)
    assert c is not None and c.ranks == (10,) and c.stage == "host cpu", c
