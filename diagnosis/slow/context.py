"""What every slowdown analysis shares: the steps it judges, (step × unit) matrices, the
peer reference, and the verdict that decides when a unit's excess over its peers is evidence.

A unit is a rank (stage phases, kernel time, launch delay) or a communicator / p2p link (DP
transfers, PP transfers). Every analysis builds a float matrix `m` [steps, units] of a quantity
that contains no waiting, and `judge` compares each unit with its peers (units doing the same
work: ranks of one PP stage, DP rings, links between the same pair of stages).

The verdict (`judge`) — the rule every comparison across ranks goes through:
- materiality: the unit's mean excess over the peer reference is at least `min_share` of the
  step time (links: `net_abs_ns`), at least `job_noise` × the robust σ of the job's step time
  (`Ctx.noise_floor`; not for links, see `job_gate`), and its ratio to the reference at least
  the analysis' `ratio_min`;
- and the excess must stand out of the quantity's own noise, in one of two ways:
  - a *change* (`change`): the unit's excess over its peers rose, over its last `onset_steps`
    or more steps, by at least `z_change` robust standard deviations of that same excess over
    the steps before (1.4826 × MAD: the unit's own step-to-step noise), 80 % of those steps
    above the baseline's median + 2σ (`own_change`); and the job's own median step time must
    have risen over the same steps by `z_job` standard errors of the median, above every
    earlier stretch of the same length (`job_change`: a slowdown is first a change of the
    job's step time, beyond the excursions the job already makes) — except for links (DP
    rings, p2p hops: `job_gate=False`), whose slower transfer a pipeline bubble can hide from
    the step time: such a change is named "absorbed", with the confidence of weaker evidence.
    A rank's own work that at least doubled (`absorbed_ratio`) and rose by `absorbed_z` ×
    `z_change` of its own σ is named "absorbed" too while the job's step time does not move:
    the pipeline or the shared cores hide it today, its rank is still the one to look at. An
    absorbed change must have held for `2 × onset_steps` steps (weaker evidence, more of it: a
    rank crowded off its core for a few hundred milliseconds doubles a phase too), as must a
    change of a rank beside fewer than `min_peers` peers — unless the rank's own steps' CPU
    wait did not rise with it (`crowding` False: the scheduler did not crowd it, so the hold has
    nothing to guard against and `onset_steps` suffice; a step held is a step whose value is
    known) — and, whatever its peers, a short change of a rank whose excess is
    less than half the job's rise over the same steps (`EXPLAINS`: a rank slower by e makes
    the job wait about e; a job that rose far more rose for something else, and its rise is
    no evidence for this rank). A change of a rank whose steps' CPU wait rose by at least
    half its rise (`crowding`: the scheduler's doing) is CPU starvation and is held to what
    `diagnosis.slow.cpu` asks of a change of the wait: `CPU_HOLD` onsets (`onset_steps` where the
    host's CPU pressure rose with it, `demand_rose`: something new took the CPUs, not the
    scheduler moving the same threads), and while the judged steps reach back to the job's
    start (`from_job_start`) `BASELINE_FACTOR` × `min_baseline` steps before it; and
    links in a peer set smaller than `min_peers` keep the job gate (a gloo ring's transfer
    time moves with the load of the few ranks it joins: on real 2-ring jobs under CPU
    contention one ring "changed" beyond its own noise while the job's step time did not)
    and, judged on their own past alone, need `BASELINE_FACTOR` × `min_baseline` steps
    before the change (their baseline is whatever stretch the judged steps begin with);
    and where the job's ranks wait for CPUs at all (`host_crowded`: the median rank's wait at
    least `CROWDED_SHARE` of its time), a link's short change is held to `2 × onset_steps`
    whatever its peers: its transport's threads are crowded in turn as the ranks' are, and
    no counter sees theirs;
  - an *outlier* (`outlier`, persistent since before the window): beside at least
    `min_peers` other units (their means' spread is the σ), the unit's mean over at least
    2 × `onset_steps` known steps is `z_peers` robust deviations above its peers' means, and
    above the reference on at least 80 % of the steps; beside 2 or 3 others (too few for a
    spread), its median is `z_peers` of the quantity's per-step noise (the peers' steps around
    their own medians, pooled) above theirs, and it is above every one of them on at least
    80 % of the steps (`few_peers`: three peers say which rank, not how sure; the
    conclusion's confidence is capped). Two DP rings or two ranks of a stage are two samples:
    their ratio is not evidence, and no such verdict is given;
  - `sparse` (intermittent excess: a stalled callback, a slow batch): at least three steps above
    the reference by the whole materiality floor, three times as many as the busiest peer plus
    two, more than the group's spikes shared out by chance at one rate would give any unit
    (`spread_by_chance` below `sparse_quiet`: 3 of 3 on one of 4 ranks is not, 5 of 5 is),
    the first of them inside the window; where the peers spike too (the quantity has
    spikes of its own in this job) after a quiet stretch the spike rate since makes improbable
    (`sparse_quiet`: a Poisson count of zero in those steps — on a contended 4-rank control
    one rank the scheduler crowded more spiked 8 times to its peers' 1, as it always had); a
    count of spikes is compared across peers, so this too needs a peer set of `min_peers`.
  The noise of a series is the larger of its robust σ and its upper tail's width (`_spread`):
  a rank that shares its cores is descheduled now and then, a heavy tail the MAD reads as
  quiet.
- `confirm`: units of an incident already open need only stay material at half the floor,
  on most steps (hysteresis: the opening needed the evidence above, staying open needs
  persistence; the floor follows the job's noise, which rises as a job's last steps scatter). A
  link's units only for an incident that named a link: links differ by topology, so a link's
  persistent excess is no evidence of its own — kept for an incident about the rank's
  callbacks, a sender's link that was always 5x its like links' (a simulated job) became the
  incident's stage.
- `changes_only` (a rank's CPU wait, `diagnosis.slow.cpu`): a change the job's step time shows,
  held `CPU_HOLD` × `onset_steps`, and `confirm`; no outlier, few_peers or absorbed verdict.
  Where the band test does not find it held, a *shift* of the unit's excess by a rank test
  (`shift_change`: Mann-Whitney, Pettitt's onset), held `SHIFT_HOLD` × `onset_steps`, its
  rise not common to the other units (`_common`) and explaining the job's (`EXPLAINS`).
  Where the rank's host took on new demand for its CPUs as the change began (`demand_rose`),
  a change holds `onset_steps` and a shift twice that, whatever the rank's peers.
The strength of the evidence (`z`) feeds the conclusion's confidence.
"""

from __future__ import annotations

import bisect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diagnosis.columns import Columns, codes, col, ints, search
from diagnosis.hang_rca import stalled_steps
from diagnosis.window import Window, assign_steps
from ingest.records import comm_kinds

Array = np.ndarray
STAGE_COLS = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step",
              "step_other")


@dataclass(frozen=True)
class SlowConfig:
    recent: int = 20  # the newest full steps: the step time of the job is their median
    baseline: int = 30  # full steps before `recent` also judged: the change test's baseline
    min_share: float = 0.03  # mean excess ≥ this share of the step time
    min_ratio: float = 1.05
    phase_ratio: float = 1.5  # CPU phases: ratio for "host cpu" (≥ 2 phases, each with an
    #                           excess of at least min_share / 3 of the step time)
    net_ratio: float = 1.2
    net_abs_ns: float = 2e6
    class_ratio: float = 1.3  # one kernel class slower by this (median), others < other_ratio
    other_ratio: float = 1.1
    onset_steps: int = 4  # a change must hold for this many steps
    z_change: float = 4.0  # a change: this many robust σ of the unit's own excess noise
    z_job: float = 2.0  # and the job's median step time rose by this many standard errors
    job_noise: float = 0.5  # an excess must reach this × the job step time's robust σ
    min_peers: int = 4  # an outlier verdict needs this many other units to compare with
    z_peers: float = 5.0  # an outlier: this many robust σ above its peers' means
    absorbed_ratio: float = 2.0  # a change the job's step time hides: at least this ratio
    absorbed_z: float = 2.0  # … and this × z_change of the unit's own σ
    sparse_quiet: float = 0.01  # intermittent excess: the quiet before it at most this likely
    min_baseline: int = 8  # a change needs this many steps before it (their noise: a MAD)


@dataclass(frozen=True)
class Verdict:
    """Per unit: flagged, mean excess ns per step, mean ratio to the reference, strength (σ),
    and how it was found ("change", "absorbed", "outlier", "few_peers", "sparse", "confirm",
    "")."""

    flag: Array
    exc: Array
    ratio: Array
    z: Array
    how: Array
    since: Array  # row of the first step in excess (the change's onset; 0: the whole window)


