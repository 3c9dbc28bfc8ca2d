"""A culprit rank starved of CPU: the scheduler's own account, from the counters in its beats.

The host agent copies each rank's training-thread schedstat into every beat
(`ingest.records.Beat`: `sched_run_ns`, `sched_wait_ns`, cumulative). The share of wall time a
rank spent runnable but waiting for a CPU is Δwait / Δts between two of its beats. A rank whose
work got slower because other processes took its CPU (a busy neighbour, data-loader workers,
another job on the host) waits where it used to run; a rank whose device or code got slower
does not. Nothing else in the records separates the two on a host whose "device" work is CPU
work, and on a GPU host it separates a starved launcher from a slower GPU.

`refine` re-labels a slowdown suspect "host cpu" / host_software when, over the judged steps
since its onset, its wait share (for a suspect naming a host's ranks, each rank's) exceeds its
own share before the onset and its peers' median share since the onset each by more than the
shares' own scatter allows (`NOISE_K` × the RMS deviation of the per-beat-interval shares from
their rank's and side's share, pooled; at least `MARGIN` of the wall clock) — peers under the
same contention (more runnable processes than cores everywhere) are not starved *relative* to
each other: no re-label — and its extra waiting accounts for at least half of its excess time
per step: the cause must be big enough to be the cause (a rank of 50 ms steps waiting 20 % of
the time where its peers wait 3 % loses about 9 ms a step to its CPU; a fixed floor on the
share would miss it on short steps and admit noise on long ones). "Before" is the time of the
judged baseline steps (from `base_from_ns`, the first judged step's start, taken from the
last beat at or before it): the same steps the slowdown verdict compared against. A baseline
reaching back to the process's start-up — imports, communicator set-up, every rank runnable
at once — would measure the start-up's contention, not the rank's steady state (on a real
4-rank job, 0.51 of the wall clock waiting in the first seconds against 0.06 in the steps
before the onset), and hide a starved rank behind it. "Since" ends with the judged steps
(`until_ns`): the beats after them are not what the verdict measured, and a job's end — every
rank runnable at once as it tears down, a counter that restarts — would read as everyone
starved. Needs beats with counters on both sides of the onset; otherwise the suspect is
returned as it is.

A fixed ratio (2 × the before and peer shares + 5 %) was used first and judged the rise by
nothing but its size: on a real 4-rank job whose rank 1 shared its core with two busy
processes, the rank waited 10–15 % of each second against its peers' 3–7 % (scatter ~2 %),
1 point short of the ratio's 13.4 %, and its slowdown was named by its backward.

Per step (`refine_steps`, preferred): the tracer records in every stage record the time the
step's thread waited for a CPU (`sched_wait_ns`, read at the step's start and end), so the
shares are measured over exactly the steps the slowdown verdict judged — its baseline steps
before the onset, its slow steps since — not over whole beat intervals that straddle the onset
and the step boundaries. The beats, one a second, left a slowdown's first conclusions unjudged
for up to two seconds (`unjudged`: their confidence capped), and on the real job above judged a
starved rank on two or three intervals; the steps give one sample each. A share here is the
step set's total wait over its total time, per rank; the scatter it is judged against is the
per-step shares' deviation from their rank's and side's share (pooled RMS), as a standard error:
`NOISE_K` standard errors of the difference of two such means (the suspect's since the onset
against its own before, and against its peers' since), at least `MARGIN` of the wall clock. The
extra wait must explain `EXPLAIN` of the suspect's excess, in ns per step as measured. Stage
records without the counter (an older tracer: -1) leave the judgement to the beats. A
suspect of a difference that persists (`PERSISTENT`: an outlier beside its peers, an open
culprit re-checked) has no steps of its own before its onset, which lies before the judged
steps: its peers' wait over the same steps is the reference alone. A real 8-rank DDP job
whose rank 4 shared its core with busy processes from step 40 (its wait 15-115 ms a step
against its peers' 0-10) had its wait's change left unnamed while the job's step time stood
below an excursion of its own before the onset (steps 16-33 at 105-290 ms, the job's start
on 2 shared cores); once the onset had left the judged steps, its backward, 1.58x its peers'
(an outlier at 25σ) with 25 ms a step more of waiting, was named `bwd` gpu_compute at 0.95.

A suspect of its own (`suspects`): a rank whose steps' CPU wait *changed* — judged like every
other quantity (`context.judge`: its excess over the job's ranks' reference rose over its
newest `context.CPU_HOLD` × `onset_steps` (12) or more steps by `z_change` robust σ of that
excess before, 80 % of those steps above the baseline's band, while the job's median step time
rose beyond its own excursions) — is named "host cpu" from its counters alone. Twelve, not
the 8 other changes of a rank beside few peers hold: a contended TP control's rank, beside a
busy process that no core was kept for, waited 13-46 ms a step more than its peers on 7 of 8
steps and then no more (named 0.95 with 8); the real catalog's pinned hog was named 2-3 steps
later in replays of two runs (18 → 20 and 22 → 25 steps after its onset). The peers are
every rank of the job, not the rank's pipeline stage: waiting is the host's doing, not the
stage's work, and a 2-rank stage is no peer set. A starved rank loses its time in
every phase a little (on a real 4-rank job beside a pinned hog: forward +2–3 ms, backward
+3–5, optimizer +2–3, data +2–4 a step, each inside that phase's noise, while its wait rose
1.5 → 10 ms a step above its peers' on nearly every step): no phase names it, the wait does.
While the judged steps reach back to the job's first steps (`from_job_start`), its change
needs twice the baseline of other quantities (`BASELINE_FACTOR` × `min_baseline`: 16 steps):
as a job starts, the scheduler places its ranks' threads on the cores and moves them within
the first seconds, and each placement is sticky, so the first steps show one placement and
their spread says little of the wait's noise. A fault-free 4-rank pipeline job's rank 2
waited 1–6 ms a step less than the other ranks over steps 1–8 (a spread of 1.5 ms) and 2–7 ms
more over steps 9–13, as the scheduler moved the ranks' threads in the job's second second: a
change of 6.9σ over an 8-step baseline, named `host cpu` at 0.88 1.7 s into the job. Once the
job's start lies before the judged steps, the usual 8 suffice: asking 16 everywhere cost the
CPU hog of the real catalog its verdict — its onset had 13 judged steps before it (27 more of
the job before those), and as the judged steps slid on with the job no split left 16.
A rank starved a little on most steps rather than much on every one (a light hog: 3-12 ms
a step more on three steps of four, against a baseline of 0-3 ms with bursts of 10-30) puts
too few steps above the band for that test — its σ is the baseline's upper tail — and its
excess over the peers' lower quartile drops wherever its peers are crowded together
elsewhere. Such a shift is found by a rank test of the same excess (`context.shift_change`, Mann and
Whitney's U: the newest steps above the older ones more often than chance allows, z ≥
`context.Z_SHIFT`, the onset Pettitt's change point, its Hodges-Lehmann size material; a
step where the peers were crowded is one low rank, not a failed step), weaker evidence held
twice as long (`context.SHIFT_HOLD` × `onset_steps`: 24 steps), its rise its own, not the
other ranks' too (`context._common`), and the job's rise no more than `context.EXPLAINS` ×
its size.
Replayed every 0.1 s on the stored tables of 8 real runs of the light hog (`ddp4-cpu-hog`):
named 25.6, 26.5 and 32.6 steps after the onset where the band test took 39-41 or never did;
in the others the band test names it first (12-19 steps), or the job's step time did not
rise with the wait until 37-39 steps after the onset (two runs); 0 of 204 replayed controls
named. Tried and left out: the test on the rank's own wait rather than its excess — a
fault-free 4-rank pipeline's every rank waited 2-4 ms a step more from its 60th step on,
rank 0 4 ms more, and it was named live (0.64); without the `EXPLAINS` bound a contended
4-rank pipeline control's rank, crowded 10-70 ms a step for 20 steps by unpinned busy
processes while the job rose 25 ms a step, was named (its shift 8 ms); the 12-step hold
named 6 of 180 replayed controls (the scheduler crowds a contended control's rank for 12-30
steps).
New demand on the host (`context.demand_rose`): the holds above guard against the scheduler
moving the same threads about, which the rank's own counters cannot tell from a process that
arrived and took its CPU. The host's can: the tracer records in every stage record the host's
CPU pressure over the step (`cpu_pressure_ns`, Linux PSI: the time in which some runnable task
of the host waited for a CPU). Where that pressure, as a share of each step's time, rose at the
change's onset (Mann-Whitney z ≥ `context.Z_DEMAND` of the steps since against the steps
before) by enough to account for half the change, the change has its cause: a change of the
wait is named after `onset_steps` (a shift after twice that), beside few peers too, and a
suspect of another analysis its wait explains is re-labelled after `onset_steps`. Where the
pressure could have shown new demand (known, and below `context.SATURATED` before) and did
not rise, a change of the wait is the scheduler moving the waiting between the host's tasks:
no verdict (`context.pressure_could_rise`). The holds remain where the counter is missing (an
older tracer, a kernel without PSI) or saturated. Replayed every 50 ms on the captures of real
runs, with the host's pressure sampled beside them every 5 ms (the eval's stack, broker and
store on the same 2 cores): 7 CPU hogs named after a median of 5 steps where the holds took 13
(3-11 against 11-24); of 52 fault-free controls (every shape, 27 of them beside busy
processes) the holds named 2 — a contended TP control's rank crowded 12 steps in the job's
second second (0.66), a contended pipeline's rank shifted 2.9 ms a step for 24 (0.64), the
host's pressure flat under both — and the pressure names none.

Only a change counts (`changes_only`): no persistent-outlier verdict and no "absorbed" one —
on shared cores the scheduler crowds one rank more than the others for seconds (a contended
control's rank waited 4–6 ms a step over its peers' for 20 steps), a difference of the
environment as often as a fault's, and one the job's step time does not show is no slowdown.
A first version (a trailing mean over `onset_steps` steps against the peers' median) named
two fault-free controls' ranks the scheduler crowded; the change test's baseline noise and
80 % rule are what it lacked.

Tried and left out: naming a rank that waits more than *every* other rank on far more of its
newest steps than chance (1/R) allows — a binomial test of its top steps at a change point.
On a real hog it named rank 1 twelve steps after the start instead of 39, but the
scheduler's crowding is sticky for seconds, not independent from step to step: a contended
4-rank pipeline control's rank topped 11 of 13 steps (and kept waiting the most for ~45),
a healthy traced pipeline's 9 of 13, and both were named (replays of 28 kept runs: 2 control
incidents against 0, hogs named 2 more and 8 steps sooner in one). The two look alike in
their counters; only the change test's strictness kept the controls quiet.

Contention for everyone (`crowded`): a suspect of any analysis whose onset saw the job's other
ranks wait more too — their median rise at least `EXPLAIN` of its excess — is the host's
contention rising, not the suspect's fault, and is dropped; a suspect of the wait itself also
where their rise was smaller but a change all the same — material, at least `HOST_SHARE` of
its excess and beyond their own noise (`crowded` has the numbers). Tried and left out: asking the
others' rise to reach the suspect's whole excess, not half (its excess is already measured over
them): in replays of the 28 kept runs the hog whose processes' start made every rank wait 3–6 ms
a step more was named (but by its backward, 0.74), and a contended pipeline control's rank was
named `host cpu` (0.75).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np

from diagnosis.columns import Columns, ints
from diagnosis.conclusion import Suspicion
from diagnosis.slow.context import (
    BASELINE_FACTOR,
    Ctx,
    demand_rose,
    from_job_start,
    judge,
    mad_sigma,
    starvation_held,
    step_waits,
)

RULE = "rankwatch.cpu_starved"
MIN_SHARE = 0.2
EXPLAIN = 0.5
#: a starved-CPU suspect is the host's contention when the others' wait changed at its onset
#: by at least this share of its excess (`crowded`): the scheduler shares a host's change out
#: unevenly, by a factor of 2-3 where a busy process sits beside one rank, not by 10
HOST_SHARE = 0.25
MARGIN = 0.05
NOISE_K = 3.0
#: verdicts of a difference that persists rather than a change (`context.judge`): their onset
#: lies before the judged steps, and `refine_steps` judges the rank's wait against its peers'
PERSISTENT = ("confirm", "outlier", "few_peers")


def wait_shares(beats: Columns, since_ns: int, base_from_ns: int | None = None,
                until_ns: int | None = None, noise: list[np.ndarray] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, wait share before `since_ns`, wait share from it) per rank with counters on
    both sides (nan where a side has fewer than two beats). With `base_from_ns`, "before"
    starts at each rank's last beat at or before it (module docstring); with `until_ns`,
    "after" ends at its first beat at or after it. One beat row per communicator repeats the
    same counters: rows are reduced to one per (rank, ts). An interval whose counter went
    back (a new process behind the rank, a reset) is left out of the share. `noise`, when
    given, receives per rank its per-interval shares on each side, each less its side's
    share: the scatter the shares are judged against (`refine`)."""
    wait = ints(beats, "sched_wait_ns", -1)
    ok = wait >= 0
    if not ok.any():
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    rank, ts, wait = ints(beats, "rank")[ok], ints(beats, "ts")[ok], wait[ok]
    order = np.lexsort((ts, rank))
    rank, ts, wait = rank[order], ts[order], wait[order]
    ranks, first = np.unique(rank, return_index=True)
    before, after = np.full(ranks.size, np.nan), np.full(ranks.size, np.nan)
    bounds = [*first.tolist(), rank.size]
    for i in range(ranks.size):  # per rank (not per record): a few thousand at most
        t, wt = ts[bounds[i]:bounds[i + 1]], wait[bounds[i]:bounds[i + 1]]
        keep = np.ones(t.size, dtype=bool)
        keep[1:] = t[1:] != t[:-1]  # one row per beat
        t, wt = t[keep], wt[keep]
        first = t.min()
        if base_from_ns is not None and (t <= base_from_ns).any():
            first = t[t <= base_from_ns].max()
        last = t.max()
        if until_ns is not None and (t >= until_ns).any():
            last = t[t >= until_ns].min()
        for out, sel in ((before, (t < since_ns) & (t >= first)),
                         (after, (t >= since_ns) & (t <= last))):
            if sel.sum() < 2:
                continue
            dt, dw = np.diff(t[sel]), np.diff(wt[sel])
            good = (dt > 0) & (dw >= 0)
            if good.any():
                out[i] = float(dw[good].sum()) / float(dt[good].sum())
                if noise is not None:
                    noise.append(dw[good] / dt[good] - out[i])
    return ranks, before, after


