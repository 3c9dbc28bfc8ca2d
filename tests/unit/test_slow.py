"""Slowdown root cause (diagnosis/slow/): the verdict every comparison goes through (judged
against the quantity's own noise; no verdict from a peer set too small), own time without the
waiting inside it, its vectorized helpers against their plain definitions, and how a
kernel-class excess is named — a shift of the class's typical kernel names the kernel, a tail
of long kernels (ECC-like spikes) names the pass they ran in."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnosis import slow
from diagnosis.slow import context, network, own_time, p2p
from diagnosis.window import Window, assign_steps
from ingest.records import JobTopology
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
    got = context.assign_steps_fast(t, r, st_rank[keep], st_step[keep], st_start[keep])
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
    got = context.persistence(m, ref)
    want = [_persistence_of_one_column(m, ref, c) for c in range(m.shape[1])]
    np.testing.assert_allclose(got, want)


def _split_of_one_series(cfg: context.SlowConfig, step_ns: float, d: np.ndarray,
                         floor: float) -> tuple[float, int, float] | None:
    """The change test's split as its definition reads, one split at a time (own_change's
    docstring): (rise in standard errors, steps of the newest run from its onset, rise in σ)
    of the best split of a unit's own series (no reference), or None."""
    n, best = d.size, None
    for length in range(cfg.onset_steps, n - max(cfg.onset_steps, cfg.min_baseline) + 1):
        before, after = d[:-length], d[-length:]
        mb = float(np.median(before))
        least = max(0.01 * mb, 1e-3 * step_ns, 1.0)
        sd = max(context._spread(before), least)
        rise = float(np.median(after)) - mb
        if np.mean(after > mb + 2 * sd) < 0.8 or rise < floor or rise < cfg.z_change * sd:
            continue
        t = rise / (sd * np.sqrt(1.0 / length + 1.0 / before.size))
        if best is None or t > best[0]:
            best = (t, length - int(np.argmax(after > mb + 2 * sd)), rise / sd)
    return best


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_change_tests_splits_match_their_one_by_one_definition(seed: int) -> None:
    """own_change tries every split at once (every baseline's noise from `prefix_spreads`):
    its onset and strength are those of the one-split-at-a-time definition."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 60))
    cfg = context.SlowConfig(onset_steps=int(rng.choice([2, 4])),
                             min_baseline=int(rng.choice([4, 8])))
    base, noise = 1e7, float(rng.choice([0.01, 0.05, 0.2])) * 1e7
    d = base + np.round(rng.standard_normal(n) * 4) / 4 * noise  # ties too
    d[int(rng.integers(1, n)):] += float(rng.choice([0, 2, 6])) * noise
    ctx = type("C", (), {"cfg": cfg, "step_ns": 1e8})()
    got = context.own_change(ctx, d, d, None, 0.0, 0.0)
    want = _split_of_one_series(cfg, 1e8, d, 0.0)
    assert (got is None) == (want is None)
    if got is not None and want is not None:
        assert got[2] == pytest.approx(want[2], rel=1e-12)
        assert got[3] == want[1]  # the onset: steps since, none missing


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_every_prefixs_spread_at_once_is_each_prefixs_spread(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 70))
    x = [rng.standard_normal(n) * 3 + 100, rng.integers(0, 4, n) * 1e6,
         (rng.pareto(1.5, n) * 1e5).astype(np.float32)][seed % 3]
    got = context.prefix_spreads(x)
    assert np.isnan(got[0])
    assert got[1:].tolist() == [context._spread(x[:i]) for i in range(1, n + 1)]


def test_a_slower_kernel_class_names_the_kernel() -> None:
    w, now = window("kernel_slow rank=9 kernel=attn factor=3 at=1s")
    c = slow.analyze(w, now)
    assert c is not None and (c.ranks, c.stage, c.component) == ((9,), "kernel attn",
                                                                 "gpu_compute")


def test_ecc_like_spikes_name_the_pass_not_the_kernel() -> None:
    w, now = window("ecc_jitter rank=9 p=0.05 factor=10 at=1s")
    c = slow.analyze(w, now)
    assert c is not None and c.ranks == (9,) and c.component == "gpu_compute"
    stage = int(w.grid.stage[9])
    assert c.stage in (f"fwd pp={stage}", f"bwd pp={stage}"), c.stage
    assert c.kind == "jitter"


def _ctx(w: Window, steps: int, job_step: np.ndarray | None = None,
         step_ns: float = 1e9) -> context.Ctx:
    js = np.full(steps, step_ns) if job_step is None else job_step
    return context.Ctx(w, context.SlowConfig(), np.arange(steps), step_ns, w.grid.stage, 0, js)


def _noisy(rng: np.random.Generator, steps: int, units: int, sd: float = 0.01) -> np.ndarray:
    return 100e6 * (1 + sd * rng.standard_normal((steps, units)))


def test_a_change_counts_when_it_stands_out_of_its_own_noise_and_the_job_slowed() -> None:
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(3)
    m = _noisy(rng, 40, world)
    m[-8:, 1] *= 1.4  # +40 ms for the last 8 steps
    m[-3:, 2] *= 1.4  # a run too short to count
    job = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    job[-8:] += 40e6  # the job waits for rank 1
    v = context.judge(_ctx(w, 40, job), m, 1.05)
    assert v.flag[1] and v.how[1] == "change" and v.exc[1] > 35e6 and v.z[1] > 4
    assert int(v.since[1]) == 32  # measured since the change began
    assert not v.flag[[0, *range(2, world)]].any()
    # the same excess while the job's step time did not move: not a slowdown of the job
    flat = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    assert not context.judge(_ctx(w, 40, flat), m, 1.05).flag[1]



def test_a_job_rise_its_own_history_already_shows_is_no_change() -> None:
    """A job sharing its cores slows for a few steps now and then: a rank's cluster of slow
    steps while the job is in such a stretch is not a change of the job when an earlier
    stretch of the same length went as high without a fault (a contended control: rank 0's
    data wait 4 of 5 steps slow while the job's step time was already there just before).
    The same rise above anything the history shows counts."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(7)
    m = _noisy(rng, 40, world)
    m[-6:, 1] *= 1.4
    job = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    job[-6:] += 60e6
    job[10:17] += 80e6  # an earlier excursion, longer and higher, with no fault
    assert context.excursion(job[:-6], 6) >= 1.07e9
    ctx = _ctx(w, 40, job)
    assert context.job_change(ctx, 6) == 0.0
    assert not context.judge(ctx, m, 1.05).flag[1]
    job[10:17] -= 80e6  # no such stretch before: the same rise is the job's change
    assert context.job_change(_ctx(w, 40, job), 6) >= 2.0
    assert context.judge(_ctx(w, 40, job), m, 1.05).flag[1]
    assert context.excursion(np.arange(3.0), 8) == 1.0  # shorter than the stretch: its median

def test_an_open_incident_stays_open_down_to_half_the_floor_that_opened_it() -> None:
    """Confirming an open incident's rank is a Schmitt trigger: a rank whose excess stands
    steadily at 0.7 x the materiality floor (its job's step time as noisy as it is at a job's
    end, so the floor is the noise floor) opens nothing, keeps its incident open, and lets it
    go at 0.4 x the floor."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(11)
    job = np.full(40, 1e9) + rng.normal(0, 100e6, 40)  # the job's own noise
    ctx = _ctx(w, 40, job)
    floor = max(ctx.cfg.min_share * ctx.step_ns, ctx.noise_floor())
    assert floor == ctx.noise_floor() > 0
    for share, kept in ((0.7, True), (0.4, False)):
        m = _noisy(rng, 40, world, sd=0.001)
        m[:, 1] += share * floor  # above its peers on every step, never a change
        assert not context.judge(ctx, m, 1.0).flag[1], share
        confirmed = context.judge(replace(ctx, confirm=frozenset({1})), m, 1.0)
        assert bool(confirmed.flag[1]) is kept, share
        assert confirmed.how[1] == ("confirm" if kept else ""), share


def test_a_change_needs_a_baseline_long_enough_to_show_its_noise() -> None:
    """Four steps before a rise cannot show the noise it must stand out of (a real job's
    first ten steps, its first one twice as long, passed for a baseline and a ring "changed"):
    no verdict; the same rise after `min_baseline` steps counts."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(8)
    for before, flagged in ((4, False), (8, True)):
        m = _noisy(rng, before + 6, w.grid.world)
        m[before:, 1] *= 1.5
        job = np.full(before + 6, 1e9) + rng.normal(0, 5e6, before + 6)
        job[before:] += 50e6
        ctx = _ctx(w, before + 6, job)
        assert bool(context.judge(ctx, m, 1.05).flag[1]) is flagged, before
        assert (context.job_change(ctx, 6) >= 2.0) is flagged, before


def test_a_doubled_stage_the_job_absorbs_is_named_absorbed() -> None:
    """A rank's own work at least doubled, far outside its own noise, while the job's step
    time did not move (a pipeline bubble or shared cores absorb it): "absorbed", from the
    change's onset, once it held 2 × onset_steps; a +40 % change under the same flat job time
    stays no verdict."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(5)
    m = _noisy(rng, 40, world)
    m[-10:, 1] *= 6.0
    m[-10:, 2] *= 1.4
    m[-20, 1] *= 1.2  # a noisy step of the baseline does not make it "intermittent"
    m[-6:, 3] *= 6.0  # as large, held 6 steps: not yet twice onset_steps
    flat = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    v = context.judge(_ctx(w, 40, flat), m, 1.05)
    assert v.flag[1] and v.how[1] == "absorbed" and int(v.since[1]) == 30
    assert not v.flag[2] and not v.flag[3]
    ref = context.reference(m, w.grid.stage)
    start = np.where(v.flag, v.since, -1)
    assert context.persistence(m, ref, start)[1] == 1.0
    assert context.persistence(m, ref)[1] < 1.0  # from its first noisy step instead


def _with_waits(w: Window, steps: int, wait: np.ndarray) -> Window:
    """`w` with one stage record per (step, rank) of `steps` steps whose thread waited
    `wait[step, rank]` ns for a CPU (the tracer's per-step counter)."""
    world = w.grid.world
    step, rank = (a.ravel() for a in np.meshgrid(np.arange(steps), np.arange(world),
                                                  indexing="ij"))
    one = np.full(step.size, 50_000_000, np.int64)
    zero = np.zeros(step.size, np.int64)
    stages = {"rank": rank, "step": step, "t_start": step * 60_000_000,
              "data_next_wait": zero, "model_fwd_loss": one, "model_backward": one,
              "callbacks": zero, "optim_step": zero, "step_other": zero,
              "sched_wait_ns": wait.ravel().astype(np.int64)}
    return Window(w.topo, {**w.tables, "stages": stages}, w.start_ns, w.now_ns)


def test_a_short_change_the_scheduler_did_not_cause_needs_no_longer_hold() -> None:
    """The 2 × onset_steps hold of a change the job's step time does not show (and of a rank
    beside fewer than `min_peers` peers) guards against a rank crowded off a shared core for a
    few hundred milliseconds. Where the rank's own steps' CPU wait did not rise with its time,
    crowding is ruled out and the change counts after onset_steps; where the wait rose with
    it, or the records lack the counter, it still waits for the longer hold."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(5)
    m = _noisy(rng, 40, world)
    m[-6:, 3] *= 6.0  # +500 ms a step, held 6 steps: shorter than twice onset_steps
    flat = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    assert not context.judge(_ctx(w, 40, flat), m, 1.05).flag[3]  # no counter: held
    wait = 2e6 + 2e5 * rng.standard_normal((40, world))
    v = context.judge(_ctx(_with_waits(w, 40, wait), 40, flat), m, 1.05)
    assert v.flag[3] and v.how[3] == "absorbed" and int(v.since[3]) == 34
    assert not v.flag[[0, 1, 2, *range(4, world)]].any()
    crowded = wait.copy()
    crowded[-6:, 3] += 400e6  # it waited for a CPU for most of its extra time
    assert not context.judge(_ctx(_with_waits(w, 40, crowded), 40, flat), m, 1.05).flag[3]
    few = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    few[-6:] += 500e6  # the job felt it, yet a change of a unit beside too few peers is held
    m2 = _noisy(rng, 40, world)
    m2[-6:, 3] *= 6.0
    groups_of_two = np.arange(world) // 2
    assert not context.judge(_ctx(w, 40, few), m2, 1.05, groups_of_two).flag[3]
    v2 = context.judge(_ctx(_with_waits(w, 40, wait), 40, few), m2, 1.05, groups_of_two)
    assert v2.flag[3] and v2.how[3] == "change"


def test_a_change_holds_only_over_the_steps_it_was_seen() -> None:
    """A rank's own time is unknown for its newest steps until its calls of a later step are
    stored. Beside too few peers its change must hold twice onset_steps: 6 steps seen and 3
    not yet known are 6 held, not 9; with 8 seen it counts."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(13)
    groups_of_two = np.arange(world) // 2
    job = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    job[-9:] += 500e6
    m = _noisy(rng, 40, world)
    m[-9:, 3] *= 6.0
    m[-3:, 3] = np.nan  # not known yet
    assert not context.judge(_ctx(w, 40, job), m, 1.05, groups_of_two).flag[3]
    m[-3:-1, 3] = m[-4, 3]  # two more steps seen: 8 held
    v = context.judge(_ctx(w, 40, job), m, 1.05, groups_of_two)
    assert v.flag[3] and v.how[3] == "change"


def test_a_short_change_the_scheduler_made_is_held_whatever_the_peers() -> None:
    """Beside many peers, with the job's step time up with it, a change of a rank whose steps
    waited for a CPU for at least half its rise — on average over the change: lost time adds
    up, two long waits in six steps are crowding too — must hold `CPU_HOLD` onsets, as a
    change of the CPU wait itself (a healthy DDP control's rank crowded off its core for 4
    steps was named `host cpu`); without the wait's rise it counts after onset_steps, and a
    crowded change that holds long enough counts."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(7)
    m = _noisy(rng, 40, world)
    m[-6:, 3] += 100e6  # +100 ms a step for 6 steps
    job = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    job[-6:] += 100e6  # the job felt it
    wait = 2e6 + 2e5 * rng.standard_normal((40, world))
    v = context.judge(_ctx(_with_waits(w, 40, wait), 40, job), m, 1.05)
    assert v.flag[3] and v.how[3] == "change"  # not crowded: onset_steps suffice
    spiky = wait.copy()
    spiky[-5, 3] += 180e6  # two long waits in the six steps: 60 ms a step on average,
    spiky[-3, 3] += 180e6  # none at the median
    assert not context.judge(_ctx(_with_waits(w, 40, spiky), 40, job), m, 1.05).flag[3]
    def held(steps: int) -> context.Verdict:
        m_long, job_long, spiky_long = m.copy(), job.copy(), spiky.copy()
        m_long[-steps:, 3] = m[-steps:, 3] + 100e6 * (m[-steps:, 3] < 150e6)
        job_long[-steps:] = job[-steps:] + 100e6 * (job[-steps:] < 1.05e9)
        spiky_long[-steps + 1:-6:2, 3] += 180e6  # long waits on every other step before
        return context.judge(_ctx(_with_waits(w, 40, spiky_long), 40, job_long), m_long, 1.05)

    assert context.CPU_HOLD * context.SlowConfig().onset_steps == 12
    assert not held(10).flag[3]  # crowded: twice the onset is not enough
    v = held(12)
    assert v.flag[3] and int(v.since[3]) == 28  # crowded, but it held CPU_HOLD onsets


def test_a_crowded_change_at_the_jobs_start_needs_the_cpu_rules_baseline() -> None:
    """A change the rank's CPU wait explains is CPU starvation, and while the judged steps
    reach back to the job's first one it needs the baseline the CPU-wait rule asks there
    (`BASELINE_FACTOR` × `min_baseline`: 16 steps): the scheduler places a job's threads in
    its first seconds (a healthy pipeline's rank crowded for 6 steps after 14 from the job's
    first, named by its forward at 0.95). The same change after 16 steps counts; so does one
    after 14 that its wait does not explain, or in a job older than its judged steps."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(17)
    started = -5_000_000_000  # the window opened 5 s before the job's first step

    def judged(base: int, crowded: bool, window_from: int = started) -> bool:
        n = base + 12
        m = _noisy(rng, n, world)
        m[base:, 3] += 100e6  # +100 ms a step, held 12 steps: CPU_HOLD onsets
        job = np.full(n, 1e9) + rng.normal(0, 5e6, n)
        job[base:] += 100e6
        wait = 2e6 + 2e5 * rng.standard_normal((n, world))
        if crowded:
            wait[base:, 3] += 80e6  # it waited for a CPU for most of its extra time
        ww = _with_waits(w, n, wait)
        ww = Window(ww.topo, ww.tables, window_from, ww.now_ns)
        ctx = _ctx(ww, n, job)
        assert context.from_job_start(ctx) == (window_from == started)
        return bool(context.judge(ctx, m, 1.05).flag[3])

    assert context.BASELINE_FACTOR * context.SlowConfig().min_baseline == 16
    assert not judged(14, crowded=True)
    assert judged(16, crowded=True)
    assert judged(14, crowded=False)
    assert judged(14, crowded=True, window_from=0)


def test_a_short_change_must_explain_the_jobs_rise_it_is_gated_on() -> None:
    """A rank slower by e a step makes its job wait about e. A rank whose own time rose for 6
    steps while the job's step time rose three times as much coincides with something else
    (a burst lengthening every rank's collectives): the job's rise is no evidence for it, and
    its change must hold twice onset_steps; the same rank's change counts after onset_steps
    when the job rose by about its excess, and counts once it has held long enough."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(11)
    m = _noisy(rng, 40, world)
    m[-6:, 3] += 30e6  # +30 ms a step for 6 steps
    wait = 2e6 + 2e5 * rng.standard_normal((40, world))  # not crowded
    ww = _with_waits(w, 40, wait)
    job = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    burst = job.copy()
    burst[-6:] += 100e6  # the job rose 100 ms: 3.3 × the rank's excess
    assert not context.judge(_ctx(ww, 40, burst), m, 1.05).flag[3]
    felt = job.copy()
    felt[-6:] += 30e6  # the job rose by the rank's excess
    v = context.judge(_ctx(ww, 40, felt), m, 1.05)
    assert v.flag[3] and v.how[3] == "change" and int(v.since[3]) == 34
    m_long, burst_long = _noisy(rng, 40, world), job.copy()
    m_long[-10:, 3] += 30e6
    burst_long[-10:] += 100e6  # held 10 steps, twice the onset and more
    v = context.judge(_ctx(ww, 40, burst_long), m_long, 1.05)
    assert v.flag[3] and int(v.since[3]) == 30


def test_a_change_inside_the_noise_of_its_own_series_is_not_evidence() -> None:
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(4)
    m = _noisy(rng, 40, w.grid.world)
    m[:, 1] = 100e6 * (1 + 0.3 * rng.standard_normal(40))  # a very noisy rank
    m[-8:, 1] += 35e6  # a rise within what its own series already does
    job = np.full(40, 1e9)
    job[-8:] += 40e6
    assert not context.judge(_ctx(w, 40, job), m, 1.05).flag[1]


def test_two_peers_give_no_verdict_on_a_persistent_difference() -> None:
    """Two DP rings are two samples: one of them is always the slower; without a change in
    time there is no evidence which is at fault, whatever the ratio. An outlier is judged by
    the spread of `min_peers` other units' means, or beside fewer by the per-step noise."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(5)
    m = _noisy(rng, 40, 2)
    m[:, 1] *= 2.5
    v = context.judge(_ctx(w, 40), m, 1.2, np.zeros(2, np.int64))
    assert not v.flag.any()
    # six peers: the same difference stands out of the peers' spread
    m6 = _noisy(rng, 40, 6)
    m6[:, 1] *= 2.5
    v6 = context.judge(_ctx(w, 40), m6, 1.2, np.zeros(6, np.int64))
    assert v6.flag.tolist() == [False, True, False, False, False, False]
    assert v6.how[1] == "outlier"
    # a 4-rank stage: three others' means give no spread to judge by (their MAD of three
    # numbers); the per-step noise does. 15 % more in a quantity whose steps swing by 10 %
    # is within it (the spread of three means said 7σ); 2.5x on every step is not
    four = np.zeros(4, np.int64)
    m4 = _noisy(rng, 40, 4, sd=0.1)
    m4[:, 1] *= 1.15
    assert not context.judge(_ctx(w, 40), m4, 1.05, four).flag.any()
    m4 = _noisy(rng, 40, 4)
    m4[:, 1] *= 2.5
    v4 = context.judge(_ctx(w, 40), m4, 1.2, four)
    assert v4.flag.tolist() == [False, True, False, False] and v4.how[1] == "few_peers"
    m5 = _noisy(rng, 40, 5)
    m5[:, 1] *= 2.5
    assert context.judge(_ctx(w, 40), m5, 1.2, np.zeros(5, np.int64)).how[1] == "outlier"
    # six peers that all differ this much: the "outlier" is inside their spread
    spread = 100e6 * np.linspace(1.0, 2.6, 6)[None, :] * (1 + 0.01 * rng.standard_normal((40, 6)))
    assert not context.judge(_ctx(w, 40), spread, 1.2, np.zeros(6, np.int64)).flag.any()


def test_an_outlier_needs_more_than_a_few_known_steps() -> None:
    """A persistent difference is a mean over many steps: a unit known on one or two of them
    (a rank's own time at a job's start, before its calls of a later step are stored) gives
    no outlier verdict, however far its one step stands out; known on 2 × `onset_steps` it
    does."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(8)
    k = context.SlowConfig().onset_steps
    m = _noisy(rng, 40, 8)
    m[:, 0] *= 1.6
    m[1:] = np.nan  # only the first step known, every rank
    assert not context.judge(_ctx(w, 40), m, 1.05, np.zeros(8, np.int64)).flag.any()
    m = _noisy(rng, 40, 8)
    m[:, 0] *= 1.6
    m[2 * k:] = np.nan
    v = context.judge(_ctx(w, 40), m, 1.05, np.zeros(8, np.int64))
    assert v.flag.tolist() == [True] + [False] * 7 and v.how[0] == "outlier"


def test_an_excess_below_the_jobs_own_noise_is_not_material() -> None:
    """A rank a millisecond slower in a job whose step time swings by tens of milliseconds
    (ranks sharing cores) costs the job nothing it can tell from its noise."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(6)
    m = _noisy(rng, 40, w.grid.world)
    m[:, 1] *= 1.3  # +30 ms on every step: an outlier among its peers
    one = np.zeros(w.grid.world, np.int64)  # every rank one peer set: 15 others
    calm = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    assert context.judge(_ctx(w, 40, calm), m, 1.05, one).flag[1]
    stormy = np.full(40, 1e9) + rng.normal(0, 200e6, 40)  # σ 200 ms: floor 100 ms
    assert not context.judge(_ctx(w, 40, stormy), m, 1.05, one).flag[1]


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


def test_an_intermittent_excess_needs_many_more_spikes_than_its_peers() -> None:
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    stage = w.grid.stage
    a, b = np.flatnonzero(stage == 0)[:2].tolist()
    c, d = np.flatnonzero(stage == 1)[:2].tolist()
    m = np.full((40, w.grid.world), 8e6)
    m[[-9, -7, -6, -3, -1], a] += 180e6  # five slow batches late in the window
    m[[5, 15, 25, 35], c] += 180e6  # four...
    m[[6, 16, 26], d] += 180e6  # ...beside a stage peer with three: the stage's noise
    v = context.judge(_ctx(w, 40, step_ns=1e9), m, 1.05, sparse=True)
    assert v.flag[a] and v.how[a] == "sparse" and v.exc[a] > 50e6
    assert int(v.since[a]) == 31
    assert not v.flag[[b, c, d]].any()
    m[[-5, -2], b] += 180e6  # two: too few, and with them a's five are within 3×2 + 2
    assert not context.judge(_ctx(w, 40, step_ns=1e9), m, 1.05, sparse=True).flag[[a, b]].any()
    m[[-5, -2], b] -= 180e6
    m[-7, a] -= 180e6  # four of four on one of four ranks: by chance 1 time in 64 (4 × ¼⁴)
    assert not context.judge(_ctx(w, 40, step_ns=1e9), m, 1.05, sparse=True).flag[a]


def test_spikes_spread_by_chance() -> None:
    """The chance that one of `units` equally likely units has at least `count` of `total`
    events: a union bound over the units of the binomial tail, exact where only one unit can
    reach the count; 3 of 3 on one of 4 ranks (a healthy job's first steps) is 1 in 16."""
    assert context.spread_by_chance(3, 3, 4) == pytest.approx(4 * 0.25 ** 3)
    assert context.spread_by_chance(5, 5, 4) < 0.01 < context.spread_by_chance(4, 4, 4)
    # exact for count > total / 2: enumerate every way 6 events fall on 4 units
    hits = sum(max(np.bincount(p, minlength=4)) >= 4
               for p in itertools.product(range(4), repeat=6))
    assert context.spread_by_chance(4, 6, 4) == pytest.approx(hits / 4 ** 6)
    assert context.spread_by_chance(0, 5, 4) == 1.0
    assert context.spread_by_chance(1, 9, 4) == 1.0  # capped: a union bound past certainty


def test_spikes_among_spiking_peers_need_a_quiet_stretch_before_them() -> None:
    """Where the peers spike too, a unit spiking more counts only when its first spike follows
    a quiet stretch its rate since makes improbable: on a contended control one rank spiked
    8 times from row 14 on (peers once each), as it always had. The same 8 spikes packed
    after 36 quiet rows are a change; beside peers that never spike, spread ones still count."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    stage = w.grid.stage
    a, b, c = np.flatnonzero(stage == 0)[:3].tolist()
    rows = [14, 18, 25, 27, 31, 35, 38, 48]
    m = np.full((50, world), 4.4e6)
    m[rows, a] += 20e6
    m[20, b] += 5e6
    m[32, c] += 5e6
    ctx = _ctx(w, 50, step_ns=60e6)
    assert not context.judge(ctx, m, 1.05, sparse=True).flag[a]  # e^(−8/36 × 14) ≈ 0.04
    m[rows, a] -= 20e6
    m[[36, 37, 39, 41, 43, 45, 47, 49], a] += 20e6
    v = context.judge(ctx, m, 1.05, sparse=True)
    assert v.flag[a] and v.how[a] == "sparse" and int(v.since[a]) == 36
    m[[36, 37, 39, 41, 43, 45, 47, 49], a] -= 20e6
    m[rows, a] += 20e6
    m[20, b] -= 5e6
    m[32, c] -= 5e6
    assert context.judge(ctx, m, 1.05, sparse=True).flag[a]  # peers without spikes of their own


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
    c = slow.analyze(tiny, now)
    assert c is not None and c.ranks == (10,) and c.stage == "data", c
    big = cb.copy()
    step_ns = float(np.median(sum(np.asarray(st_[k], dtype=np.int64) for k in (
        "data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step",
        "step_other"))))
    big[rank == 10] = 5_000 + int(0.1 * step_ns)
    st_["callbacks"] = big
    c = slow.analyze(Window(w.topo, {**w.tables, "stages": st_}, w.start_ns, w.now_ns), now)
    assert c is not None and c.ranks == (10,) and c.stage == "host cpu", c


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_union_of_intervals_per_group_matches_a_plain_sweep(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, groups = int(rng.integers(0, 40)), int(rng.integers(1, 6))
    g = rng.integers(0, groups, n)
    a = rng.integers(0, 1000, n)
    b = a + rng.integers(1, 300, n)
    got = own_time._union_by(g, a, b, groups)
    for k in range(groups):
        covered = np.zeros(1400, dtype=bool)
        for lo, hi in zip(a[g == k].tolist(), b[g == k].tolist(), strict=True):
            covered[lo:hi] = True
        assert got[k] == covered.sum()


def _ddp_window(slow_rank: int, factor: float, from_step: int, steps: int = 40) -> Window:
    """A 4-rank data-parallel job on one host: each step data 1 ms, forward 5 ms, backward
    (5 ms of compute, then the gradient all-reduce, which ends when the slowest rank's
    compute is done), optimizer 1 ms. `slow_rank`'s backward compute is `factor`× from
    `from_step`: every rank's backward *stage* time then grows (the waiting), its own time
    only on the slow rank."""
    from ingest.records import Communicator, JobTopology

    ms = 1_000_000
    world = 4
    topo = JobTopology(job_id="d", ts=0, world_size=world, dp=world, hosts=["h"] * world,
                       communicators=[Communicator(comm_id="dp0", kind="dp",
                                                   members=list(range(world)))])
    st_rows: dict[str, list[int]] = {k: [] for k in (
        "rank", "step", "t_start", "data_next_wait", "model_fwd_loss", "model_backward",
        "callbacks", "optim_step", "step_other")}
    op_rows: dict[str, list[object]] = {k: [] for k in (
        "rank", "comm_id", "op_seq", "op", "bytes", "peer", "stream", "t_enqueue", "t_start",
        "t_end", "step")}
    t = 10**18
    rng = np.random.default_rng(1)
    for s in range(steps):
        comp = [5 * ms * (factor if (r == slow_rank and s >= from_step) else 1.0)
                + rng.normal(0, 0.05 * ms) for r in range(world)]
        bwd_start = t + 6 * ms
        done = bwd_start + int(max(comp)) + ms  # the all-reduce ends 1 ms after the last joins
        for r in range(world):
            issue = bwd_start + int(comp[r])
            bwd = done - bwd_start
            for k, v in (("rank", r), ("step", s), ("t_start", t), ("data_next_wait", ms),
                         ("model_fwd_loss", 5 * ms), ("model_backward", bwd),
                         ("callbacks", 0), ("optim_step", ms), ("step_other", 0)):
                st_rows[k].append(int(v))
            for k, x in (("rank", r), ("comm_id", "dp0"), ("op_seq", s), ("op", "AllReduce"),
                         ("bytes", 4096), ("peer", -1), ("stream", 0), ("t_enqueue", issue),
                         ("t_start", issue), ("t_end", done), ("step", s)):
                op_rows[k].append(x)
        t = done + ms + ms
    tables = {"stages": {k: np.asarray(v, dtype=np.int64) for k, v in st_rows.items()},
              "ops": {k: np.asarray(v, dtype=object if k in ("comm_id", "op") else np.int64)
                      for k, v in op_rows.items()}}
    return Window(topo, tables, 10**18, t)


def test_own_time_takes_the_waiting_out_of_the_backward_stage() -> None:
    w = _ddp_window(slow_rank=2, factor=4.0, from_step=25)
    st_ = w.get("stages")
    late = np.asarray(st_["step"]) >= 26
    raw = np.asarray(st_["model_backward"])[late].reshape(-1, 4)
    assert np.ptp(raw.mean(axis=0)) < 0.01 * raw.mean()  # every rank's stage looks the same
    c = slow.analyze(w, w.now_ns)
    assert c is not None and c.ranks == (2,) and c.stage == "bwd pp=0", c
    assert c.component == "gpu_compute" and c.kind == "slowdown"
    assert "rankwatch.own_time.bwd" in {f.rule for f in c.findings}
    assert c.onset_ns is not None and c.confidence >= 0.8


def test_a_fault_free_job_has_no_conclusion() -> None:
    w = _ddp_window(slow_rank=-1, factor=1.0, from_step=0)
    assert slow.analyze(w, w.now_ns) is None


def _with_summaries(w: Window) -> Window:
    """`w` plus the kernel summaries the worker would store for its kernels (streams.kde over
    each (rank, kernel)), as the live path reads them from ClickHouse."""
    from streams.kde import summarize

    k = w.get("kernels")
    names, code = np.unique(np.asarray(k["kernel"]).astype(str), return_inverse=True)
    rank = np.asarray(k["rank"], dtype=np.int64)
    key = rank * names.size + code
    s = summarize(key, np.asarray(k["duration"], dtype=np.int64))
    rows = {"rank": s.key // names.size, "kernel": names[s.key % names.size].astype(object),
            "stream": np.zeros(s.n_rows, np.int64), "cluster": s.cluster.astype(np.int64),
            "count": s.count, "p50_ns": s.p50.astype(np.int64),
            "p99_ns": s.p99.astype(np.int64), "window_start": np.zeros(s.n_rows, np.int64)}
    return Window(w.topo, {**w.tables, "kernel_summaries": rows}, w.start_ns, w.now_ns)


def test_argus_l3_on_the_kernel_summaries_confirms_a_slower_kernel() -> None:
    w, now = window("kernel_slow rank=9 kernel=attn factor=3 at=1s")
    c = slow.analyze(_with_summaries(w), now)
    assert c is not None and c.ranks == (9,)
    argus = [f for f in c.findings if f.rule == "argus.l3"]
    assert argus and argus[0].culprit_ranks == (9,)
    # the attention kernels (flash_*) deviate, none of the others
    kernels = argus[0].evidence["kernels"]
    assert isinstance(kernels, list | tuple), argus[0].evidence
    assert all(str(k).startswith("flash") for k in kernels), argus[0].evidence
    assert "argus_l3_outlier" in c.labels
    plain = slow.analyze(w, now)  # no summaries stored: ARGUS did not run, and says so
    assert plain is not None and "argus.l3" not in {f.rule for f in plain.findings}
    assert c.confidence >= plain.confidence


def _links(rng: np.random.Generator, steps: int = 40) -> np.ndarray:
    """Four p2p links (two per pair of stages: groups [0, 0, 1, 1]), 12 ms per step each."""
    return 12e6 * (1 + 0.05 * rng.standard_normal((steps, 4)))


def test_a_link_in_a_small_peer_set_counts_only_by_its_own_rise_with_the_job() -> None:
    """Two links per pair of stages are too few to compare. A link whose own transfer time
    rose beyond its own noise, while the job's step time rose with it and its peer link did
    not move, is named; its peer, whose excess over the pair's reference rose only because
    the slower link's other end now arrives late and the third link got faster, is not."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(11)
    m = _links(rng)
    m[-10:, 1] += 34e6  # the slow link
    m[-10:, 3] *= 0.3  # the reverse hop: its receiver is now late, the data is there
    groups = np.array([0, 0, 1, 1])
    job = np.full(40, 70e6) + rng.normal(0, 2e6, 40)
    job[-10:] += 28e6
    v = context.judge(_ctx(w, 40, job, step_ns=70e6), m, 1.2, groups, floor=2e6, job_gate=False)
    assert v.flag.tolist() == [False, True, False, False]
    assert v.how[1] == "change" and v.exc[1] > 30e6 and v.ratio[1] > 3
    # the same rise while the job's step time stays flat: no verdict in a peer set of two
    flat = np.full(40, 70e6) + rng.normal(0, 2e6, 40)
    assert not context.judge(_ctx(w, 40, flat, step_ns=70e6), m, 1.2, groups, floor=2e6,
                             job_gate=False).flag.any()


def test_a_rise_every_link_shows_is_no_links() -> None:
    """A machine-wide stall lengthens every transfer for a few steps: the job slowed, each
    link rose beyond its own noise, but its peer link rose as well — no link is named."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(12)
    m = _links(rng)
    m[-6:] += np.array([30e6, 40e6, 15e6, 12e6])
    job = np.full(40, 70e6) + rng.normal(0, 2e6, 40)
    job[-6:] += 45e6
    v = context.judge(_ctx(w, 40, job, step_ns=70e6), m, 1.2, np.array([0, 0, 1, 1]),
                      floor=2e6, job_gate=False)
    assert not v.flag.any()


def test_a_jobs_only_ring_is_named_when_its_rise_is_the_jobs_and_no_cpu_wait_rose() -> None:
    """A DDP job's one ring has no like unit to show that its rise is its own. It is named
    when the rise accounts for the job's (the ranks' own work did not slow with it) and the
    ranks' steps did not wait more for a CPU (the host's contention lengthens transfers too);
    without the counters, or with either of the two, no verdict."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(15)
    one = _links(rng)[:, :1]
    one[-10:] += 34e6
    job = np.full(40, 70e6) + rng.normal(0, 2e6, 40)
    job[-10:] += 33e6

    def verdict(win: Window, job_step: np.ndarray) -> context.Verdict:
        return context.judge(_ctx(win, 40, job_step, step_ns=70e6), one, 1.2,
                             np.zeros(1, np.int64), floor=2e6, job_gate=False)

    assert not verdict(w, job).flag.any()  # no counters: contention cannot be ruled out
    calm = np.abs(2e6 + 1e6 * rng.standard_normal((40, world)))
    v = verdict(_with_waits(w, 40, calm), job)
    assert v.flag[0] and v.how[0] == "change" and v.exc[0] > 25e6
    busy = calm.copy()
    busy[-10:] += 25e6  # every rank waited for a CPU: the host's contention rose
    assert not verdict(_with_waits(w, 40, busy), job).flag.any()
    everywhere = job.copy()
    everywhere[-10:] += 60e6  # the job rose by three times the ring's rise: its work slowed
    assert not verdict(_with_waits(w, 40, calm), everywhere).flag.any()