#: the stages a link suspect names (p2p hops, DP and TP rings)
LINK_STAGES = ("pp_p2p", "dp_allreduce", "tp_collectives")


@dataclass
class Ctx:
    w: Window
    cfg: SlowConfig
    steps: Array  # judged steps: baseline + recent full steps, ascending
    step_ns: float
    stage_of: Array  # pp stage per rank
    lo_ns: int = 0  # first start of a judged step (stages)
    job_step: Array = field(default_factory=lambda: np.zeros(0))  # job step time per step
    confirm: frozenset[int] = frozenset()  # ranks of an open incident (hysteresis)
    #: the open incident named a link (`LINK_STAGES`): only then are its ranks' links confirmed
    confirm_links: bool = False
    _ops_sel: Array | None = None
    #: per-analysis results more than one analysis reads (own_time.own_times per stage)
    memo: dict[str, Any] = field(default_factory=dict)
    #: the stage the open incident named (None: no incident open)
    confirm_stage: str | None = None

    def noise_floor(self) -> float:
        """`job_noise` × the robust σ of the job's step time over the judged steps: an excess
        smaller than a fraction of the noise every step of the job already has costs the job
        nothing it can tell from that noise (a co-scheduled rank a millisecond slower)."""
        if self.job_step.size < 2 * self.cfg.onset_steps:
            return 0.0
        # from step-to-step differences: a slowdown's level shift is one outlier among them,
        # not noise (the MAD of the levels would count the change itself as noise)
        return self.cfg.job_noise * float(mad_sigma(np.diff(self.job_step))) / float(np.sqrt(2))

    def ops_of_kind(self, kind: str) -> Array:
        """Mask over ops rows on a communicator of `kind` (through the comm_id codes)."""
        uniq, code = codes(col(self.w.get("ops"), "comm_id"))
        kinds = self.w.grid.comm_kind
        return np.asarray(comm_kinds(uniq.tolist(), kinds) == kind,
                          dtype=bool)[code] if uniq.size else np.zeros(code.size, dtype=bool)

    def comm_kinds(self, rows: Array) -> Array:
        """The communicator kind of some ops rows (object array)."""
        uniq, code = codes(col(self.w.get("ops"), "comm_id"))
        kinds = self.w.grid.comm_kind
        table = comm_kinds(uniq.tolist() or [""], kinds)
        return np.asarray(table[code[rows]])

    def step_index(self, step: Array) -> Array:
        """Position of each step (one of `steps`) in `steps`."""
        lo = int(self.steps[0]) if self.steps.size else 0
        if self.steps.size and int(self.steps[-1]) - lo + 1 == self.steps.size:
            return np.asarray(step - lo)  # consecutive steps: no search
        return np.searchsorted(self.steps, step)

    def ops_recent(self) -> Array:
        """Mask over ops rows: a completed call of a judged step (computed once)."""
        if self._ops_sel is None:
            ops = self.w.get("ops")
            self._ops_sel = in_steps(ints(ops, "step", -1), self.steps) & (ints(ops, "t_end") > 0)
        return self._ops_sel


def by_rank_time(rank: Array, t: Array) -> Array:
    """`np.lexsort((t, rank))`: the positions by rank, then time, ties in their order — by
    one stable argsort of one int64 key (rank above 40 bits of ns from the earliest time: 18
    minutes, more than a window holds), several times faster on millions of rows; lexsort
    where the key would not fit."""
    if not rank.size:
        return np.zeros(0, dtype=np.intp)
    lo = int(t.min())
    if int(t.max()) - lo >= 1 << 40 or int(rank.min()) < 0 or int(rank.max()) >= 1 << 22:
        return np.lexsort((t, rank))
    return np.argsort((rank.astype(np.int64) << 40) | (t - lo), kind="stable")


def in_steps(step: Array, steps: Array) -> Array:
    """`np.isin(step, steps)` for int steps through one position lookup (steps ascending)."""
    if steps.size == 0:
        return np.zeros(step.size, dtype=bool)
    lo, hi = int(steps[0]), int(steps[-1])
    if hi - lo + 1 == steps.size:  # consecutive steps: a range test
        return np.asarray((step >= lo) & (step <= hi))
    pos = np.minimum(np.searchsorted(steps, step), steps.size - 1)
    return np.asarray(steps[pos] == step)


def matrix(ctx: Ctx, step: Array, rank: Array, value: Array, *, aligned: bool) -> Array:
    """float64 [steps, world]: Σ value per (step, rank), nan where a rank has no row; `step` must
    be one of ctx.steps. aligned: one row per judged step; else only the steps that have rows.
    One bincount over a flat (step, rank) index."""
    world = ctx.w.grid.world
    ok = (rank >= 0) & (rank < world)
    flat = ctx.step_index(step[ok]) * world + rank[ok]
    n = ctx.steps.size * world
    acc = np.bincount(flat, weights=value[ok].astype(np.float64), minlength=n)
    seen = np.bincount(flat, minlength=n) > 0
    out = np.where(seen, acc, np.nan).reshape(ctx.steps.size, world)
    return out if aligned else out[seen.reshape(ctx.steps.size, world).any(axis=1)]


def q25(x: Array, least: int = 1) -> Array:
    """Lower quartile along axis 1 ignoring nan (nearest-rank; nan where a row has fewer than
    `least` values)."""
    srt = np.sort(x, axis=1)  # nan sorts last
    n = np.sum(~np.isnan(x), axis=1)
    idx = np.maximum((n - 1) // 4, 0)
    out = srt[np.arange(x.shape[0]), np.minimum(idx, max(x.shape[1] - 1, 0))]
    return np.where(n >= max(least, 1), out, np.nan)


def reference(m: Array, groups: Array) -> Array:
    """Lower quartile over the units of the same group, per step: [steps, units]. The quartile
    stays clean while fewer than three quarters of the peers are slow. nan at a step where
    fewer than two units of the group have a value: a unit is not its own reference."""
    out = np.full_like(m, np.nan)
    for s in np.unique(groups).tolist():
        cols = np.flatnonzero(groups == s)
        if cols.size:
            out[:, cols] = q25(m[:, cols], least=2)[:, None]
    return out


def nan_median(x: Array, axis: int = 0) -> Array:
    """np.nanmedian's values along `axis` (nan where a lane has no number), by one sort: NaN
    sorts last, so a lane's median sits at its count of numbers. np.nanmedian takes a
    masked-array path for small arrays that cost ~0.3 ms a call — most of a slowdown
    analysis, which judges dozens of small (step × unit) matrices per try."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        return np.asarray(np.median(x, axis=axis))
    if x.shape[axis] == 0:
        return np.full(np.delete(x.shape, axis), np.nan, dtype=x.dtype)
    s = np.sort(x, axis=axis)
    n = np.expand_dims(np.count_nonzero(~np.isnan(x), axis=axis), axis)
    lo = np.take_along_axis(s, np.maximum(n - 1, 0) // 2, axis)
    hi = np.take_along_axis(s, np.minimum(n // 2, s.shape[axis] - 1), axis)
    with np.errstate(all="ignore"):
        med = (lo + hi) / x.dtype.type(2)
    med = np.where(n == 0, np.nan, med).astype(x.dtype, copy=False)
    return np.squeeze(med, axis=axis)


def mad_sigma(x: Array, axis: int = 0) -> Array:
    """Robust standard deviation (1.4826 × median absolute deviation), nan-aware."""
    with np.errstate(all="ignore"):
        med = np.expand_dims(nan_median(x, axis=axis), axis)
        return np.asarray(1.4826 * nan_median(np.abs(x - med), axis=axis))


def _spread(x: Array) -> float:
    """The noise of a 1-D series for the change test: the larger of its robust σ and its upper
    tail's width, (p90 − p50) / 1.2816 — equal for Gaussian noise, larger for the heavy upper
    tail of a rank that shares its cores (descheduled now and then for milliseconds), which
    the MAD alone reads as quiet."""
    q50, q90 = np.percentile(x, [50, 90])
    return max(float(mad_sigma(x)), float(q90 - q50) / 1.2816)


def prefix_spreads(x: Array) -> Array:
    """`out[i]` = `_spread(x[:i])` for i in 1..n (out[0] nan), for every prefix of a 1-D series
    at once: the prefixes as the rows of one NaN-padded matrix, sorted once; the percentiles
    as np.percentile's default (linear) method computes them, value for value. The change
    test measures the noise of every baseline it tries; one `_spread` per baseline was most
    of a slowdown analysis's CPU (~0.5 ms each, dozens per unit in a fault)."""
    x = np.asarray(x)
    n = x.size
    out = np.full(n + 1, np.nan)
    if n == 0:
        return out
    rows = np.where(np.arange(n)[None, :] < np.arange(1, n + 1)[:, None], x[None, :], np.nan)
    with np.errstate(all="ignore"):
        mad = 1.4826 * nan_median(np.abs(rows - nan_median(rows, axis=1)[:, None]), axis=1)
    ordered = np.sort(rows, axis=1)
    count = np.arange(1, n + 1)
    q = []
    for frac in (0.5, 0.9):
        at = (count - 1) * frac  # np.percentile's virtual index (method "linear")
        lo = np.floor(at)
        top = at >= count - 1
        lo_i = np.where(top, count - 1, lo).astype(np.intp)
        hi_i = np.where(top, count - 1, lo + 1).astype(np.intp)
        gamma = at - np.where(top, -1, lo)
        a = ordered[np.arange(n), lo_i]
        b = ordered[np.arange(n), np.minimum(hi_i, n - 1)]
        diff = b - a
        q.append(np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma))
    out[1:] = np.maximum(mad, (q[1] - q[0]) / 1.2816)
    return out