def refine(beats: Columns, top: Suspicion, since_ns: int | None,
           base_from_ns: int | None = None, step_ns: float | None = None,
           until_ns: int | None = None) -> Suspicion:
    """`top`, re-labelled as its host's CPU when its rank (each of its ranks, for a suspect
    naming several: a host's) was starved since `since_ns` against the baseline from
    `base_from_ns` (module docstring); unchanged otherwise. With the
    job's step time `step_ns`, "starved" also means its extra waiting per step explains at least
    `EXPLAIN` of the suspect's excess (`top.score`, ns per step); without it, a share of at
    least `MIN_SHARE`."""
    if not beats or since_ns is None or not top.ranks or top.stage == "host cpu" \
            or "sched_wait_ns" not in beats:
        return top
    scatter: list[np.ndarray] = []
    ranks, before, after = wait_shares(beats, since_ns, base_from_ns, until_ns, scatter)
    mask = np.isin(ranks, top.ranks)
    if mask.sum() != len(set(top.ranks)):
        return top
    peers = after[~mask]
    peers = peers[~np.isnan(peers)]
    # several ranks (a host's): each must be starved, so the least starved one is judged
    mine, base = float(np.min(after[mask])), float(np.max(before[mask]))
    if top.how == "confirm":
        # the re-check of an open culprit (`context`, "confirm"): its change was judged when
        # the incident opened, and the steps judged now may all lie after the onset, where
        # its own "before" is the starved state itself; its peers are the reference
        base = 0.0
    if np.isnan(mine) or np.isnan(base) or not peers.size:
        return top
    peer = float(np.median(peers))
    # the rise must stand out of the shares' own scatter from one beat interval to the next
    # (pooled over every rank and side), and be at least MARGIN of the wall clock
    dev = np.concatenate(scatter) if scatter else np.zeros(0)
    need = max(MARGIN, NOISE_K * float(np.sqrt(np.mean(dev ** 2)))) if dev.size else MARGIN
    if mine - base < need or mine - peer < need:
        return top
    if step_ns is None:
        if mine < MIN_SHARE:
            return top
    elif (mine - max(base, peer)) * step_ns < EXPLAIN * top.score:
        return top  # its extra waiting is too small a part of its excess to be the cause
    return _starved(top, f"{mine:.0%} of the time since (before: {base:.0%}, its peers: "
                         f"{peer:.0%})")