def test_a_links_short_change_holds_twice_the_onset_where_the_ranks_wait_for_cpus() -> None:
    """A link's transfers run in its transport's threads. Where the job's ranks wait for CPUs
    (more threads than cores), the scheduler crowds those threads in turn as it crowds the
    ranks': a link's change of 5 steps among 5 like links, the job's step time up with it,
    is named where the ranks do not wait, held to twice the onset where they do."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(21)
    groups = np.zeros(6, dtype=np.int64)

    def named(change: int, share: float) -> bool:
        m = 12e6 * (1 + 0.05 * rng.standard_normal((40, 6)))
        m[-change:, 1] += 20e6
        job = np.full(40, 70e6) + rng.normal(0, 2e6, 40)
        job[-change:] += 15e6
        # `_with_waits`' steps take 100 ms: each waits `share` of that
        waits = _with_waits(w, 40, np.full((40, w.grid.world), share * 100e6))
        ctx = _ctx(waits, 40, job, step_ns=70e6)
        assert context.host_crowded(ctx) == (share >= context.CROWDED_SHARE)
        v = context.judge(ctx, m, 1.2, groups, floor=2e6, job_gate=False)
        return bool(v.flag[1]) and not v.flag[[0, 2, 3, 4, 5]].any()

    assert named(5, 0.0) and not named(5, 0.05)
    assert named(8, 0.0) and named(8, 0.05)


def test_a_links_change_is_seen_through_its_newest_steps_not_known_yet() -> None:
    """A link's newest steps may be unknown (nan: pairs whose send has not completed): its
    change is judged on the newest steps that are known."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    rng = np.random.default_rng(14)
    m = _links(rng)
    m[-12:, 1] += 34e6
    m[-4:, :] = np.nan
    job = np.full(40, 70e6) + rng.normal(0, 2e6, 40)
    job[-12:] += 28e6
    v = context.judge(_ctx(w, 40, job, step_ns=70e6), m, 1.2, np.array([0, 0, 1, 1]),
                      floor=2e6, job_gate=False)
    assert v.flag.tolist() == [False, True, False, False]