def _nanmedian(x: Array, axis: int = 0) -> Array:
    return nan_median(x, axis=axis)


#: a rank's change is the scheduler's when its steps' CPU wait rose by this share of it
#: (`crowding`; `slow.cpu.EXPLAIN` judges a starved suspect by the same share)
CROWD_SHARE = 0.5

#: while the judged steps reach back to the job's start (`from_job_start`), a change the
#: scheduler made (a rank's CPU wait, or a quantity `crowding` puts down to it) needs this many
#: times `min_baseline` steps before it (diagnosis.slow.cpu, module docstring)
BASELINE_FACTOR = 2
#: a window whose first stage record starts more than this many median steps after its start
#: holds the job's start (`from_job_start`)
START_STEPS = 2


def from_job_start(ctx: Ctx) -> bool:
    """Whether the judged steps reach back to the job's first stored step (diagnosis.slow.cpu,
    module docstring: the scheduler places a job's threads in its first seconds): the first
    judged step is the window's first full step, and the window's first stage record
    starts more than `START_STEPS` of the job's median steps after the window's own start — the
    job began inside the window. A job older than the window has records from the window's
    start on (its first, cut step among them). True too after a gap in a job's records inside
    the window: the stricter baseline, where it cannot be told."""
    st = ctx.w.get("stages")
    if not st or not ctx.steps.size:
        return False
    step = ints(st, "step")
    first_full = full_steps(step)
    if not first_full.size or int(first_full[0]) != int(ctx.steps[0]):
        return False
    return int(ints(st, "t_start").min()) - ctx.w.start_ns > START_STEPS * ctx.step_ns


#: a change the scheduler may have made — a rank's CPU wait, or a quantity `crowding` puts down
#: to it — must hold this many `onset_steps`: on shared cores the scheduler crowds one rank off
#: its core for up to 8 steps of ~50 ms and then lets go (`_judge`)
CPU_HOLD = 3


#: a shift of a rank's CPU wait that only the rank test finds (`shift_change`) must hold this
#: many `onset_steps`: twice `CPU_HOLD`, as weaker evidence needs more of it (module docstring)
SHIFT_HOLD = 2 * CPU_HOLD


#: a job whose median rank waits for a CPU at least this share of its steps' time runs more
#: threads than its cores take at once: the scheduler crowds them in turn (`host_crowded`)
CROWDED_SHARE = 0.01


def host_crowded(ctx: Ctx) -> bool:
    """Whether the job's ranks wait for CPUs at all over the judged steps: its median rank's
    total CPU wait (the tracer's per-step counter, `step_waits`) is at least `CROWDED_SHARE` of
    its steps' total time. False without the counter. Where they do, the scheduler crowds any
    of the job's threads for a few steps at a time — a transport's too, which no counter sees
    (`_judge`: a link's change holds twice the onset there)."""
    got = step_waits(ctx)
    if got is None:
        return False
    wait, tot = got
    with np.errstate(all="ignore"):
        share = np.nansum(wait, axis=0) / np.nansum(tot, axis=0)
    share = share[np.isfinite(share)]
    return bool(share.size) and float(np.median(share)) >= CROWDED_SHARE


def _seen(series: Array, since: int) -> int:
    """How many of the newest `since` steps of `series` are known (not nan)."""
    return int(np.sum(~np.isnan(series[series.size - since:]))) if since > 0 else 0


#: new demand on a host (`demand_rose`): the Mann-Whitney z of the host's CPU pressure over a
#: change's steps against the steps before it. With a change of `onset_steps` (4) after a
#: baseline of 30-46 steps, 3 asks that the 4 sit above all but a few of the baseline's
Z_DEMAND = 3.0


def step_pressure(ctx: Ctx) -> tuple[Array, Array] | None:
    """(share, time): float [judged steps, world] matrices of the host's CPU pressure during
    each rank's step as a share of the step's wall time (the tracer's `cpu_pressure_ns` over
    the stage total), and that wall time; nan where a rank has no stage record or no counter.
    None when no judged step carries it. Computed once per analysis (`ctx.memo`)."""
    if "cpu:pressure" not in ctx.memo:
        ns = step_counter(ctx, "cpu_pressure_ns")
        ctx.memo["cpu:pressure"] = None if ns is None else (np.minimum(ns[0] / ns[1], 1.0),
                                                            ns[1])
    got: tuple[Array, Array] | None = ctx.memo["cpu:pressure"]
    return got


def demand_rose(ctx: Ctx, x: int, since: int, rise: float) -> bool:
    """Whether rank `x`'s host took on new demand for its CPUs as a change of `rise` ns a step
    began on `x` `since` judged steps ago: the host's CPU pressure during `x`'s steps (the
    time some runnable task of the host waited for a CPU: Linux PSI, `step_pressure`), as a
    share of each step's time, over those steps sits above the steps before (Mann and
    Whitney's z ≥ `Z_DEMAND`, `rank_sums`), and its median share's rise, in ns of the steps
    since (× their median time), is at least `DEMAND_EXPLAINS` (half) of `rise`: the new demand
    is big enough to account for the change. A share, not ns: a step that got longer has more
    pressure in ns at the same share — a contended host's steady pressure would rise with any
    slowdown. False without the counter on `min_baseline` steps before and `onset_steps`
    since.

    Why it matters: a rank's CPU wait changes for two reasons a rank's own counters cannot
    tell apart. Something new wants the host's CPUs (a process that arrived, data-loader
    workers, another job) — or nothing changed and the scheduler moved the same threads: on
    shared cores it crowds one rank off its core for a few hundred milliseconds and then
    another (`CPU_HOLD`). The first raises the host's pressure — more runnable tasks than
    CPUs for more of the time — the second only moves the waiting between the host's tasks.
    On this machine's real catalog (2 vCPUs; the rankwatch stack, broker and store beside
    the job), a CPU hog's busy processes raised the pressure from 0.3-0.5 of each step's time
    to 0.9 from the hog's first step, where a contended control's stayed at 0.5-0.7 with
    slower swings of its own as the stack's bursts came and went."""
    got = _pressure_split(ctx, x, since)
    if got is None:
        return False
    before, after, step_ns = got
    _, z = rank_sums(np.concatenate([before, after]), np.array([before.size]))
    up = (float(np.median(after)) - float(np.median(before))) * step_ns
    return float(z[0]) >= Z_DEMAND and up >= DEMAND_EXPLAINS * rise


#: a host whose CPU pressure was at least this share of its steps' time before a change had no
#: room to show new demand (`pressure_could_rise`): some task waited nearly all the time already
SATURATED = 0.9


def pressure_could_rise(ctx: Ctx, x: int, since: int) -> bool:
    """Whether rank `x`'s host's CPU pressure could show new demand at a change `since` judged
    steps ago: the counter known on `min_baseline` steps before and `onset_steps` since, and
    its median share before below `SATURATED`. Where it could and did not rise
    (`demand_rose` False), a change of the rank's wait is the scheduler moving the waiting
    between the host's tasks, not something new taking the CPU."""
    got = _pressure_split(ctx, x, since)
    return got is not None and float(np.median(got[0])) < SATURATED


def _pressure_split(ctx: Ctx, x: int, since: int) -> tuple[Array, Array, float] | None:
    """(known pressure shares of rank `x`'s steps before a change `since` judged steps ago,
    those since, the median time of the steps since): None without the counter on
    `min_baseline` steps before and `onset_steps` since."""
    got = step_pressure(ctx)
    if got is None or not 0 <= x < got[0].shape[1] or since <= 0:
        return None
    share, t = got[0][:, x], got[1][:, x]
    cut = share.size - since
    before, after = share[:cut], share[cut:]
    before, after = before[~np.isnan(before)], after[~np.isnan(after)]
    if before.size < ctx.cfg.min_baseline or after.size < ctx.cfg.onset_steps:
        return None
    return before, after, float(np.nanmedian(t[cut:]))