def _starved(top: Suspicion, how_much: str) -> Suspicion:
    """`top` re-labelled as its host's CPU, the waiting it measured (`how_much`) said."""
    who = f"rank {top.ranks[0]}" if len(top.ranks) == 1 else \
        f"each of ranks {', '.join(map(str, top.ranks))}"
    return replace(top, stage="host cpu", component="host_software",
                   rules=(*top.rules, RULE),
                   summary=f"{top.summary}; {who} waited for a CPU {how_much}: starved of CPU, "
                           "not slower work")


def refine_steps(ctx: Ctx, top: Suspicion, explain: float = EXPLAIN
                 ) -> tuple[Suspicion | None, bool]:
    """(`top`, re-labelled as its host's CPU when the per-step counters show its rank — each of
    its ranks — starved since its onset; whether they could judge it at all: at least two
    steps with the counter since the onset on every suspect rank, and a peer with some). The
    module docstring has the test. None instead of `top` when its rank is starved but not for
    as long as the scheduler's own crowding can last (`context.starvation_held`): no verdict
    yet. `explain`: the share of the suspect's excess its extra waiting must account for."""
    got = step_waits(ctx)
    if got is None or not top.ranks or top.stage == "host cpu":
        return top, False
    if top.whole_ring and len(top.ranks) > 1 and (one := _one_member_starved(ctx, top)):
        return one
    wait, tot = got
    world = wait.shape[1]
    mine_cols = np.asarray(sorted({r for r in top.ranks if 0 <= r < world}), dtype=np.int64)
    if mine_cols.size != len(set(top.ranks)):
        return top, False
    hit = np.flatnonzero(ctx.steps == top.onset_step)
    row = int(hit[0]) if top.onset_step >= 0 and hit.size else 0
    after, before = slice(row, None), slice(0, row)
    ok = ~np.isnan(wait)
    n_after = ok[after].sum(axis=0)
    n_before = ok[before].sum(axis=0)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank without steps on a side
        share_a = np.nansum(wait[after], axis=0) / np.nansum(tot[after], axis=0)
        share_b = np.nansum(wait[before], axis=0) / np.nansum(tot[before], axis=0)
        per = wait / tot
        dev = np.concatenate([(per[after] - share_a)[ok[after]],
                              (per[before] - share_b)[ok[before]]])
        wait_a = np.nanmean(wait[after], axis=0)
        wait_b = np.nanmean(wait[before], axis=0)
    peers = np.setdiff1d(np.flatnonzero(n_after >= 2), mine_cols)
    if (n_after[mine_cols] < 2).any() or not peers.size:
        return top, False
    if top.how in PERSISTENT:
        # the re-check of an open culprit: its judged steps may all lie after the onset (see
        # `refine`); and a persistent difference (an outlier beside its peers): its onset lies
        # before the judged steps. Its peers are the reference: a rank that waits for a CPU
        # more than they do, by as much as it is slower, is starved, not slower in its work
        base, base_wait, nb = 0.0, 0.0, 0
    else:
        if (n_before[mine_cols] < 2).any():
            return top, True  # no steps of its own before the onset: no rise to measure
        base = float(np.max(share_b[mine_cols]))
        base_wait = float(np.max(wait_b[mine_cols]))
        nb = int(n_before[mine_cols].min())
    na = int(n_after[mine_cols].min())
    mine = float(np.min(share_a[mine_cols]))
    peer = float(np.median(share_a[peers]))
    peer_wait = float(np.median(wait_a[peers]))
    sd = float(np.sqrt(np.mean(dev ** 2))) if dev.size else 0.0
    need_base = max(MARGIN, NOISE_K * sd * np.sqrt(1.0 / na + (1.0 / nb if nb else 0.0)))
    need_peer = max(MARGIN, NOISE_K * sd * np.sqrt(1.0 / na + 1.0 / (na * peers.size)))
    if mine - base < need_base or mine - peer < need_peer:
        return top, True
    extra = float(np.min(wait_a[mine_cols])) - max(base_wait, peer_wait)
    if extra < explain * top.score:
        return top, True  # its extra waiting is too small a part of its excess to be the cause
    # a suspect of another analysis that its rank's CPU wait explains — a link whose sender
    # is crowded, a phase of a rank crowded off its core — is that rank's starvation, and is
    # held as a change of the wait is: named sooner, it passed the wait's own test by (a
    # contended pipeline's link, its sender waiting 29 % of its steps' time for a CPU against
    # 6 % before, was named `host cpu` at 0.74 after 8 steps)
    # (`onset_steps` where it came with new demand on its host: `context.demand_rose`)
    since = ctx.steps.size - row
    if top.how != "confirm" and not starvation_held(ctx, na, nb, demand=all(
            demand_rose(ctx, r, since, top.score) for r in mine_cols.tolist())):
        return None, True
    if top.how in PERSISTENT:
        return _starved(top, f"{mine:.0%} of its steps' time (its peers: {peer:.0%}; "
                             f"{extra / 1e6:.1f} ms more a step)"), True
    return _starved(top, f"{mine:.0%} of its steps' time since (before: {base:.0%}, its "
                         f"peers: {peer:.0%}; {extra / 1e6:.1f} ms more a step)"), True