def test_a_ranks_change_is_seen_through_its_newest_known_steps() -> None:
    """A rank's own time of a step is unknown until its calls of a later step are stored: with
    long steps the newest three or four rows of every rank are nan. The change is judged on
    the newest steps that are known, not missed until the unknown ones fill in."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(4)
    m = _noisy(rng, 40, world)
    m[-9:, 1] *= 3.0  # the last 9 steps of rank 1 are slow…
    m[-3:, :] = np.nan  # …the newest 3 of every rank not known yet
    job = np.full(40, 1e9) + rng.normal(0, 5e6, 40)
    job[-9:] += 200e6
    v = context.judge(_ctx(w, 40, job), m, 1.05)
    assert v.flag.tolist() == [x == 1 for x in range(world)]
    assert v.how[1] == "change" and int(v.since[1]) == 31


def _tp_delayed(w: Window, comm: str, from_step: int, ns: int) -> Window:
    """`w` with every op on `comm` from `from_step` on ending `ns` later (a slower transfer:
    its members start it as before)."""
    ops = dict(w.get("ops"))
    on = network.is_comm(ops, comm) & (ops["step"] >= from_step)
    ops["t_end"] = np.where(on, ops["t_end"] + ns, ops["t_end"])
    return Window(w.topo, {**w.tables, "ops": ops}, w.start_ns, w.now_ns)


def test_a_tp_group_whose_transfers_slowed_is_named_as_a_whole() -> None:
    """A TP group's collectives take longer for every member (a slower link between them): its
    transfer time — the shortest member time per op — rose beyond its own noise with the job's
    step time. Two TP groups per pipeline stage are too few to compare, so it is judged by its
    own rise, held twice the onset (8 steps; 6 are not enough); without chunk counters
    nothing says which member's link it is: the whole group, marked as such. With chunk
    counters, TP groups are left to the members' DP rings. (The window holds the job's
    first step: the change comes after 16, `test_a_rings_change_beside_few_rings_…`.)"""
    counted, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no", steps=26)
    w = Window(counted.topo, {k: v for k, v in counted.tables.items() if k != "chunks"},
               counted.start_ns, counted.now_ns)
    rng = np.random.default_rng(5)
    job = np.full(26, 300e6) + rng.normal(0, 3e6, 26)
    job[16:] += 60e6
    slow_link = _tp_delayed(w, "tp:pp2:dp0", 16, 30_000_000)
    sus = [s for s in network.suspects(_ctx(slow_link, 26, job, step_ns=300e6))
           if s.stage == "tp_collectives"]
    assert [(s.ranks, s.component, s.whole_ring) for s in sus] == [((8, 9), "nic_rdma", True)]
    for quiet in (w, _tp_delayed(counted, "tp:pp2:dp0", 16, 30_000_000)):
        assert not [s for s in network.suspects(_ctx(quiet, 26, job, step_ns=300e6))
                    if s.stage == "tp_collectives"]
    # the same rise 6 steps old: not yet held long enough
    early = _tp_delayed(w, "tp:pp2:dp0", 20, 30_000_000)
    assert not [s for s in network.suspects(_ctx(early, 26, np.r_[job[:20], job[16:22]],
                                                 step_ns=300e6))
                if s.stage == "tp_collectives"]


def test_a_rings_change_beside_few_rings_needs_twice_the_baseline() -> None:
    """A ring judged on its own past alone (fewer than `min_peers` like rings) needs
    `BASELINE_FACTOR` × `min_baseline` (16) steps before its change, wherever the judged steps
    begin: its baseline is whatever stretch they begin with. (A ring beside enough like ones
    needs them while the judged steps reach back to the job's first one, as a rank's CPU wait
    does: the ranks' threads, a CPU transport's transfers with them, are still being placed on
    the cores.) The slowed TP group above, one of two in its stage, its change after 12
    steps: no verdict, whether the window holds the job's start or opened after the job's
    first record (an older job); after 16, named in both."""
    counted, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no", steps=26)
    w = Window(counted.topo, {k: v for k, v in counted.tables.items() if k != "chunks"},
               counted.start_ns, counted.now_ns)
    first = int(np.min(w.get("stages")["t_start"]))
    rng = np.random.default_rng(5)

    def named(onset: int, young: bool) -> bool:
        job = np.full(26, 300e6) + rng.normal(0, 3e6, 26)
        job[onset:] += 60e6
        slowed = _tp_delayed(w, "tp:pp2:dp0", onset, 30_000_000)
        if not young:  # the window opens at the job's first record: no start-up in it
            slowed = Window(slowed.topo, slowed.tables, first, slowed.now_ns)
        ctx = _ctx(slowed, 26, job, step_ns=300e6)
        assert context.from_job_start(ctx) == young
        return any(s.stage == "tp_collectives" for s in network.suspects(ctx))

    assert not named(12, young=False) and not named(12, young=True)
    assert named(16, young=True) and named(16, young=False)


#: a fault-free 4-rank DDP job's one ring on this 2-core machine (ms a step: its transfer time,
#: the shortest member time per all-reduce, summed) and its job's step time, steps 50-99 of 300
QUIET_RING = [2.0, 2.2, 2.5, 2.0, 1.2, 1.5, 2.8, 2.5, 3.9, 6.7, 1.5, 10.2, 7.0, 6.2, 12.2, 2.0,
              5.2, 2.4, 3.7, 16.2, 3.9, 4.7, 2.6, 5.7, 5.9, 6.7, 14.9, 5.6, 17.4, 3.3, 1.5, 7.9,
              6.7, 4.6, 3.6, 1.6, 3.1, 9.0, 4.2, 15.0, 4.2, 6.7, 8.7, 7.6, 6.0, 5.4, 9.1, 12.5,
              7.3, 6.3]
QUIET_JOB = [48, 48, 49, 52, 50, 49, 52, 49, 51, 52, 50, 59, 57, 52, 62, 51, 50, 48, 52, 62, 53,
             51, 49, 51, 53, 54, 62, 54, 66, 50, 49, 56, 52, 53, 48, 49, 51, 58, 51, 62, 54, 57,
             57, 55, 52, 54, 58, 60, 55, 55]


def test_a_lone_rings_quiet_first_steps_are_no_baseline() -> None:
    """A DDP job's one ring, its transfer 1.2-24.6 ms a step (median 5) over its whole run,
    whose judged steps began with 8 quiet ones (1.2-2.8 ms, `QUIET_RING`): its return to its
    usual level was named a change (3.2x, 6.6σ) while 8 steps were a baseline. No verdict
    now; the same ring quiet for 20 steps and then 6 ms slower on every step is one."""
    w, _ = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    world = w.grid.world
    rng = np.random.default_rng(17)
    calm = _with_waits(w, 50, np.abs(1.5e6 + 0.7e6 * rng.standard_normal((50, world))))

    def verdict(one: np.ndarray, job: np.ndarray) -> context.Verdict:
        return context.judge(_ctx(calm, 50, job, step_ns=float(np.median(job))), one[:, None],
                             1.2, np.zeros(1, np.int64), floor=2e6, job_gate=False)

    ring, job = np.array(QUIET_RING) * 1e6, np.array(QUIET_JOB, dtype=np.float64) * 1e6
    assert not verdict(ring, job).flag[0]
    slowed = ring.copy()
    slowed[:20] = rng.uniform(1.2e6, 2.8e6, 20)
    slowed[20:] = rng.uniform(7e6, 9e6, 30)
    job[20:] += 6e6
    v = verdict(slowed, job)
    # the onset: the split whose rise is largest in standard errors, a step or two late
    assert v.flag[0] and v.how[0] == "change" and 20 <= int(v.since[0]) <= 22


def test_a_tp_member_with_slower_compute_is_named_not_its_group() -> None:
    """A member whose compute is slower arrives late at its TP group's collectives; the other
    member waits inside them. The group's transfer time (the shortest member time) does not
    rise, or follows the member's own slowdown: the member is the culprit."""
    w, now = window("gpu_slow rank=9 factor=1.6 at=2s", steps=16)
    c = slow.analyze(w, now)
    assert c is not None and c.ranks == (9,) and c.stage != "tp_collectives"
    assert "ring_member_unknown" not in c.labels