#: the share of a change (ns a step) a host's new demand must account for (`demand_rose`):
#: `diagnosis.slow.cpu.EXPLAIN`'s half, as for a rank's own extra waiting
DEMAND_EXPLAINS = 0.5


def starvation_held(ctx: Ctx, since: int, before: int, min_baseline: int | None = None,
                    demand: bool = False) -> bool:
    """Whether a rank's starvation of CPU — a change of its wait, or of a quantity its wait
    explains — seen on `since` steps after `before` steps is held as it must be to be named:
    `CPU_HOLD` × `onset_steps` steps (`onset_steps` where it came with new demand on the
    rank's host, `demand`: `demand_rose`), and `BASELINE_FACTOR` × `min_baseline` before
    them while the judged steps reach back to the job's start (`from_job_start`)."""
    cfg = ctx.cfg
    if since < (1 if demand else CPU_HOLD) * cfg.onset_steps:
        return False
    least = BASELINE_FACTOR * (min_baseline or cfg.min_baseline)
    return before >= least or not from_job_start(ctx)

#: a link's own rise is common to the job's links when the median rise of the others over the
#: same steps reaches this share of it (a machine-wide stall lengthens every transfer)
COMMON = 0.5


def _common(m: Array, x: int, since: int, group: Array) -> bool:
    """Whether unit `x`'s rise over its last `since` steps (median after − median before) is
    shared by the other units over the same steps — its own peers (same `group`) or the job's
    units at large: two links cannot say which one changed by themselves, but a change its
    peer shows too, or most links show, is no one link's (a machine-wide stall). A unit with
    no other to compare (a DDP job's one ring) cannot show it here: True (`_judge` asks
    `lone_change` of it instead)."""
    if m.shape[1] < 2:
        return True
    if since >= m.shape[0]:
        return False
    with np.errstate(all="ignore"):
        rise = nan_median(m[-since:], axis=0) - nan_median(m[:-since], axis=0)
    own = float(rise[x])
    if not own > 0:
        return False
    others = np.arange(m.shape[1]) != x
    for pick in (others & (group == group[x]), others):
        r = rise[pick]
        r = r[~np.isnan(r)]
        if r.size and float(np.median(r)) >= COMMON * own:
            return True
    return False


def lone_change(ctx: Ctx, series: Array, since: int) -> bool:
    """Whether the rise of a unit with no like unit to compare (a DDP job's one ring: `_common`
    has nothing to find its rise in) over its newest `since` steps is its own, judged against
    the two things that lengthen a ring's transfers with it:
    - the ranks' own work: the ring's rise accounts for at least `COMMON` of the job's step
      time rise over the same steps — a job whose compute slowed everywhere (a machine-wide
      slowdown, on a CPU transport its reductions too) rose by more than its ring did;
    - the host's contention: the ranks' steps waited for a CPU (`step_waits`; the median
      rank's mean over the steps since against its median before) less than `COMMON` of the
      ring's rise. The transport's threads do not count in the training thread's counter, but
      a host crowded enough to slow them crowds the training threads too.
    Without the counters the contention cannot be ruled out: False. On a real 4-rank DDP job
    whose rank 1 handed each gradient all-reduce to gloo 40 ms late, the ring's transfer rose
    4-15 → 37-51 ms a step and the job's 55-70 → 88-100 ms, while the ranks waited 0-8 ms a
    step for a CPU before and after."""
    js = ctx.job_step
    n = series.size
    if not 0 < since < n or js.size != n:
        return False
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        own = float(np.nanmedian(series[-since:]) - np.nanmedian(series[:-since]))
        job = float(np.median(js[-since:]) - np.median(js[:-since]))
        if not (own > 0 and own >= COMMON * job):
            return False
        got = step_waits(ctx)
        if got is None or got[0].shape[0] != n:
            return False
        wait = got[0]
        rise = np.nanmean(wait[-since:], axis=0) - np.nanmedian(wait[:-since], axis=0)
        rise = rise[np.isfinite(rise)]
    return bool(rise.size) and float(np.median(rise)) < COMMON * own


def job_change(ctx: Ctx, since: int) -> float:
    """How many standard errors the job's median step time over its last `since` steps lies
    above its median over the steps before (0 when there are too few of either, or when the
    rise is no larger than the job's own excursions): the robust σ of the job's own step
    times (1.4826 × MAD) and the standard error of a median, 1.2533 σ / √n, for both medians.

    The standard error judges the level of independent steps; a job's step times are not
    independent — a job sharing its cores slows for a few hundred milliseconds whenever the
    scheduler crowds it (`excursion`). A rise counts only when the newest steps' median
    stands above every stretch of the same length before them: a change the job's own
    history already shows without a fault is that history's noise."""
    js = ctx.job_step
    k = ctx.cfg.onset_steps
    if js.size < since + max(k, ctx.cfg.min_baseline) or since < k:
        return 0.0
    before, after = js[:-since], js[-since:]
    level = float(np.median(after))
    if level <= excursion(before, since):
        return 0.0
    sd = max(float(mad_sigma(before)), 0.01 * float(np.median(before)), 1.0)
    se = 1.2533 * sd * np.sqrt(1.0 / before.size + 1.0 / after.size)
    return (level - float(np.median(before))) / float(se)


#: a short change must explain the job's rise: the job rose by at most this × its excess
#: (about 1 × where the unit is the cause; twice leaves room for the noise of both medians)
EXPLAINS = 2.0


def _explains(ctx: Ctx, excess: float, since: int) -> bool:
    """Whether a unit's mean `excess` ns a step over its last `since` steps could have made
    the job's median step time rise as much as it did over the same steps (`EXPLAINS`)."""
    js = ctx.job_step
    if since >= js.size or since < 1:
        return True
    rise = float(np.median(js[-since:])) - float(np.median(js[:-since]))
    return rise <= EXPLAINS * excess


def excursion(x: Array, length: int) -> float:
    """The highest median of `length` consecutive values of `x` (of all of `x` when it is
    shorter): how high the series already went, over a stretch as long as the one judged."""
    n = min(max(length, 1), x.size)
    if n == 0:
        return float("-inf")
    windows = np.lib.stride_tricks.sliding_window_view(x, n)
    return float(np.median(windows, axis=1).max())


def judge(ctx: Ctx, m: Array, ratio_min: float, groups: Array | None = None, *,
          ref: Array | None = None, floor: float | None = None, sparse: bool = False,
          confirmable: Array | None = None, job_gate: bool = True,
          changes_only: bool = False, min_baseline: int | None = None) -> Verdict:
    """The verdict for every unit (column) of `m` (module docstring). `groups`: the peer set of
    each unit (default: the PP stage of each rank); `confirmable`: bool per unit, the units an
    open incident's ranks own (default: units are ranks, those in `ctx.confirm`);
    `job_gate=False` for links (module docstring, "absorbed"); `changes_only`: only a change
    the job's step time shows (and `confirm`), no persistent or absorbed verdict — for a
    quantity whose difference between peers is the environment's as often as a fault's (a
    rank's CPU wait on shared cores: `diagnosis.slow.cpu`); `min_baseline`: the steps a unit's
    change needs before it, for a quantity whose noise a shorter stretch does not show
    (default: the config's)."""
    with warnings.catch_warnings():  # all-nan columns (a unit without rows) are expected
        warnings.simplefilter("ignore", RuntimeWarning)
        return _judge(ctx, m, ratio_min, groups, ref, floor, sparse, confirmable, job_gate,
                      changes_only, min_baseline)