def _one_member_starved(ctx: Ctx, top: Suspicion) -> tuple[Suspicion | None, bool] | None:
    """`refine_steps` of a ring not narrowed to a member (`Suspicion.whole_ring`: a TP group
    or DDP ring over gloo, no chunk counters) when exactly one member's steps starved of CPU,
    each member judged alone against the job's other ranks: that member's starvation — the
    narrower answer, as a rank's own slowdown explains the rings it joins
    (`slow._explained_links`) — held as a change of the wait is (None until then). None (the
    ring is judged as a whole) when no member, or more than one, is starved.

    The member's extra waiting need not account for the ring's excess (`EXPLAIN`): the
    counter is the training thread's, and the transport's threads, on the same starved core,
    wait uncounted. A real 8-rank DDP job whose rank 4 shared its core with four busy
    processes: the rank's steps waited 13 ms a step more, its ring's transfers took 45 ms
    more, the other ranks waited as before; the ring was named at 0.6 and the rank only once
    that incident was resolved, 7 s after the onset. Judged as a whole, every member had to
    be starved at once: a real TP job whose rank 3 was starved so was named `[2, 3]
    tp_collectives` at 0.6 before its CPU verdict came."""
    starved = []
    for r in top.ranks:
        got = refine_steps(ctx, replace(top, ranks=(r,), whole_ring=False), explain=0.0)
        if got[0] is None or got[0].stage == "host cpu":
            starved.append(got)
    return starved[0] if len(starved) == 1 else None