def test_intermittent_evidence_names_the_rank_at_most_at_075() -> None:
    """A count of slow steps against the peers' names the rank, not why it spikes (a rank
    starved of CPU now and then spikes in the same phases): jitter at most 0.75."""
    w, now = window("data_tail rank=9 p=0.3 delay=180ms at=3s", steps=24)
    c = slow.analyze(w, now)
    assert c is not None and (c.kind, c.ranks, c.stage) == ("jitter", (9,), "data")
    assert "evidence_sparse" in c.labels and c.confidence == slow.SPARSE_CONFIDENCE == 0.75


MS = 1_000_000
Call = tuple[str, int, int, int]  # op, peer, t_start, t_end


def _replica_step(t0: tuple[int, int], m: int, slow_bwd: float, link_delay: int,
                  rng: np.random.Generator) -> tuple[dict[int, list[Call]], list[list[int]]]:
    """One step of one replica of a 2-stage 1F1B pipeline (stage 0 = side 0, stage 1 = side
    1), from each side's step start: per side its calls in order and [forward, backward,
    all-reduce start]. Stage 0: one warm-up forward, then forward i+1 / backward i; stage 1:
    forward i / backward i. A send is asynchronous: it completes when its receiver takes the
    data, and its record ends at the first of its rank's later calls (or the step's
    all-reduce) that finds it complete."""
    hop = MS // 2
    t = [t0[0] + MS, t0[1] + MS]  # after 1 ms of data loading
    calls: list[list[list[int | str]]] = [[], []]  # [op, peer side, t_start, microbatch | end]
    passes = [[0, 0, 0], [0, 0, 0]]
    posted = [[0] * m, [0] * m]  # activations (side 0) and gradients (side 1) handed over
    done: dict[tuple[int, int], int] = {}  # (sender side, microbatch) -> send complete

    def jitter(ms: float) -> int:
        return int(ms * MS * (1 + 0.03 * float(rng.standard_normal())))

    def send(side: int, i: int, delay: int) -> None:
        calls[side].append(["Send", 1 - side, t[side], i])
        t[side] += delay
        posted[side][i] = t[side] + hop
        t[side] += 20_000

    def recv(side: int, i: int) -> None:
        done[(1 - side, i)] = max(t[side], posted[1 - side][i])
        calls[side].append(["Recv", 1 - side, t[side], done[(1 - side, i)] + 20_000])
        t[side] = done[(1 - side, i)] + 20_000

    def forward0(i: int) -> None:
        start = t[0]
        t[0] += jitter(2)
        send(0, i, link_delay)
        passes[0][0] += t[0] - start

    def backward0(i: int) -> None:
        start = t[0]
        recv(0, i)
        t[0] += jitter(5)
        passes[0][1] += t[0] - start

    def both1(i: int) -> None:
        start = t[1]
        recv(1, i)
        t[1] += jitter(2)
        passes[1][0] += t[1] - start
        start = t[1]
        t[1] += jitter(5 * slow_bwd)
        send(1, i, 0)
        passes[1][1] += t[1] - start

    forward0(0)
    for i in range(m):
        both1(i)
        if i + 1 < m:
            forward0(i + 1)
        backward0(i)
    out: dict[int, list[Call]] = {}
    for side in (0, 1):
        passes[side][2] = t[side]
        looks = np.asarray([int(c[2]) for c in calls[side]] + [t[side]], dtype=np.int64)
        out[side] = []
        for op, peer, c0, x in calls[side]:
            end = int(x)
            if op == "Send":
                seen = looks[looks >= done[(side, int(x))]]
                end = int(seen[0]) if seen.size else t[side]
            out[side].append((str(op), int(peer), int(c0), end))
    return out, passes


