"""diagnosis.slow.cpu.refine_steps: a culprit re-labelled as its host's CPU from the CPU wait
each stage record carries (`sched_wait_ns`) — over the judged steps since its onset, more than
its own steps before and its peers' since, beyond the per-step shares' standard error, and
enough to explain its excess; no verdict (the beats decide) where the records lack the counter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from diagnosis.conclusion import Suspicion
from diagnosis.slow import SlowConfig, context, cpu, peer_stages
from diagnosis.slow.context import Ctx, judged_steps
from diagnosis.window import Window
from ingest.records import Communicator, JobTopology
from ingest.units import MILLISECOND as MS

STEPS, ONSET = 50, 30
TOP = Suspicion((1,), "bwd pp=0", "gpu_compute", 10e6, ("rankwatch.excess.model_backward",),
                "rank 1: model_backward 1.4x its peers", 9.0, "change", ONSET)


def ctx(share: dict[int, tuple[float, float]], extra_ms: float = 10.0, noise: float = 0.01,
        counter: bool = True, seed: int = 0, n_steps: int = STEPS, onset: int = ONSET,
        window_from_ns: int = 0) -> Ctx:
    """4 DDP ranks, `n_steps` (50) steps of 50 ms, 60 ms apart from 0; rank r's thread waits
    share[r] = (before step `onset` (30), from it) of each step (default 3 %), with Gaussian
    per-step scatter `noise`; rank 1's step is `extra_ms` longer from step `onset` (its
    backward). The window starts at `window_from_ns`: 0, a job older than the window (its
    first record at the window's start); seconds before 0, a job that began inside it."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(4):
        b, a = share.get(r, (0.03, 0.03))
        for s in range(n_steps):
            back = 30 * MS + (int(extra_ms * MS) if r == 1 and s >= onset else 0)
            total = 20 * MS + back
            sh = max((a if s >= onset else b) + rng.normal(0, noise), 0.0)
            rows.append((r, s, s * 60 * MS, 20 * MS, back, int(sh * total) if counter else -1))
    return stage_ctx(rows, window_from_ns, n_steps * 60 * MS, SlowConfig())


def stage_ctx(rows: Sequence[tuple[int, ...]], from_ns: int, to_ns: int, cfg: SlowConfig) -> Ctx:
    """The analysis context of a 4-rank DDP job's stage records, one (rank, step, t_start,
    forward, backward, CPU wait) per row, in a window from `from_ns` to `to_ns`."""
    rank, step, t0, fwd, bwd, wait = (np.array(x, dtype=np.int64) for x in zip(*rows, strict=True))
    z = np.zeros(rank.size, np.int64)
    stages: dict[str, np.ndarray] = {"rank": rank, "step": step, "t_start": t0, "data_next_wait": z,
              "model_fwd_loss": fwd, "model_backward": bwd, "callbacks": z, "optim_step": z,
              "step_other": z, "sched_wait_ns": wait}
    topo = JobTopology(job_id="j", ts=0, world_size=4, dp=4, hosts=["h"] * 4,
                       communicators=[Communicator(comm_id="world", kind="dp",
                                                   members=[0, 1, 2, 3])])
    w = Window(topo, {"stages": stages}, from_ns, to_ns)
    steps, step_ns, job = judged_steps(w, cfg)
    return Ctx(w, cfg, steps, step_ns, peer_stages(w), 0, job)


def _stage(s: Suspicion | None) -> str | None:
    assert s is not None, "no verdict"
    return s.stage


def test_a_rank_waiting_for_a_cpu_in_its_slow_steps_is_its_hosts_cpu() -> None:
    out, judged = cpu.refine_steps(ctx({1: (0.03, 0.3)}), TOP)
    assert judged and out is not None
    assert (out.stage, out.component) == ("host cpu", "host_software")
    assert out.rules == (*TOP.rules, cpu.RULE) and "rank 1 waited for a CPU" in out.summary


def test_slower_work_without_more_waiting_is_judged_and_left_as_it_is() -> None:
    out, judged = cpu.refine_steps(ctx({}), TOP)
    assert judged and out == TOP


def test_peers_waiting_as_much_is_no_starved_rank() -> None:
    every = {r: (0.03, 0.3) for r in range(4)}
    out, judged = cpu.refine_steps(ctx(every), TOP)
    assert judged and out == TOP


def test_without_the_counter_the_steps_give_no_verdict() -> None:
    out, judged = cpu.refine_steps(ctx({1: (0.03, 0.3)}, counter=False), TOP)
    assert not judged and out == TOP


def test_a_rise_inside_the_shares_scatter_is_no_evidence() -> None:
    """Shares scattered by 0.4 a step: a 10-point rise over 20 steps is ~1 standard error."""
    out, judged = cpu.refine_steps(ctx({1: (0.03, 0.13)}, noise=0.4), TOP)
    assert judged and out == TOP
    quiet, _ = cpu.refine_steps(ctx({1: (0.03, 0.13)}, noise=0.005), TOP)
    assert _stage(quiet) == "host cpu"  # the same rise on quiet shares is


def test_the_extra_waiting_must_explain_the_excess() -> None:
    """12 % more of a 60 ms step is ~7 ms: enough for a 10 ms excess, not for a 30 ms one."""
    c = ctx({1: (0.03, 0.15)}, noise=0.005)
    assert _stage(cpu.refine_steps(c, TOP)[0]) == "host cpu"
    big = replace(TOP, score=30e6)
    assert cpu.refine_steps(c, big)[0] == big


def test_a_starved_suspect_is_named_once_held_as_a_change_of_the_wait_is() -> None:
    """A suspect its rank's CPU wait explains is that rank's starvation: named `host cpu` only
    after `CPU_HOLD` × `onset_steps` (12) steps of it, as the wait's own change — before, no
    verdict (None), not the suspect's own label (a contended pipeline's link whose sender the
    scheduler crowded was named after 8). While the judged steps reach back to the job's start
    it also needs 16 steps before its onset. A suspect whose rank is not starved is returned
    as it is whenever; an open culprit re-checked is not held again."""
    starved = {1: (0.03, 0.3)}
    early = replace(TOP, onset_step=42)  # 8 judged steps since its onset
    out, judged = cpu.refine_steps(ctx(starved), early)
    assert judged and out is None
    calm, _ = cpu.refine_steps(ctx({}, onset=42), early)
    assert calm == early
    c12 = ctx(starved, onset=38)
    assert _stage(cpu.refine_steps(c12, replace(TOP, onset_step=38))[0]) == "host cpu"
    again = replace(early, how="confirm")
    assert _stage(cpu.refine_steps(ctx(starved, onset=42), again)[0]) == "host cpu"
    started = -5_000 * MS  # the window opened 5 s before the job's first step
    young = ctx(starved, n_steps=14 + 12, onset=14, window_from_ns=started)
    assert context.from_job_start(young)
    assert cpu.refine_steps(young, replace(TOP, onset_step=14))[0] is None
    grown = ctx(starved, n_steps=16 + 12, onset=16, window_from_ns=started)
    assert _stage(cpu.refine_steps(grown, replace(TOP, onset_step=16))[0]) == "host cpu"


def test_an_open_culprit_rechecked_is_judged_against_its_peers() -> None:
    """A re-check's judged steps may all be slow ones: no baseline of its own is needed."""
    c = ctx({1: (0.3, 0.3)}, noise=0.005)
    assert cpu.refine_steps(c, TOP)[0] == TOP  # always waited that much: no rise
    confirm = replace(TOP, how="confirm")
    assert _stage(cpu.refine_steps(c, confirm)[0]) == "host cpu"



def test_a_persistent_outlier_its_wait_explains_is_its_hosts_cpu() -> None:
    """An outlier (a difference older than the judged steps: its onset is their first) whose
    rank waits for a CPU more than its peers by as much as it is slower is that rank's
    starvation, judged against its peers as there is no before of its own. A real 8-rank DDP
    job whose rank 4 shared its core with busy processes from step 40: its wait's change was
    not named while the job's step time stood below an excursion of its own before the onset,
    and 78 steps on its backward, 1.58x its peers' with 25 ms a step more of waiting, was named
    `bwd` gpu_compute at 0.95."""
    starved = ctx({1: (0.3, 0.3)}, noise=0.005, onset=0)
    outlier = replace(TOP, how="outlier", onset_step=0)
    out, judged = cpu.refine_steps(starved, outlier)
    assert judged and _stage(out) == "host cpu"
    assert out is not None and "(its peers: 3%" in out.summary
    # judged as a change it has no steps before its onset to rise from: left as it is
    change = replace(outlier, how="change")
    assert cpu.refine_steps(starved, change)[0] == change
    # a rank that waits as its peers do is slower in its work
    assert cpu.refine_steps(ctx({}, onset=0), outlier)[0] == outlier
    # while the judged steps reach back to the job's start: no verdict yet, as a change
    young = ctx({1: (0.3, 0.3)}, noise=0.005, onset=0, window_from_ns=-5_000 * MS)
    assert context.from_job_start(young)
    assert cpu.refine_steps(young, outlier)[0] is None


def test_a_ring_whose_one_member_is_starved_is_that_members_cpu() -> None:
    """A ring not narrowed to a member (gloo: no chunk counters) whose member rank 1 alone
    starved since the onset is rank 1's host CPU, held like any starved suspect; a ring of
    which no member, or every member, is starved is judged as a whole."""
    ring = replace(TOP, ranks=(0, 1), stage="tp_collectives", component="nic_rdma",
                   rules=("venustrace.ar_node",), whole_ring=True)
    out, judged = cpu.refine_steps(ctx({1: (0.03, 0.3)}), ring)
    assert judged and out is not None
    assert (out.ranks, out.stage, out.whole_ring) == ((1,), "host cpu", False)
    assert "rank 1 waited for a CPU" in out.summary
    assert cpu.refine_steps(ctx({1: (0.03, 0.3)}, onset=42), replace(ring, onset_step=42))[0] \
        is None  # starved, not yet held
    assert cpu.refine_steps(ctx({}), ring) == (ring, True)
    # the member's counted wait need not explain the ring's excess: its transport's threads,
    # on the same starved core, wait uncounted (a rank alone still must explain its own)
    slow = replace(ring, score=100e6)
    assert _stage(cpu.refine_steps(ctx({1: (0.03, 0.3)}), slow)[0]) == "host cpu"
    assert _stage(cpu.refine_steps(ctx({1: (0.03, 0.3)}), replace(TOP, score=100e6))[0]) \
        == TOP.stage
    both = cpu.refine_steps(ctx({0: (0.03, 0.3), 1: (0.03, 0.3)}), ring)[0]
    assert both is not None and (both.ranks, both.stage) == ((0, 1), "host cpu")

# -- cpu.suspects: the steps' CPU wait as a suspect of its own --------------------------------


def test_a_rank_whose_wait_rose_while_the_job_slowed_is_a_suspect() -> None:
    """Rank 1 waits 3 % → 30 % of its steps from step 30, and the job's step time rises with
    it: named "host cpu" from the counters alone, as a change since its onset."""
    got = cpu.suspects(ctx({1: (0.03, 0.3)}))
    assert [(s.ranks, s.stage, s.component, s.how) for s in got] == \
        [((1,), "host cpu", "host_software", "change")]
    assert got[0].rules == (cpu.RULE,) and got[0].onset_step == ONSET
    assert 12e6 < got[0].score < 20e6  # ~0.27 of a 60 ms step more than its peers


def test_a_wait_change_near_the_jobs_start_needs_twice_the_baseline() -> None:
    """As a job starts the scheduler places its ranks' threads and moves them within seconds:
    its first steps show one placement, not the wait's noise (a fault-free pipeline job's rank
    waited less than the others over steps 1-8 and more over 9-13, and was named at 6.9σ).
    While the judged steps reach back to the job's first one, the same rise after 9 steps is
    no verdict, after 16 it is one."""
    assert context.BASELINE_FACTOR * SlowConfig().min_baseline == 16
    started = -5_000 * MS  # the window opened 5 s before the job's first step
    young = ctx({1: (0.03, 0.3)}, n_steps=9 + 12, onset=9, window_from_ns=started)
    assert context.from_job_start(young)
    assert not cpu.suspects(young)
    got = cpu.suspects(ctx({1: (0.03, 0.3)}, n_steps=16 + 12, onset=16, window_from_ns=started))
    assert [(s.ranks, s.stage, s.onset_step) for s in got] == [((1,), "host cpu", 16)]


def test_a_wait_change_of_a_job_older_than_its_judged_steps_needs_the_usual_baseline() -> None:
    """Once the job's start lies before the judged steps, 8 steps of baseline suffice: the CPU
    hog of the real catalog had 13 judged steps before its onset and was never named while 16
    were asked. A window that opens at the job's first record (or mid-step, 30 ms before it)
    holds a job older than itself; so does one whose first judged step is not its first full
    step."""
    for start in (0, -30 * MS):
        old = ctx({1: (0.03, 0.3)}, n_steps=9 + 12, onset=9, window_from_ns=start)
        assert not context.from_job_start(old)
        got = cpu.suspects(old)
        assert [(s.ranks, s.stage, s.onset_step) for s in got] == [((1,), "host cpu", 9)]
    # 80 steps, the newest 50 judged: the job's start is 30 steps before them
    c = ctx({1: (0.03, 0.3)}, n_steps=80, onset=60, window_from_ns=-5_000 * MS)
    assert c.steps[0] == 30 and not context.from_job_start(c)


def test_a_wait_the_job_does_not_feel_or_that_never_changed_is_no_suspect() -> None:
    """Only a change the job's step time shows counts: the same rise of the wait while the
    job's steps stay as they were is not a slowdown (no "absorbed" verdict), and a rank that
    always waited more than its peers is no change (no persistent verdict: on shared cores
    the scheduler crowds one rank more for seconds)."""
    assert not cpu.suspects(ctx({1: (0.03, 0.3)}, extra_ms=0.0))
    # 18 ms a step before and after (36 % of 50 ms, 30 % of 60 ms) while the job slowed
    assert not cpu.suspects(ctx({1: (0.36, 0.3)}, noise=0.005))
    assert not cpu.suspects(ctx({1: (0.03, 0.3)}, counter=False))
    # every rank waits 15 ms a step more (rank 1's longer step, 25 % of 60 ms): nobody's own
    every = {0: (0.03, 0.3), 1: (0.03, 0.25), 2: (0.03, 0.3), 3: (0.03, 0.3)}
    assert not cpu.suspects(ctx(every, noise=0.005))


def test_an_open_incident_keeps_its_ranks_wait_only_when_it_named_their_cpu() -> None:
    """Hysteresis applies to a rank whose incident named its CPU; one named for its backward
    that happens to wait more since does not become a CPU incident on its wait alone."""
    c = ctx({1: (0.3, 0.3)}, noise=0.005, extra_ms=0.0)
    assert not cpu.suspects(replace(c, confirm=frozenset({1}), confirm_stage="bwd pp=0"))
    kept = cpu.suspects(replace(c, confirm=frozenset({1}), confirm_stage="host cpu"))
    assert [(s.ranks, s.how) for s in kept] == [((1,), "confirm")]


def test_a_suspect_whose_onset_every_rank_waited_more_at_is_the_hosts_contention() -> None:
    """Rank 1's backward is 10 ms slower from step 30 (TOP). When every other rank's steps
    also wait ~13 ms more from then, the host's contention rose for everyone: `crowded`.
    When only rank 1 waits more, or nobody does, it is not; nor without the counters."""
    everyone = {r: (0.03, 0.3) for r in range(4)}
    assert cpu.crowded(ctx(everyone, noise=0.005), TOP)
    assert not cpu.crowded(ctx({1: (0.03, 0.3)}, noise=0.005), TOP)
    assert not cpu.crowded(ctx({}, noise=0.005), TOP)
    assert not cpu.crowded(ctx(everyone, counter=False), TOP)
    assert not cpu.crowded(ctx(everyone, noise=0.005), replace(TOP, onset_step=-1))


def test_a_starved_rank_whose_peers_waited_more_too_beyond_their_noise_is_the_hosts() -> None:
    """A suspect of the wait itself: rank 1 waits 3 % → 30 % of its steps from step 30. When
    the other ranks' waits rose at the same onset by a material amount beyond their own noise
    (3 % → 12 %: 4.5 ms a step, a third of rank 1's excess, under half), the host's
    contention changed and rank 1 took the larger share: `crowded` (a real contended pipeline
    control's rank 2, its median wait 2.4 → 14.3 ms a step while its peers' rose 1.1, 6.8 and
    4.9, was named `host cpu` at 0.88). Not when the peers' rise is a tenth of its excess (a
    pinned hog), nor when it is inside their own scatter; a suspect of another quantity (a
    slower backward) keeps the half-its-excess test alone."""
    host = {1: (0.03, 0.3), 0: (0.03, 0.12), 2: (0.03, 0.12), 3: (0.03, 0.12)}
    c = ctx(host, noise=0.005)
    sus = cpu.suspects(c)
    assert [(s.ranks, s.stage) for s in sus] == [((1,), "host cpu")]
    assert 2 * 4.5e6 < sus[0].score < 4 * 4.5e6  # the peers' rise: under half, over a quarter
    assert cpu.crowded(c, sus[0])
    # a rise of theirs a tenth of its excess: the change is its own (a pinned hog)
    slight = ctx({1: (0.03, 0.3), 0: (0.03, 0.06), 2: (0.03, 0.06), 3: (0.03, 0.06)},
                 noise=0.005)
    assert not cpu.crowded(slight, cpu.suspects(slight)[0])
    assert not cpu.crowded(c, TOP)
    alone = ctx({1: (0.03, 0.3)}, noise=0.005)
    assert not cpu.crowded(alone, cpu.suspects(alone)[0])
    # the peers 30 % → 34 % of their steps (a median rise of 3.3 ms, material) inside a
    # per-step scatter of 10 % of each step: 1.7 standard errors, no change of theirs
    peers = (0.3, 0.34)
    noisy = ctx({1: (0.3, 0.9), 0: peers, 2: peers, 3: peers}, noise=0.1)
    assert not cpu.crowded(noisy, sus[0])


# -- a small shift on most steps: the rank test (context.shift_change) ------------------------


def waits_ctx(waits_ms: np.ndarray, extra_ms: np.ndarray, recent: int = 30) -> Ctx:
    """4 DDP ranks, one row of `waits_ms` (ms, [steps, 4]) per step: each rank's thread's wait
    for a CPU in that step; rank 1's backward is `extra_ms[s]` longer (the time it lost). The
    newest `recent` steps and 30 before them are judged (the analyst widens `recent` to a
    suspect's steps since its onset: `slow.widened`)."""
    rows = []
    n = waits_ms.shape[0]
    for r in range(4):
        for s in range(n):
            back = 30 * MS + (int(extra_ms[s] * MS) if r == 1 else 0)
            rows.append((r, s, s * 80 * MS, 20 * MS, back, int(waits_ms[s, r] * MS)))
    return stage_ctx(rows, 0, n * 80 * MS, replace(SlowConfig(), recent=recent))


BURSTS, SHIFTED = 0.1, 0.75


def light_hog(steps: int, onset: int = 40, lasts: int = 1000, seed: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
    """A real light CPU hog's counters, as measured (module tests' numbers from the real
    catalog): every rank waits 0-3 ms a step, 10-30 ms more on 10 % of its steps; from
    `onset` for `lasts` steps rank 1 waits 3-12 ms more on 75 % of its steps, and on three of
    them the other three ranks, crowded together elsewhere, wait 13-35 ms. Rank 1's backward
    is longer by what it waited more."""
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.0, 3.0, (steps, 4))
    burst = rng.random((steps, 4)) < BURSTS
    w[burst] += rng.uniform(10, 30, int(burst.sum()))
    on = np.zeros(steps, dtype=bool)
    on[onset:onset + lasts] = True
    extra = np.where(on & (rng.random(steps) < SHIFTED), rng.uniform(3, 12, steps), 0.0)
    w[:, 1] += extra
    after = np.flatnonzero(on)
    for s in rng.choice(after[:12], 3, replace=False):
        w[s, [0, 2, 3]] += rng.uniform(13, 35, 3)
    return w, extra


def test_rank_sums_are_mann_whitneys_u() -> None:
    """U for every split at once equals the two-sample statistic computed split by split
    (scipy's, ties included), and z is its normal approximation."""
    from scipy.stats import mannwhitneyu

    v = np.round(np.random.default_rng(1).exponential(2.0, 40))  # many ties
    split = np.arange(5, 36)
    u, z = context.rank_sums(v, split)
    want = [mannwhitneyu(v[s:], v[:s], alternative="greater").statistic for s in split]
    assert np.allclose(u, want)
    a, b = split, 40 - split
    assert np.allclose(z, (u - a * b / 2) / np.sqrt(a * b * 41 / 12))


def test_a_small_shift_on_most_steps_is_named_once_held_twice_as_long(monkeypatch) -> None:
    """A rank waiting a few ms more on 75 % of its steps, against a heavy-tailed baseline:
    40 steps after the onset the band test alone (80 % of the steps above the baseline's
    median + 2σ, σ the tail's width) names a few of ten such jobs, the band test and the rank
    test together most; 16 steps after it the rank test names none (`SHIFT_HOLD`: 24; the band
    test may, held its 12 steps, where a draw puts most steps above its band). The excess is
    the shift's Hodges-Lehmann size, the onset Pettitt's change point."""
    assert context.SHIFT_HOLD * SlowConfig().onset_steps == 24

    def named(hold_steps: int, recent: int) -> list[Suspicion]:
        out = []
        for seed in range(10):
            w, extra = light_hog(40 + hold_steps, seed=seed)
            got = cpu.suspects(waits_ctx(w, extra, recent=recent))
            assert len(got) <= 1 and all(s.ranks == (1,) and s.stage == "host cpu"
                                         for s in got), seed
            out += got
        return out

    both = named(40, 40)
    assert len(both) >= 8 and any(s.how == "shift" for s in both)
    shifts = [s for s in both if s.how == "shift"]
    assert all(3e6 < s.score < 12e6 for s in shifts)
    # Pettitt's change point: where the draw's shifted steps begin to dominate (in one, 6 of
    # the first 15 steps after the onset drew no extra wait, and it was put at step 55)
    onsets = [s.onset_step for s in shifts]
    assert all(38 <= o <= 56 for o in onsets) and np.median(onsets) <= 48
    assert all(s.how != "shift" for s in named(16, 16))
    monkeypatch.setattr(context, "Z_SHIFT", float("inf"))  # the band test alone
    assert len(named(40, 40)) <= 4


def test_a_shift_that_ended_or_that_the_job_does_not_feel_is_no_suspect() -> None:
    """The same shift for 14 steps and then no more (the scheduler's crowding, over in a
    second) is not held; one while the job's step time stays as it was is not a slowdown;
    one the job rose far more than (`EXPLAINS`: its rise is something else's) is not this
    rank's."""
    for seed in range(10):
        w, extra = light_hog(40 + 30, lasts=14, seed=seed)
        assert not cpu.suspects(waits_ctx(w, extra)), seed
        w, extra = light_hog(40 + 30, seed=seed)
        assert not cpu.suspects(waits_ctx(w, np.zeros_like(extra))), seed
        assert not cpu.suspects(waits_ctx(w, extra + 25 * (np.arange(70) >= 40))), seed