def unjudged(beats: Columns, top: Suspicion, since_ns: int | None) -> bool:
    """Whether `top` is one rank whose beats carry scheduler counters but too few of them since
    `since_ns` (fewer than two beats) for `refine` to tell a starved CPU from slower work: the
    cause is not judged yet. (Without counters at all — a tracer that sends none — there is
    nothing to wait for.)"""
    if not beats or since_ns is None or len(top.ranks) != 1 or top.stage == "host cpu" \
            or "sched_wait_ns" not in beats:
        return False
    ranks, _, after = wait_shares(beats, since_ns)
    hit = np.flatnonzero(ranks == top.ranks[0])
    return bool(hit.size) and bool(np.isnan(after[int(hit[0])]))


def suspects(ctx: Ctx) -> list[Suspicion]:
    """Ranks whose steps' CPU wait changed while the job slowed (module docstring): "host
    cpu", host_software, the extra wait per step as the excess they explain."""
    got = step_waits(ctx)
    if got is None:
        return []
    wait, _ = got
    # the peers are every rank of the job, not the rank's pipeline stage: waiting for a CPU is
    # the host's doing, not the stage's work, and a 2-rank stage is no peer set (in a
    # contended 2-stage control the whole job waited more for a few steps, one rank of a
    # stage more than its one peer). Fewer than `min_peers` ranks with the counter (the
    # rank and three others): no verdict
    world = wait.shape[1]
    if int((~np.isnan(wait)).any(axis=0).sum()) < ctx.cfg.min_peers:
        return []
    # an open incident's ranks are kept on their wait only when it named their CPU: a rank
    # named for something else often waits more since (a rank whose sends leave late wakes
    # to peers spinning in the collective), and that must not turn its cause into its CPU
    mine = np.isin(np.arange(world), list(ctx.confirm)) & (ctx.confirm_stage == "host cpu")
    factor = BASELINE_FACTOR if from_job_start(ctx) else 1
    v = judge(ctx, wait, ctx.cfg.min_ratio, np.zeros(world, np.int64), changes_only=True,
              confirmable=mine, min_baseline=factor * ctx.cfg.min_baseline)
    out = []
    for x in np.flatnonzero(v.flag).tolist():
        out.append(Suspicion(
            (x,), "host cpu", "host_software", float(v.exc[x]), (RULE,),
            f"rank {x}: its steps waited for a CPU {v.exc[x] / 1e6:.1f} ms/step more than the "
            f"job's other ranks' ({v.how[x]} {v.z[x]:.1f}σ): starved of CPU, not slower work",
            float(v.z[x]), str(v.how[x]), int(ctx.steps[v.since[x]])))
    return out