def _pipeline_window(slow_rank: int, factor: float, from_step: int, steps: int = 40,
                     m: int = 4, link_delay: int = 0) -> Window:
    """A 2-stage x 2-replica 1F1B pipeline (stage 0 on host a, stage 1 on host b), as the
    real catalog's gloo job runs it (`_replica_step`): per microbatch a forward of 2 ms and a
    backward of 5 ms, asynchronous sends seen complete late (a send's record spans the
    compute after it, and a slow receiver's whole backward), blocking receives; the step ends
    with each stage's gradient all-reduce, inside the backward stage. `slow_rank`'s backward
    compute is `factor`x from `from_step`; with `link_delay` (ns) its sends instead hand
    their data over that much late, inside the call (a slower wire)."""
    from ingest.records import Communicator, JobTopology

    topo = JobTopology(job_id="p", ts=0, world_size=4, pp=2, dp=2, microbatches=m,
                       hosts=["a", "a", "b", "b"],
                       communicators=[Communicator(comm_id="world", kind="world",
                                                   members=[0, 1, 2, 3]),
                                      Communicator(comm_id="dp0", kind="dp", members=[0, 1]),
                                      Communicator(comm_id="dp1", kind="dp", members=[2, 3])])
    stages: list[tuple[int, ...]] = []  # rank step t_start fwd bwd
    # rank, comm, op_seq, op, peer, t_start, t_end, step
    ops: list[tuple[int, str, int, str, int, int, int, int]] = []
    rng = np.random.default_rng(5)
    seq = [0] * 4
    t_rank = [10**18] * 4
    for s in range(steps):
        late = s >= from_step
        joined: dict[int, tuple[int, int, int]] = {}  # rank -> fwd, bwd, all-reduce start
        for rep in range(2):
            ranks = (rep, 2 + rep)  # its stage 0 and stage 1 ranks
            calls, passes = _replica_step(
                (t_rank[ranks[0]], t_rank[ranks[1]]), m,
                factor if late and ranks[1] == slow_rank else 1.0,
                link_delay if late and ranks[0] == slow_rank else 0, rng)
            for side, r in enumerate(ranks):
                for op, peer, c0, c1 in calls[side]:
                    ops.append((r, "world", seq[r], op, ranks[peer], c0, c1, s))
                    seq[r] += 1
                joined[r] = (passes[side][0], passes[side][1], passes[side][2])
        for stage, members in ((0, (0, 1)), (1, (2, 3))):
            done = max(joined[r][2] for r in members) + MS
            for r in members:
                fwd, bwd, ar = joined[r]
                ops.append((r, f"dp{stage}", s, "AllReduce", -1, ar, done, s))
                stages.append((r, s, t_rank[r], fwd, bwd + done - ar))
                t_rank[r] = done + MS  # the optimizer
    st = np.asarray(stages, dtype=np.int64)
    zero = np.zeros(len(stages), dtype=np.int64)
    tables = {"stages": {"rank": st[:, 0], "step": st[:, 1], "t_start": st[:, 2],
                         "data_next_wait": zero + MS, "model_fwd_loss": st[:, 3],
                         "model_backward": st[:, 4], "callbacks": zero, "optim_step": zero + MS,
                         "step_other": zero},
              "ops": {"rank": np.asarray([o[0] for o in ops], dtype=np.int64),
                      "comm_id": np.asarray([o[1] for o in ops], dtype=object),
                      "op_seq": np.asarray([o[2] for o in ops], dtype=np.int64),
                      "op": np.asarray([o[3] for o in ops], dtype=object),
                      "bytes": np.full(len(ops), 4096, dtype=np.int64),
                      "peer": np.asarray([o[4] for o in ops], dtype=np.int64),
                      "stream": np.zeros(len(ops), dtype=np.int64),
                      "t_enqueue": np.asarray([o[5] for o in ops], dtype=np.int64),
                      "t_start": np.asarray([o[5] for o in ops], dtype=np.int64),
                      "t_end": np.asarray([o[6] for o in ops], dtype=np.int64),
                      "step": np.asarray([o[7] for o in ops], dtype=np.int64)}}
    return Window(topo, tables, 10**18, max(t_rank))