def _judge(ctx: Ctx, m: Array, ratio_min: float, groups: Array | None, ref: Array | None,
           floor: float | None, sparse: bool, confirmable: Array | None,
           job_gate: bool, changes_only: bool = False,
           min_baseline: int | None = None) -> Verdict:
    cfg = ctx.cfg
    n, u = m.shape
    groups = ctx.stage_of if groups is None else groups
    ref = reference(m, groups) if ref is None else ref
    floor = cfg.min_share * ctx.step_ns if floor is None else floor
    if job_gate:  # a link's change is judged by its own noise, the job's does not hide it
        floor = max(floor, ctx.noise_floor())
    d = m - ref  # per-step excess over the peer reference
    with np.errstate(all="ignore"):
        exc = np.nan_to_num(np.nanmean(np.maximum(d, 0.0), axis=0))
        ratio = np.nan_to_num(np.nanmean(m, axis=0) / np.nanmean(ref, axis=0), nan=1.0)
    flag = np.zeros(u, dtype=bool)
    z = np.zeros(u)
    how = np.full(u, "", dtype=object)
    since = np.zeros(u, dtype=np.int64)
    material = (exc >= floor) & (ratio >= ratio_min)
    present = ~np.isnan(m).all(axis=0)
    gi = np.unique(groups, return_inverse=True)[1]
    peers = np.bincount(gi[present], minlength=gi.max() + 1 if gi.size else 0)[gi]
    # -- outlier: a persistent difference, only in a peer set that can show it ---------------
    # links (job_gate off) differ by topology (switches, NVLink or NIC): only a change counts.
    # The σ it is judged by is the spread of the *other* units' means: `min_peers` of them
    # (three ranks of a 4-rank stage give a MAD of three numbers: its 2 % floor decided, and a
    # rank sharing its core was an outlier at 6σ in a simulated realistic control)
    # ... and on at least 2 × `onset_steps` known steps of the unit: a mean of one or two steps
    # is no persistent difference (a rank's own forward is known once its calls of a later step
    # are stored; at a job's start that was its first step alone, the start-up's, 1.6x its
    # peers', and a fault-free 8-rank job was named for it)
    known_n = np.sum(~np.isnan(m), axis=0)
    persistent = job_gate and not changes_only
    big = material & (peers - 1 >= cfg.min_peers) & persistent \
        & (known_n >= 2 * cfg.onset_steps)
    if big.any():
        with np.errstate(all="ignore"):
            means = np.nanmean(m, axis=0)
            above = np.nanmean(np.where(np.isnan(d), np.nan, (d > 0.05 * ref)), axis=0)
        for x in np.flatnonzero(big).tolist():
            others = np.flatnonzero((gi == gi[x]) & present)
            others = others[others != x]
            om = means[others]
            sd = max(float(mad_sigma(om)), 0.02 * float(np.median(om)), 1.0)
            zx = (float(means[x]) - float(np.median(om))) / sd
            if zx >= cfg.z_peers and above[x] >= 0.8:
                flag[x], z[x], how[x] = True, zx, "outlier"
    # beside 2 or 3 others their means' spread cannot be measured; the unit must stand above
    # every one of them on most steps, by `z_peers` of the quantity's own per-step noise (each
    # peer's steps around its own median, pooled). A rank crowded off its core for the job's
    # first second does neither (1.6σ, above all three peers on 44 % of its steps); a rank
    # whose data wait is 80 ms against its peers' 1 ms from the job's start does both
    few_peers = material & (peers - 1 >= 2) & (peers - 1 < cfg.min_peers) & persistent & ~flag
    for x in np.flatnonzero(few_peers).tolist():
        others = np.flatnonzero((gi == gi[x]) & present)
        others = others[others != x]
        po = m[:, others]
        rows = ~np.isnan(m[:, x]) & ~np.isnan(po).any(axis=1)
        if rows.sum() < 2 * cfg.onset_steps:
            continue
        po, mx = po[rows], m[rows, x]
        centre = np.median(po, axis=0)
        sd = max(_spread((po - centre).ravel()), 0.01 * float(np.median(centre)),
                 1e-3 * ctx.step_ns, 1.0)
        zx = (float(np.median(mx)) - float(np.median(centre))) / sd
        if zx >= cfg.z_peers and float(np.mean(mx > po.max(axis=1))) >= 0.8:
            flag[x], z[x], how[x] = True, zx, "few_peers"
    # -- change: a rise of the unit's own excess, beyond its own noise -------------------------
    # a link (job_gate off) in a peer set too small: its transfer time moves with the load
    # of the few ranks it joins, and two links cannot say which one changed by themselves —
    # its change counts only when the job's step time rose with it (the gate of ranks), and
    # it is a change of its own time, not of its excess over a peer (a peer that got faster
    # because its other end now arrives late is no evidence against this one)
    few = (not job_gate) & (peers < cfg.min_peers)
    ranked = job_gate and u == ctx.w.grid.world  # the units are the job's ranks
    k = cfg.onset_steps
    tail = np.zeros(u, dtype=bool)
    if n >= 2 * k:  # cheap pre-test: the newest known steps well above the older half's
        #            median. Known: a rank's own time is unknown until its calls of a later
        #            step are stored, a link's until its sends complete — the newest rows
        #            trail by a few steps, more the longer they are
        with np.errstate(all="ignore"):
            series = np.where(few, m, d)
            base0 = _nanmedian(series[: n // 2], axis=0)
            known = ~np.isnan(series)
            newest = known & (np.cumsum(known[::-1], axis=0)[::-1] <= k + 2)
            tail = (_nanmedian(np.where(newest, series, np.nan), axis=0) > base0 + floor) \
                & (newest.sum(axis=0) >= k)
    # such a unit's own series is its only baseline, and a short one is whatever stretch the
    # judged steps begin with: it needs `BASELINE_FACTOR` x the steps. A fault-free DDP job's
    # one ring, 2-17 ms a step (median 5) over its whole run, began its judged steps with 8
    # steps at 1.2-2.8 ms: its return to its usual level was a change, 3.2x, 6.6σ (0.6)
    lone_base = max(min_baseline or 0, BASELINE_FACTOR * cfg.min_baseline)
    for x in np.flatnonzero(~flag & present & tail).tolist():
        res = (own_change(ctx, m[:, x], m[:, x], None, floor, ratio_min, lone_base)
               if few[x] else
               own_change(ctx, d[:, x], m[:, x], ref[:, x], floor, ratio_min, min_baseline))
        # a quantity judged on changes only (a rank's CPU wait) that the band test does not
        # find held: a smaller shift on most steps, which a rank test finds and twice the
        # hold must confirm (`shift_change`)
        # — unless it came with new demand on the rank's host (`demand_rose`): then the
        # change has a cause, and the holds against the scheduler's crowding (`CPU_HOLD`
        # onsets, `SHIFT_HOLD` for a shift, twice the onset beside few peers) do not apply;
        # a change holds the onset, a shift twice it
        demand = changes_only and res is not None and demand_rose(ctx, x, res[3], res[0])
        shifted = changes_only and (
            res is None or _seen(d[:, x], res[3]) < (1 if demand else CPU_HOLD) * k)
        if shifted:
            res = shift_change(ctx, d[:, x], m[:, x], ref[:, x], floor, ratio_min, min_baseline)
            demand = res is not None and demand_rose(ctx, x, res[3], res[0])
        if res is None:
            continue
        # and where the host's pressure could have shown new demand and did not, the change
        # is the scheduler's: it moved the waiting between the host's tasks (a contended TP
        # control's rank crowded for 12 steps in the job's second second, named 0.66; a
        # contended pipeline control's rank shifted 2.9 ms a step for 24, named 0.64 — the
        # host's pressure flat under both)
        if changes_only and not demand and pressure_could_rise(ctx, x, res[3]):
            continue
        job_moved = job_change(ctx, res[3]) >= cfg.z_job
        if (few[x] or shifted) and (not job_moved or (_common(m, x, res[3], gi) if u > 1 else
                                                      not lone_change(ctx, m[:, x], res[3]))):
            continue
        # beside too few like units to compare (a rank of a 2-rank pipeline stage, a link of
        # two), a unit's only evidence is its own series: its change must hold twice the
        # onset. A rank sharing contended cores is crowded off them for a few steps now and
        # then, a change of its own time as real as a fault's and over in half a second (a
        # real pipeline stage's forward 14 → 29-45 ms for 6 steps in a contended control; a
        # healthy gloo link's transfers 2.3 → 6 ms/step for 4)
        # and a change of a quantity judged on changes only (a rank's CPU wait) must hold
        # `CPU_HOLD` onsets: bursty where cores are shared, a rank crowded off its core for
        # 4-5 steps, near a contended control's end, waited 10-75 ms a step more than its
        # peers; a contended TP control's rank, beside an unpinned busy process, 13-46 ms a
        # step more on 7 of 8 steps and then no more, named at 0.95 with 2 onsets
        # — unless the rank's own CPU counters rule the crowding out (`crowding` False: its steps
        # did not wait more for a CPU while its time rose): the hold guards against the
        # scheduler, and a rank the scheduler did not crowd needs no more steps than any
        # other change. A quantity of ranks only; a link's transfer runs in the transport's
        # threads, whose waiting the counter (the training thread's) does not see. Tried and
        # left out: clearing a link's change when none of the ranks it runs on waited more
        # and its rise accounted for the job's (real pipeline and TP slow links named 3-4
        # steps sooner in replays) — a contended pipeline control's DP ring rose 1-3 → 15-51
        # ms a step for 4 steps while its two ranks' steps waited 1.5-8.5 ms as before, the
        # job's step time with it, and was named (0.6): its transport threads were crowded
        # A step held is a step seen: the newest judged steps whose value is not known yet (a
        # rank's own time, until its calls of a later step are stored) do not count
        series = m[:, x] if few[x] else d[:, x]
        seen = _seen(series, res[3])
        short = seen < 2 * k
        crowded = None
        if ranked and not changes_only:
            with np.errstate(all="ignore"):
                crowded = crowding(ctx, x, n - res[3], float(
                    np.nanmean(d[n - res[3]:, x]) - _nanmedian(d[:n - res[3], x])))
        cleared = crowded is False or demand
        hold = (2 if demand else SHIFT_HOLD) if shifted else 1 if demand else CPU_HOLD
        if (changes_only and seen < hold * k) \
                or (peers[x] < cfg.min_peers and short and not cleared):
            continue
        # a link's transfers run in its transport's threads: where the job's ranks wait for
        # CPUs, the scheduler crowds those threads in turn as it crowds the ranks', and a
        # link's change short of twice the onset is as likely its doing, whatever the link's
        # peers (an 8-rank TP job on 2 cores, fault-free until another rank hung: one of its
        # four TP groups' transfers 4-24 ms a step above the others' for 5 steps, the job's
        # step time up with them, named `tp_collectives` at 0.6 — and then no more)
        if not job_gate and short and host_crowded(ctx):
            continue
        # and whatever the peers, a change the rank's own counters show the scheduler made
        # (its steps waited for a CPU for at least half its rise) is CPU starvation, held to
        # what `diagnosis.slow.cpu` asks of a change of the wait itself: `CPU_HOLD` onsets (on
        # shared cores the scheduler crowds one rank for a few hundred ms: a healthy 4-rank
        # DDP control's rank 3, forward 13 → 17-28 ms with its wait 4 → 8-54 ms for 4 steps,
        # named `host cpu` at 0.79 and resolved 5 s later) and, while the judged steps reach
        # back to the job's start, `BASELINE_FACTOR` × `min_baseline` steps before it (a
        # healthy 2-stage pipeline's rank 2 in the job's second second: own forward 14 →
        # 19-23 ms for 6 steps after 14 from the job's first, its wait 3 → 11 ms a step
        # against its peers' unchanged, named 0.95 and resolved 5 s later)
        if crowded and not starvation_held(
                ctx, seen, int(np.sum(~np.isnan(series[:n - res[3]]))), min_baseline,
                demand_rose(ctx, x, res[3], res[0])):
            continue
        # and a short change must explain the job's rise it is gated on: a rank whose own
        # work is slower by e a step makes the job wait about e (in a pipeline too: the
        # excess a stage's step sums is its microbatches', which the schedule waits for one
        # by one). A job that rose by more than `EXPLAINS` × the unit's excess rose for
        # something else — a burst that lengthened every rank's collectives on a shared host
        # — and its rise does not speak for this unit: the change must hold twice the onset,
        # as one the job does not show (a healthy 4-rank DDP control: one rank's own backward
        # +14, +10, +4, +4 ms for 4 steps while the job's step time rose 23 ms, named at 0.81
        # and resolved 5 s later; the real catalog's faults at their naming, DDP, TP and a
        # 4-stage pipeline: job rise 0.66–0.99 × the culprit's excess)
        if (short or shifted) and ranked and job_moved and not _explains(ctx, res[0], res[3]):
            continue
        hidden = res[1] >= cfg.absorbed_ratio and res[2] >= cfg.absorbed_z * cfg.z_change \
            and not changes_only
        # a change the job's step time does not show is weaker evidence: it must hold twice
        # as long (a rank crowded off its core for a few hundred ms doubles a phase too) —
        # the same hold against the scheduler as above, and cleared the same way
        held = job_moved or not short or cleared
        if held and (job_moved or not job_gate or hidden):
            flag[x], exc[x], ratio[x], z[x] = True, res[0], res[1], res[2]
            how[x] = "shift" if shifted else "change" if job_moved else "absorbed"
            since[x] = n - res[3]
    # -- sparse: intermittent excess, many more spikes than any peer ---------------------------
    if sparse and n > k:
        with np.errstate(invalid="ignore"):
            spike = d >= floor
        cnt = spike.sum(axis=0)
        first = np.argmax(spike, axis=0)
        for x in np.flatnonzero(~flag & (cnt >= 3) & (first > 0)
                                & (peers >= cfg.min_peers)).tolist():
            others = np.flatnonzero((gi == gi[x]) & present)
            others = others[others != x]
            busiest = int(cnt[others].max()) if others.size else 0
            if not others.size or cnt[x] < 3 * busiest + 2:
                continue
            # the spikes of the group's units, shared out by chance at one rate, would give
            # some unit this many at most `sparse_quiet` of the time: 3 spikes of 3 on one
            # of 4 ranks is 1 in 16 — the first steps of a healthy job on a busy host
            total = int(cnt[x]) + int(cnt[others].sum())
            if spread_by_chance(int(cnt[x]), total, others.size + 1) >= cfg.sparse_quiet:
                continue
            # peers that spike too: the quantity has spikes of its own in this job (shared
            # cores), and a unit spiking more may always have — its first spike must follow
            # a quiet stretch that its rate of spikes since makes improbable (e^(−rate ×
            # quiet): the chance of that quiet without a change of the rate)
            rate = cnt[x] / max(int(np.sum(~np.isnan(d[first[x]:, x]))), 1)
            quiet = int(np.sum(~np.isnan(d[:first[x], x])))
            if busiest and rate * quiet < -np.log(cfg.sparse_quiet):
                continue
            e = float(np.nanmean(np.maximum(d[first[x]:, x], 0.0)))
            if e >= floor:
                flag[x], exc[x], z[x], how[x] = True, e, float(cnt[x] - busiest), "sparse"
                since[x] = first[x]
                with np.errstate(all="ignore"):
                    ratio[x] = float(np.nanmean(m[first[x]:, x]) / np.nanmean(ref[first[x]:, x]))
    # -- confirm: an open incident's ranks stay while their excess persists --------------------
    # at half the floor that opened it (hysteresis): the floor follows the job's noise, and
    # a job's last steps scatter as its ranks finish — a CPU-starved rank's wait excess, 12.1
    # ms a step and 20x its peers' to the job's end, fell below a noise floor that had risen
    # to 12.2 ms; its incident resolved and the next sweep opened it again
    if ctx.confirm:
        mine = np.isin(np.arange(u), list(ctx.confirm)) if confirmable is None else confirmable
        keep = mine & ~flag & (exc >= 0.5 * floor) & (ratio >= ratio_min)
        with np.errstate(invalid="ignore"):
            most = np.nanmean(np.where(np.isnan(d), np.nan, d >= 0.5 * floor), axis=0) >= 0.6
        for x in np.flatnonzero(keep & most).tolist():
            flag[x], how[x] = True, "confirm"
    return Verdict(flag, exc, ratio, z, how, since)


def spread_by_chance(count: int, total: int, units: int) -> float:
    """How likely one of `units` units, each as likely as the others to have each of `total`
    events, has at least `count` of them: `units` × the binomial upper tail P(X ≥ count),
    X ~ Bin(total, 1 / units) (a union bound over the units; exact for count > total / 2,
    where two units cannot both reach it)."""
    if count <= 0:
        return 1.0
    p = 1.0 / units
    tail = sum(math.comb(total, k) * p ** k * (1.0 - p) ** (total - k)
               for k in range(count, total + 1))
    return min(1.0, units * tail)


def own_change(ctx: Ctx, d: Array, m: Array, ref: Array | None, floor: float,
               ratio_min: float, min_baseline: int | None = None
               ) -> tuple[float, float, float, int] | None:
    """(excess, ratio, z, steps since the onset) of a unit whose excess series `d` rose beyond
    its own noise over its newest steps; else None (the job's step time is the caller's to
    check). Every split of the series into a baseline of at least `min_baseline` steps (the
    MAD of fewer says little of their noise: four steps at a job's start passed for a baseline)
    and its newest L ≥ `onset_steps` steps is tried: the split counts when at least 80 % of
    the newest steps lie above the baseline's median + 2σ (σ: the baseline's `_spread`, the
    unit's own noise) and their median rose by `z_change` σ and by the materiality floor;
    of those, the one whose rise is largest in standard errors of the two medians is the
    onset. All splits are judged at once, as arrays over the run lengths, and the baselines'
    spreads come from one `prefix_spreads` (the tests compare it with the one-split-at-a-time
    definition). With `ref` None, `d` is the unit's own quantity (`m`): its baseline is its
    reference, the excess its rise over it."""
    cfg = ctx.cfg
    k = cfg.onset_steps
    ok = ~np.isnan(d)
    dd, mm = d[ok], m[ok]
    rr = None if ref is None else ref[ok]
    n = dd.size
    # the medians of every baseline and every newest run, one sorted insertion per step
    head, tail = np.array(_running_medians(dd)), np.array(_running_medians(dd[::-1]))
    ref_head = None if rr is None or np.isnan(rr).any() else _running_medians(rr)
    # every split at once: `lengths` the newest runs, `mb` their baselines' medians
    least_base = cfg.min_baseline if min_baseline is None else min_baseline
    lengths = np.arange(k, n - max(k, least_base) + 1)
    if not lengths.size:
        return None
    mb = head[n - lengths]
    if rr is None:
        base = mb
    elif ref_head is not None:
        base = np.array(ref_head)[n - lengths]
    else:
        base = np.array([float(np.median(rr[:-length])) for length in lengths.tolist()])
    # σ is at least 1 % of the reference and 0.1 % of the step: a quantity that is ~0 on
    # every peer (a stage made only of waiting) has no noise to measure a rise against
    least = np.maximum(np.maximum(0.01 * base, 1e-3 * ctx.step_ns), 1.0)
    newest = np.arange(n)[None, :] >= (n - lengths)[:, None]  # row: the run's steps

    def above(band: Array) -> Array:
        """Per split: whether ≥ 80 % of its newest steps lie above `band` (compared in the
        series' own float type, as with a Python float)."""
        over = dd[None, :] > band.astype(dd.dtype, copy=False)[:, None]
        return np.asarray((over & newest).sum(axis=1) / lengths >= 0.8)

    rise = tail[lengths] - mb
    # both tests only get harder as σ grows: a split that fails them with σ at its floor is
    # passed over without measuring the baseline's spread (most splits, most units)
    cand = above(mb + 2 * least) & (rise >= floor) & (rise >= cfg.z_change * least)
    if not cand.any():
        return None
    sd = np.maximum(prefix_spreads(dd)[n - lengths], least)
    cand &= above(mb + 2 * sd) & (rise >= cfg.z_change * sd)
    if not cand.any():
        return None
    t = np.where(cand, rise / (sd * np.sqrt(1.0 / lengths + 1.0 / (n - lengths))), -np.inf)
    i = int(np.argmax(t))  # the largest rise in standard errors; the shortest run of equals
    length = int(lengths[i])
    # the onset: the first of the newest steps above the baseline's band
    first = int(np.argmax(dd[-length:] > float(mb[i] + 2 * sd[i])))
    run, zx = length - first, float(rise[i] / sd[i])
    steps_since = d.size - int(np.flatnonzero(ok)[n - run])  # judged steps, gaps included
    with np.errstate(all="ignore"):
        if rr is None:
            before = float(np.median(mm[:-run]))
            ratio = float(np.mean(mm[-run:]) / before) if before > 0 else float("inf")
            if ratio < ratio_min:
                return None
            return float(np.mean(mm[-run:])) - before, ratio, zx, steps_since
        ratio = float(np.mean(mm[-run:]) / np.mean(rr[-run:]))
    if ratio < ratio_min:
        return None
    return float(np.mean(np.maximum(dd[-run:], 0.0))), ratio, zx, steps_since


#: a rank's CPU wait (`shift_change`): the Mann-Whitney z its newest steps must reach
Z_SHIFT = 4.0


def shift_change(ctx: Ctx, d: Array, m: Array, ref: Array, floor: float, ratio_min: float,
                 min_baseline: int | None = None) -> tuple[float, float, float, int] | None:
    """(excess, ratio, z, steps since the onset) of a unit whose excess series `d` (over the
    reference `ref`; `m` the unit's own values) shifted up over its newest steps; else None.

    The test is Mann and Whitney's rank-sum test of the steps after a split against the steps
    before (every split with a baseline of at least `min_baseline` steps and a run of at least
    `onset_steps` at once, `rank_sums`): U counts the (before, after) pairs in which the after
    step is higher, ties a half; z = (U − ab/2) / √(ab(a + b + 1)/12) for a baseline of a
    steps and b after it (ties not corrected for, which only lowers z). The onset is Pettitt's
    change point (A. N. Pettitt, "A non-parametric approach to the change-point problem",
    Applied Statistics 28, 1979): the split of the largest centred U, U − ab/2 — the split of
    the largest z favours long runs and put onsets late. Its z must reach `Z_SHIFT`; the
    shift's size — the Hodges-Lehmann estimate, the median of the pairwise (after − before)
    differences — the materiality `floor`; the unit's mean since over the reference's
    `ratio_min`.

    For a quantity with a heavy upper tail (a rank's wait for a CPU on shared cores: mostly
    0-3 ms a step, now and then 10-40 when the scheduler crowds it) the median-and-band test
    (`own_change`) has little power: its σ is the tail's width, and a rank starved a little on
    most steps rather than much on every one does not put 80 % of them above the band. A rank
    test asks only that the newest steps sit above the old ones more often than chance allows,
    and a step where the peers were crowded together (the reference up, the excess down) is
    one low rank, not a failed step. On a real 4-rank job whose rank 1 shared its core with
    two busy processes (waits 0-20 ms a step against 0-4 before, 5 of its first 12 steps above
    the band) the band test never named it in 120 steps; the rank test's z passed 4 within
    25. z says the steps are unlikely to be one series *if they were independent*; they are
    not (the scheduler's crowding is sticky for seconds), which is why the caller holds a
    shift `SHIFT_HOLD` onsets (`diagnosis.slow.cpu`).
    """
    cfg = ctx.cfg
    ok = ~np.isnan(d)
    v = d[ok].astype(np.float64)
    n = v.size
    least_base = cfg.min_baseline if min_baseline is None else min_baseline
    lengths = np.arange(cfg.onset_steps, n - max(cfg.onset_steps, least_base) + 1)
    if not lengths.size:
        return None
    split = n - lengths  # the first step after each baseline
    u, z = rank_sums(v, split)
    # the onset: Pettitt's change point, the split of the largest centred U (not of the
    # largest z, which favours long runs and put onsets late); the caller asks it to have held
    i = int(np.argmax(u - split * (n - split) / 2.0))
    if z[i] < Z_SHIFT:
        return None
    sp = int(split[i])
    before, after = v[:sp], v[sp:]
    shift = float(np.median(after[:, None] - before[None, :]))
    with np.errstate(all="ignore"):
        ratio = float(np.mean(m[ok][sp:]) / np.mean(ref[ok][sp:]))
    if not (shift >= floor and ratio >= ratio_min):
        return None
    return shift, ratio, float(z[i]), d.size - int(np.flatnonzero(ok)[sp])


def rank_sums(v: Array, split: Array) -> tuple[Array, Array]:
    """(U, z) of Mann and Whitney's test of `v[s:]` against `v[:s]` for every `s` in `split`
    (1 ≤ s < len(v)), from one pairwise comparison: U is the number of (before, after) pairs
    in which the after value is higher, ties counted a half; z = (U − ab/2) / √(ab(a+b+1)/12),
    without the tie correction (which would only raise it)."""
    v = np.asarray(v, dtype=np.float64)
    n = v.size
    split = np.asarray(split, dtype=np.intp)
    # c[i, j]: value j above value i (a half for a tie); only i < j is ever summed
    c = (v[None, :] > v[:, None]) + 0.5 * (v[None, :] == v[:, None])
    above = np.cumsum(c, axis=0)  # above[r, j]: values 0..r that value j is above
    tail = np.cumsum(above[:, ::-1], axis=1)[:, ::-1]  # tail[r, j]: the same, summed over j..
    u = tail[split - 1, split]
    a, b = split.astype(np.float64), (n - split).astype(np.float64)
    return u, (u - a * b / 2.0) / np.sqrt(a * b * (n + 1.0) / 12.0)


def _running_medians(x: Array) -> list[float]:
    """`out[i]`: the median of `x[:i]` as np.median gives it (the middle value, or the mean of
    the two middle ones), for every i (nan for 0): one sorted insertion per value, instead of
    a median of every prefix."""
    x = np.asarray(x)
    # np.median means the two middle values in the array's own float type (float32 stays
    # float32); integers and float64 in float64, as Python's floats are
    narrow = x.dtype.type if x.dtype.kind == "f" and x.dtype != np.float64 else None
    kept: list[float] = []
    out = [float("nan")]
    for v in x.tolist():
        bisect.insort(kept, v)
        h = len(kept) // 2
        if len(kept) % 2:
            out.append(float(kept[h]))
        elif narrow is None:
            out.append((kept[h - 1] + kept[h]) / 2)
        else:
            out.append(float((narrow(kept[h - 1]) + narrow(kept[h])) / narrow(2)))
    return out


def full_steps(step: Array) -> Array:
    """Steps (ascending) with a stage record from at least 90 % of the ranks that have most."""
    steps, counts = np.unique(step, return_counts=True)
    return steps[counts >= 0.9 * max(int(counts.max()), 1)] if steps.size else steps


def stage_total(st: Columns) -> Array:
    return np.asarray(sum(ints(st, c, 0) for c in STAGE_COLS))


def step_waits(ctx: Ctx) -> tuple[np.ndarray, np.ndarray] | None:
    """(wait, time): float [judged steps, world] matrices of each step's CPU wait and wall time
    per rank (nan where a rank has no stage record or no counter); None when no judged step of
    the window carries the counter. Computed once per analysis (`ctx.memo`); callers must not
    change them."""
    if "cpu:wait" not in ctx.memo:
        got = _step_waits(ctx)
        ctx.memo["cpu:wait"], ctx.memo["cpu:time"] = got if got is not None else (
            np.zeros((0, 0)), np.zeros((0, 0)))
    wait, tot = ctx.memo["cpu:wait"], ctx.memo["cpu:time"]
    return (wait, tot) if wait.size else None


def _step_waits(ctx: Ctx) -> tuple[np.ndarray, np.ndarray] | None:
    return step_counter(ctx, "sched_wait_ns")


def step_counter(ctx: Ctx, column: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(value, time): float [judged steps, world] matrices of a per-step counter of the stage
    records (`column`: -1 where unknown) and each step's wall time per rank, nan where a rank
    has no stage record or no counter; None when no judged step carries it."""
    st = ctx.w.get("stages")
    if not st or column not in st:
        return None
    sel = in_steps(ints(st, "step"), ctx.steps)
    v = ints(st, column, -1)[sel]
    if not (v >= 0).any():
        return None
    step, rank = ints(st, "step")[sel], ints(st, "rank")[sel]
    w = matrix(ctx, step, rank, np.maximum(v, 0), aligned=True)
    t = matrix(ctx, step, rank, stage_total(st)[sel], aligned=True)
    known = matrix(ctx, step, rank, (v >= 0).astype(np.int64), aligned=True) > 0
    bad = ~known | ~(t > 0)
    w[bad], t[bad] = np.nan, np.nan
    return w, t


def crowding(ctx: Ctx, x: int, row: int, rise: float) -> bool | None:
    """Whether rank `x`'s change from judged row `row` on — its quantity `rise` ns a step above
    its baseline on average — is the scheduler's doing: its steps' CPU wait (the tracer's
    per-step counter, `step_waits`) over the same steps averaged at least `CROWD_SHARE` of
    `rise` above its median before. A rank crowded off a shared core loses its time waiting
    for a CPU; a rank whose own work got slower does not. Averages, not medians, over the
    change: lost time adds up (a rank crowded on 4 of a 6-step change waited 31, 4, 54, 8, 1
    and 0 ms: 16 ms a step on average, 6 at the median, against its forward's 10 ms rise).
    None without the counter on at least `onset_steps` − 1 steps since the onset and
    `onset_steps` before it: the counters cannot tell."""
    got = step_waits(ctx)
    if got is None or not 0 <= x < got[0].shape[1]:
        return None
    col_ = got[0][:, x]
    before, after = col_[:row], col_[row:]
    before, after = before[~np.isnan(before)], after[~np.isnan(after)]
    k = ctx.cfg.onset_steps
    if before.size < k or after.size < k - 1:
        return None
    return float(np.mean(after)) - float(np.median(before)) >= CROWD_SHARE * rise


def reach_start(stages: Columns, extra_steps: int, config: SlowConfig | None = None
                ) -> int | None:
    """The earliest start among the stage records of the last `recent + baseline +
    extra_steps` full steps: the records `analyze` reads lie after it (the analyst's sweep
    reads its raw rows from here). None when there are no stage records."""
    cfg = config or SlowConfig()
    step = ints(stages, "step")
    if not step.size:
        return None
    keep = full_steps(step)[-(cfg.recent + cfg.baseline + extra_steps):]
    return int(ints(stages, "t_start")[np.isin(step, keep)].min())


def judged_steps(w: Window, cfg: SlowConfig) -> tuple[Array, float, Array]:
    """(judged steps, median step time ns, job step time per judged step): the newest
    `recent + baseline` full steps that no recovered stall overlaps (a recovered stall is a
    transient hang, hang_rca.analyze_past_stall: its steps' excess is that hang again). The
    job's step time of a step is its slowest rank's (everyone waits for it)."""
    st = w.get("stages")
    step = ints(st, "step")
    full = full_steps(step)
    full = full[~np.isin(full, stalled_steps(w))]
    judged = full[-(cfg.recent + cfg.baseline):]
    tot = stage_total(st)
    sel = in_steps(step, judged)
    if not sel.any():
        return judged, 0.0, np.zeros(0)
    pos = np.searchsorted(judged, step[sel])
    job = np.zeros(judged.size)
    np.maximum.at(job, pos, tot[sel].astype(np.float64))
    recent = in_steps(step, judged[-cfg.recent:])
    step_ns = float(np.median(tot[recent])) if recent.any() else float(np.median(tot[sel]))
    return judged, step_ns, job


def stage_matrix(ctx: Ctx, name: str) -> Array:
    st = ctx.w.get("stages")
    sel = in_steps(ints(st, "step"), ctx.steps)
    return matrix(ctx, ints(st, "step")[sel], ints(st, "rank")[sel], ints(st, name, 0)[sel],
                  aligned=True)


def assign_steps_fast(t: Array, rank: Array, st_rank: Array, st_step: Array,
                      st_start: Array) -> Array:
    """`window.assign_steps`, faster: with few steps whose starts increase with the step on
    every rank, one comparison per step against the rank's start (a [rank, step] table); else
    (rank, time) packed into one int64 key and a plain searchsorted. Same result either way."""
    if st_rank.size == 0 or t.size == 0:
        return np.full(t.size, -1, dtype=np.int64)
    lo = min(int(t.min()), int(st_start.min()))
    span = max(int(t.max()), int(st_start.max())) - lo + 2
    top = max(int(rank.max()), int(st_rank.max())) + 1
    if min(int(rank.min()), int(st_rank.min())) < 0 or top * span >= 2**62:
        return assign_steps(t, rank, st_rank, st_step, st_start)
    steps, sj = np.unique(st_step, return_inverse=True)
    if steps.size <= 8:
        by = np.lexsort((st_step, st_rank))
        same = np.diff(st_rank[by]) == 0
        if np.all(np.diff(st_start[by])[same] > 0) and np.all(np.diff(st_step[by])[same] > 0):
            start = np.full((top, steps.size), np.iinfo(np.int64).max, dtype=np.int64)
            start[st_rank, sj] = st_start
            out = np.full(t.size, -1, dtype=np.int64)
            for j in range(steps.size):
                out = np.where(t >= start[rank, j], steps[j], out)
            return out
    key_st = st_rank * span + (st_start - lo)
    order = np.argsort(key_st, kind="stable")
    ks, ss, sr = key_st[order], st_step[order], st_rank[order]
    pos = search(ks, rank * span + (t - lo), side="right") - 1
    ok = (pos >= 0) & (sr[np.maximum(pos, 0)] == rank)
    return np.where(ok, ss[np.maximum(pos, 0)], -1).astype(np.int64)


def persistence(m: Array, ref: Array, start: Array | None = None) -> Array:
    """Per column: from the first step whose relative excess over the reference is above 5 %
    (or from row `start` where that is ≥ 0: the onset a change verdict found — a noisy step
    of the baseline does not make a step change "intermittent"), the share of the (finite)
    steps that are above 5 % — 0 where none is."""
    with np.errstate(all="ignore"):
        x = (m - ref) / ref
    fin = np.isfinite(x)
    hit = fin & (x > 0.05)
    first = np.argmax(hit, axis=0)
    if start is not None:
        first = np.where(start >= 0, np.minimum(start, max(m.shape[0] - 1, 0)), first)
        hit &= np.arange(m.shape[0])[:, None] >= first[None, :]
    n_hit = hit.sum(axis=0)
    from_row = np.cumsum(fin[::-1], axis=0)[::-1]  # finite steps at or after each row
    n_from = from_row[first, np.arange(m.shape[1])] if m.shape[0] else np.zeros(m.shape[1])
    with np.errstate(all="ignore"):
        return np.where(n_hit > 0, n_hit / np.maximum(n_from, 1), 0.0)