def crowded(ctx: Ctx, s: Suspicion) -> bool:
    """Whether the job's other ranks' steps, since `s`'s onset, waited for a CPU more than
    before by at least `EXPLAIN` of `s`'s excess (the median other rank's rise of its median
    per-step wait): the host's contention rose for everyone, and `s`'s excess is its share of
    it, not its own. In a fault-free 2-stage job beside two busy processes every rank's wait
    rose 8–21 ms a step for its last 15 steps; one rank's forward rose 5 ms more than its
    stage peer's and was named (0.93).

    A suspect of the wait itself ("host cpu", `suspects`) is the host's too where the others'
    wait rose by less but still changed: by at least the materiality floor (`min_share` of
    the step time) and `HOST_SHARE` of its excess, and by `z_job` standard errors of their
    own noise (each other rank's rise of its median against 1.2533 × its robust σ before ×
    √(1/before + 1/since), the median of those). The host's contention changed at the onset
    and the scheduler gave the suspect the larger part of it, as it places threads unevenly
    beside busy ones; a consumer of one rank's CPU (a process on its core) concentrates the
    change on that rank. A real contended 2-stage pipeline control (two unpinned busy
    processes beside 4 ranks on 2 cores): at step 17 rank 2's median wait went 2.4 → 14.3 ms
    a step and its peers' rose 1.1, 6.8 and 4.9 (2.75 standard errors at the median; 0.37 of
    its 13 ms excess, under `EXPLAIN`); it was named `host cpu` at 0.88. Beside the real
    catalog's pinned hogs (12, in two runs) the others' median rise was -2.4 to 1.9 ms, under
    0.1 of the hog's excess. False without the counters or an onset with at least two steps
    on each side."""
    got = step_waits(ctx)
    if got is None or s.onset_step < 0 or not s.ranks:
        return False
    wait, _ = got
    hit = np.flatnonzero(ctx.steps == s.onset_step)
    n = wait.shape[0]
    if not hit.size or not 2 <= int(hit[0]) <= n - 2:
        return False
    row = int(hit[0])
    others = np.setdiff1d(np.arange(wait.shape[1]), np.asarray(s.ranks, dtype=np.int64))
    if not others.size:
        return False
    before, after = wait[:row, others], wait[row:, others]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank without steps on a side
        rise = np.nanmedian(after, axis=0) - np.nanmedian(before, axis=0)
        common = float(np.nanmedian(rise))
        if not np.isfinite(common):
            return False
        if common >= EXPLAIN * s.score:
            return True
        if s.stage != "host cpu":
            return False
        # a suspect of the wait itself (`suspects`): the others' wait is the same quantity,
        # and where it rose too — by a material amount, beyond its own noise, not far below
        # the suspect's — the host's contention changed at the onset, and the suspect's
        # excess is the larger share the scheduler gave it
        if common < max(ctx.cfg.min_share * ctx.step_ns, HOST_SHARE * s.score):
            return False
        sd = np.maximum(mad_sigma(before), 1e-3 * ctx.step_ns)
        nb, na = np.sum(~np.isnan(before), axis=0), np.sum(~np.isnan(after), axis=0)
        z = rise / (1.2533 * sd * np.sqrt(1.0 / nb + 1.0 / na))
        return float(np.nanmedian(z)) >= ctx.cfg.z_job