def test_a_pipeline_ranks_slower_backward_is_its_backward_not_its_forward() -> None:
    """In a 1F1B pipeline the passes interleave and the sends are asynchronous: the last
    stage's backward 4x slower must show in its own backward time, not its forward's; its
    gradient link looks slower too (its receiver waits for it), and is that backward's
    effect."""
    w = _pipeline_window(slow_rank=3, factor=4.0, from_step=25)
    c = slow.analyze(w, w.now_ns)
    assert c is not None and c.ranks == (3,) and (c.stage, c.component) == (
        "bwd pp=1", "gpu_compute"), c
    rules = {f.rule for f in c.findings}
    assert "rankwatch.own_time.bwd" in rules, rules
    assert "rankwatch.own_time.fwd" not in rules, rules
    steps, step_ns, job = context.judged_steps(w, slow.SlowConfig())
    ctx = context.Ctx(w, slow.SlowConfig(), steps, step_ns, slow.peer_stages(w),
                      int(np.asarray(w.get("stages")["t_start"]).min()), job, frozenset())
    late, early = steps >= 27, steps < 24
    own_b = own_time.own_times(ctx, "model_backward")
    own_f = own_time.own_times(ctx, "model_fwd_loss")
    # the backward's own time is its compute: 4 x 5 ms per step, 4x on the culprit
    assert np.nanmedian(own_b[early]) == pytest.approx(20e6, rel=0.1)
    assert np.nanmedian(own_b[late, 3]) == pytest.approx(80e6, rel=0.1)
    # the forward's own time does not move with the backward
    assert np.nanmedian(own_f[late, 3]) == pytest.approx(np.nanmedian(own_f[early, 3]), rel=0.1)
    # its gradient link's shorter time is the receive, which waits for the late sender: a
    # link suspect only while nothing says the sender's own work rose with it
    assert p2p.suspects(ctx, set()) == []
    ctx_link = context.Ctx(w, slow.SlowConfig(), steps, step_ns, slow.peer_stages(w),
                           ctx.lo_ns, job, frozenset())
    ctx_link.memo["own_time:model_fwd_loss"] = np.zeros_like(own_f)  # as if its work were flat
    ctx_link.memo["own_time:model_backward"] = np.zeros_like(own_b)
    assert [s.ranks for s in p2p.suspects(ctx_link, set())] == [(3,)]


def test_a_pipeline_ranks_slower_sends_are_its_link() -> None:
    """The same pipeline with rank 1's sends handing their data over 6 ms late, inside the
    call: its link is named, not its forward (the time inside the call is not its own)."""
    w = _pipeline_window(slow_rank=1, factor=1.0, from_step=25, link_delay=6_000_000)
    c = slow.analyze(w, w.now_ns)
    assert c is not None and c.ranks == (1,) and (c.stage, c.component) == (
        "pp_p2p", "nic_rdma"), c
    assert not {f.rule for f in c.findings} & {"rankwatch.own_time.fwd",
                                                "rankwatch.own_time.bwd"}


def test_a_fault_free_pipeline_has_no_conclusion() -> None:
    w = _pipeline_window(slow_rank=-1, factor=1.0, from_step=0)
    assert slow.analyze(w, w.now_ns) is None


def test_a_links_lasting_excess_keeps_only_an_incident_that_named_a_link() -> None:
    """Rank 1's sends are 6 ms late from the job's start: a lasting difference, which links
    have by topology — no verdict. An open incident on rank 1 that named its link keeps it
    while the excess persists; one that named another of its stages does not get the link as
    its new stage."""
    w = _pipeline_window(slow_rank=1, factor=1.0, from_step=0, link_delay=6_000_000)
    assert slow.analyze(w, w.now_ns) is None
    kept = slow.analyze(w, w.now_ns, confirm=(1,), confirm_stage="pp_p2p")
    assert kept is not None and (kept.ranks, kept.stage) == ((1,), "pp_p2p"), kept
    assert slow.analyze(w, w.now_ns, confirm=(1,), confirm_stage="callbacks") is None


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 9), st.integers(1, 7), st.integers(0, 2**32 - 1),
       st.sampled_from([np.float64, np.float32]), st.sampled_from([0, 1]))
def test_nan_median_is_numpys_nanmedian(rows: int, cols: int, seed: int, dtype: type,
                                        axis: int) -> None:
    """`nan_median` gives np.nanmedian's values, dtype and shape exactly: NaN lanes, all-NaN
    lanes, empty lanes, ties, infinities, both float widths, both axes."""
    import warnings

    rng = np.random.default_rng(seed)
    x: np.ndarray = np.round(rng.standard_normal((rows, cols)) * 4,
                             int(rng.integers(0, 3))).astype(dtype)
    x[rng.random(x.shape) < rng.random()] = np.nan
    if x.size and rng.random() < 0.2:
        x.flat[int(rng.integers(x.size))] = rng.choice([np.inf, -np.inf])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = np.asarray(np.nanmedian(x, axis=axis)) if x.shape[axis] else \
            np.full(x.shape[1 - axis], np.nan, dtype=dtype)
    got = context.nan_median(x, axis=axis)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)  # nan where nan, exact elsewhere
    assert context.nan_median(x[:, 0] if cols else x, axis=0).shape == ()


def test_running_medians_are_numpys_median_of_every_prefix() -> None:
    """`own_change` reads the medians of every baseline and newest run from one pass of sorted
    insertions; they must be np.median's values exactly (ties, even and odd lengths)."""
    rng = np.random.default_rng(3)
    for x in (rng.standard_normal(57), np.round(rng.standard_normal(40), 1),
              (rng.standard_normal(57) * 1e7).astype(np.float32),
              (rng.standard_normal(33) * 1e7).astype(np.int64),
              np.array([2.0, 2.0, 1.0, 3.0]), np.array([5.0])):
        got = context._running_medians(x)
        assert np.isnan(got[0]) and len(got) == x.size + 1
        assert got[1:] == [float(np.median(x[:i])) for i in range(1, x.size + 1)]


def test_beats_are_read_only_for_a_culprit_the_steps_cannot_judge() -> None:
    """`analyze(..., beats=)`: a window read without beats gets them from the loader only once
    a culprit is found whose CPU the steps' own counters cannot judge, and concludes as the
    window with its beats does; a window without a suspect reads none."""
    w, now = window("gpu_slow rank=9 factor=3 at=1s")
    calls: list[int] = []

    def beats() -> dict[str, np.ndarray]:
        calls.append(1)
        return dict(w.tables["beats"])

    def without(w: Window, *drop: str) -> Window:
        return Window(w.topo, {k: v for k, v in w.tables.items() if k != "beats"}
                      | {"stages": {k: v for k, v in w.tables["stages"].items()
                                    if k not in drop}}, w.start_ns, w.now_ns)

    want = slow.analyze(w, now)
    assert want is not None and want.ranks == (9,)
    assert slow.analyze(without(w), now, beats=beats) == want
    assert calls == []  # the steps' own counters judge it
    assert "sched_wait_ns" in w.tables["stages"]
    older = Window(w.topo, {**without(w, "sched_wait_ns").tables, "beats": w.tables["beats"]},
                   w.start_ns, w.now_ns)
    want = slow.analyze(older, now)  # an older tracer's stage records: the beats judge it
    assert want is not None and want.ranks == (9,)
    assert slow.analyze(without(w, "sched_wait_ns"), now, beats=beats) == want
    assert calls == [1]
    quiet, qnow = window("gpu_slow rank=9 factor=1.01 at=1s expect=no")
    calls.clear()
    assert slow.analyze(without(quiet, "sched_wait_ns"), qnow, beats=beats) is None
    assert calls == []


def test_an_undeclared_pipelines_calls_are_planned_on_the_stages_they_show() -> None:
    """A job that declares no pipeline (pp 1: no RANKWATCH_PP) but whose ranks send to one
    another is compared by the stages its p2p pattern shows (`peer_stages`); the link
    analysis plans each call on those stages too — on the topology's single stage it indexed
    past the plan and the whole slowdown analysis raised, on every try of such a job until its
    agent published the inferred shape. A call on a stage the plan lacks is no 1F1B call."""
    from diagnosis.rules.pipeline_ops import pp_call_microbatch

    cfg = JobConfig(job_id="u", tp=1, pp=2, dp=2, microbatches=2, steps=30,
                    declared_shape=False, ranks_per_host=1)  # a NIC carries each hop
    d = collect(Simulation(cfg, ["gpu_slow rank=3 factor=1.8 at=3s"]).batches())
    topo = d.pop("jobs")["topology"][0]
    assert topo.pp == 1
    now = int(max(d["beats"]["ts"].max(), d["ops"]["t_enqueue"].max()))
    w = Window(topo, d, 0, now)
    assert int(slow.peer_stages(w).max()) == 1  # two stages, from the p2p pattern
    c = slow.analyze(w, now)  # raised IndexError
    assert c is not None and c.ranks == (3,)
    _, ok = pp_call_microbatch(1, 1, np.array([0, 1, -1]), np.array([0, 0, 0]),
                               np.array([True, True, True]), np.array([True, True, True]))
    assert not ok[1:].any()


def test_a_ddp_jobs_default_group_is_its_dp_ring() -> None:
    """A DDP job that names no process group reduces its gradients on the default one
    ("world"): with no TP, PP or DP communicator declared and no pipeline in its p2p pattern,
    that group is the job's DP ring. A job that declares one, or a pipeline, keeps its own."""
    cfg = JobConfig(job_id="t", tp=1, pp=1, dp=4, steps=4)
    d = collect(Simulation(cfg, []).batches())
    topo = d.pop("jobs")["topology"][0]
    world_only = topo.model_copy(update={"communicators": [
        c for c in topo.communicators if c.kind == "world"]})

    def ctx_of(t: JobTopology) -> context.Ctx:
        w = Window(t, d, 0, 2**62)
        return context.Ctx(w, context.SlowConfig(), np.arange(4), 1e8, slow.peer_stages(w))

    assert network.data_parallel_only(ctx_of(world_only))
    assert not network.data_parallel_only(ctx_of(topo))  # its DP ring is declared
    piped = world_only.model_copy(update={"pp": 2, "dp": 2})
    assert not network.data_parallel_only(ctx_of(piped))
