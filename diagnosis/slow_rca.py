"""Root cause of a slowdown or jitter: which rank's *own* time grew, in which component.

Method — excess over peers, per (step, rank), on quantities that contain no waiting:
- compute: Σ GPU kernel time per step, NCCL kernels excluded (they spin while waiting) — ARGUS
  L3's view, per kernel class (gemm, attn, elementwise, optimizer);
- data (`data_next_wait`), callbacks, step_other, optim_step from the `stages` record
  (StageFrontier's contract; the loader wait is the rank's own loader);
- launch: Σ (t_start − t_enqueue) of the rank's calls — the NCCL proxy starting late (Mycroft #7);
- network: per DP communicator and step, the transfer time of its collective = the *shortest*
  time any member spent in it (the last arriver's; everyone else's includes waiting, Mycroft
  Fig. 2 / VenusTrace's AR node duration); per PP link (sender → receiver over a NIC) and step,
  Σ over its Send/Recv pairs of the shorter call — the same argument for a p2p pair; it finds a
  slower host NIC that a DP ring of many members dilutes (`_p2p`).
The reference at each step is the lower quartile over peers doing the same work (ranks of the
same PP stage; all DP communicators): the quartile stays clean while fewer than three quarters of
the peers are slow (a whole host of 8 out of 16 stage peers, a whole PP stage's rings).
A rank (or communicator) is flagged when its mean excess over the recent steps is at least
`min_share` of the step time and its mean ratio to the reference at least `min_ratio` (network:
`net_ratio` and `net_abs_ns`, since a slower ring can hide in the step time: VenusTrace's bubbles,
Fig. 7). Thresholds are ours; the catalog's "too small to matter" faults sit below them. A change
that began inside the window (the last `onset_steps`+ steps all above the reference after steps
that were not) is measured over those steps only (`_flag`), so the first check after an onset
can name it.

Naming: a DP ring flagged as slow is narrowed to one member by its chunk counters (Mycroft §5.3,
Table 4 read over time): the member whose RDMA completions lag its posts (② > ③) has a loaded
link (nic_rdma); the member whose posts lag its staged data (① > ②) has a slow NIC — unless its
receiver is the ring's laggard in progress while staging nothing ahead (①≈②), then the receiver's
host side is slow (pcie_host; Mycroft #3's "GPU or PCIe", told apart by normal kernel times).
A PP link is named by its sender: nic_rdma when its typical transfer is slower, host_software
(its proxy, Mycroft #7) when only a few stall. A compute excess carried by one kernel class names
the kernel ("kernel attn") when the class's typical kernel is slower, and the fwd/bwd pass the
long kernels ran in ("bwd pp=2", from the rank's pass intervals) when only its tail is (ARGUS
Table 6: ECC correction shows as tail latency on specific kernels).
Several flagged ranks of one host with one (stage, component) are merged into a host-level
suspect. Suspects are ranked by the excess ns per step they explain; the first is the culprit,
its stage and the next suspect's stage are the top-2 routing. Waiting is never blamed: no
quantity above grows when a rank waits longer.

Cost: every quantity is one `np.bincount` over a flat (step, rank) index — no per-rank or
per-step Python loop; kernel names are classified per distinct name (`columns.codes`, memoized
per window column), kernels get their step by one comparison per step (or one packed-key
searchsorted), the per-class breakdown and the tail test cover only the flagged ranks' PP
stages, PP calls are paired through the 1F1B plan (a dense index, no sort) and string columns
are compared through their codes. Figures: README / `rankwatch bench rca`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnosis.columns import Columns, codes, col, ints
from diagnosis.conclusion import Conclusion, Suspicion
from diagnosis.hang_rca import stalled_steps
from diagnosis.rules.base import Component, Finding, Kind
from diagnosis.rules.pipeline_ops import OpsIndex, pass_times, pp_call_microbatch
from diagnosis.window import Window, assign_steps

Array = np.ndarray
KERNEL_CLASS = (("gemm", "gemm"), ("flash", "attn"), ("attn", "attn"),
                ("elementwise", "elementwise"), ("multi_tensor", "optimizer"))


@dataclass(frozen=True)
class SlowConfig:
    recent: int = 20  # steps examined
    min_share: float = 0.03  # mean excess ≥ this share of the step time
    min_ratio: float = 1.05
    phase_ratio: float = 1.5  # CPU phases: ratio for "host cpu" (≥ 2 phases, each with an
    #                           excess of at least min_share / 3 of the step time)
    net_ratio: float = 1.2
    net_abs_ns: float = 2e6
    class_ratio: float = 1.3  # one kernel class slower by this (median), others < other_ratio
    other_ratio: float = 1.1
    onset_steps: int = 5  # a trailing run of this many steps in excess is measured on its own


CLASSES = ("", "gemm", "attn", "elementwise", "optimizer", "other")


def _classify(name: str) -> int:
    low = name.lower()
    if low.startswith("nccl"):
        return 0
    return CLASSES.index(next((v for k, v in KERNEL_CLASS if k in low), "other"))


def _kclass(names: Array) -> Array:
    """Kernel class code per row (index into CLASSES; 0 = NCCL, excluded): the column is
    factorized once (`codes`, memoized per window column) and only its few distinct names are
    classified."""
    uniq, code = codes(names)
    table = np.asarray([_classify(str(n)) for n in uniq.tolist()], dtype=np.int8)
    return table[code] if table.size else np.zeros(code.size, dtype=np.int8)


@dataclass
class _Ctx:
    w: Window
    cfg: SlowConfig
    steps: Array  # recent complete steps
    step_ns: float
    stage_of: Array  # pp stage per rank
    lo_ns: int = 0  # first start of a recent step (stages)
    _ops_sel: Array | None = None

    def ops_of_kind(self, kind: str) -> Array:
        """Mask over ops rows on a communicator of `kind` (as Window.comm_kind_of_ops == kind,
        through the comm_id codes: no comparison of 10⁶ strings)."""
        uniq, code = codes(col(self.w.get("ops"), "comm_id"))
        kinds = self.w.grid.comm_kind
        return np.asarray([kinds.get(str(c), "") == kind for c in uniq.tolist()],
                          dtype=bool)[code] if uniq.size else np.zeros(code.size, dtype=bool)

    def comm_kinds(self, rows: Array) -> Array:
        """Window.comm_kind_of_ops of some ops rows only (object array)."""
        uniq, code = codes(col(self.w.get("ops"), "comm_id"))
        kinds = self.w.grid.comm_kind
        table = np.asarray([kinds.get(str(c), "") for c in uniq.tolist()] or [""], dtype=object)
        return np.asarray(table[code[rows]])

    def step_index(self, step: Array) -> Array:
        """Position of each step (one of `steps`) in `steps`."""
        lo = int(self.steps[0]) if self.steps.size else 0
        if self.steps.size and int(self.steps[-1]) - lo + 1 == self.steps.size:
            return np.asarray(step - lo)  # consecutive steps: no search
        return np.searchsorted(self.steps, step)

    def ops_recent(self) -> Array:
        """Mask over ops rows: a completed call of a recent step (computed once)."""
        if self._ops_sel is None:
            ops = self.w.get("ops")
            self._ops_sel = _in_steps(ints(ops, "step", -1), self.steps) & (ints(ops, "t_end") > 0)
        return self._ops_sel


def _in_steps(step: Array, steps: Array) -> Array:
    """`np.isin(step, steps)` for int steps through one position lookup (steps ascending)."""
    if steps.size == 0:
        return np.zeros(step.size, dtype=bool)
    lo, hi = int(steps[0]), int(steps[-1])
    if hi - lo + 1 == steps.size:  # consecutive steps: a range test
        return np.asarray((step >= lo) & (step <= hi))
    pos = np.minimum(np.searchsorted(steps, step), steps.size - 1)
    return np.asarray(steps[pos] == step)


def _matrix(ctx: _Ctx, step: Array, rank: Array, value: Array, *,
            aligned: bool) -> Array:
    """float64 [steps, world]: Σ value per (step, rank), nan where a rank has no row; `step` must
    be one of ctx.steps. aligned: one row per recent step; else only the steps that have rows
    (as `window.step_matrix`). One bincount over a flat (step, rank) index — rows are summed in
    their order, as np.add.at does."""
    world = ctx.w.grid.world
    ok = (rank >= 0) & (rank < world)
    flat = ctx.step_index(step[ok]) * world + rank[ok]
    n = ctx.steps.size * world
    acc = np.bincount(flat, weights=value[ok].astype(np.float64), minlength=n)
    seen = np.bincount(flat, minlength=n) > 0
    out = np.where(seen, acc, np.nan).reshape(ctx.steps.size, world)
    return out if aligned else out[seen.reshape(ctx.steps.size, world).any(axis=1)]


def _q25(x: Array) -> Array:
    """Lower quartile along axis 1 ignoring nan (nearest-rank; nan where a row has none):
    a sort instead of np.nanpercentile, which loops in Python over rows."""
    srt = np.sort(x, axis=1)  # nan sorts last
    n = np.sum(~np.isnan(x), axis=1)
    idx = np.maximum((n - 1) // 4, 0)
    out = srt[np.arange(x.shape[0]), np.minimum(idx, max(x.shape[1] - 1, 0))]
    return np.where(n > 0, out, np.nan)


def _ref(m: Array, stage_of: Array) -> Array:
    """Lower quartile over ranks of the same PP stage, per step: [n_steps, world]."""
    out = np.full_like(m, np.nan)
    for s in np.unique(stage_of).tolist():
        cols = np.flatnonzero(stage_of == s)
        if cols.size:
            out[:, cols] = _q25(m[:, cols])[:, None]
    return out


def _flag(ctx: _Ctx, m: Array, ratio_min: float, ref: Array | None = None,
          sparse: bool = False) -> tuple[Array, Array, Array]:
    """(flag, mean excess ns, mean ratio) per rank of a [steps, world] quantity.

    Means over the recent steps, or over the steps since a change that began inside the
    window, so the first check after an onset can name it (same thresholds):
    - a step change: the rank's last `onset_steps` or more steps are all above the reference by
      more than 5 % and at least `onset_steps` steps before them were, on average, less than
      half as far above it (not a rank that is always a little slower);
    - `sparse` (intermittent excess: a slow batch, a stalled callback): at least two steps each
      above the reference by the whole floor (`min_share` of the step time), the first of them
      inside the window; measured from that first one (two such steps are never noise on a
      stage phase: a phase's noise is a small part of the floor)."""
    ref = _ref(m, ctx.stage_of) if ref is None else ref
    with np.errstate(all="ignore"):
        exc = np.nanmean(np.maximum(m - ref, 0.0), axis=0)
        ratio = np.nanmean(m, axis=0) / np.nanmean(ref, axis=0)
    exc, ratio = np.nan_to_num(exc), np.nan_to_num(ratio, nan=1.0)
    floor = ctx.cfg.min_share * ctx.step_ns
    flag = (exc >= floor) & (ratio >= ratio_min)
    n, k = m.shape[0], ctx.cfg.onset_steps
    run = _trailing_run(m, ref)
    late = (run >= k) & (n - run >= k) & ~flag
    if late.any():
        cols = np.flatnonzero(late)
        since = np.arange(n)[:, None] >= (n - run[cols])[None, :]
        with np.errstate(all="ignore"):
            rel = (m[:, cols] - ref[:, cols]) / ref[:, cols]
            before = np.nanmean(np.where(since, np.nan, rel), axis=0)
            after = np.nanmean(np.where(since, rel, np.nan), axis=0)
        change = np.nan_to_num(before, nan=np.inf) <= 0.5 * after  # like its peers before
        _since(flag, exc, ratio, m, ref, cols[change], since[:, change], floor, ratio_min)
    if sparse:
        with np.errstate(invalid="ignore"):
            big = (m - ref) >= floor
        first = np.argmax(big, axis=0)
        cols = np.flatnonzero(~flag & (big.sum(axis=0) >= 2) & (first > 0))
        since = np.arange(n)[:, None] >= first[cols][None, :]
        _since(flag, exc, ratio, m, ref, cols, since, floor, ratio_min)
    return flag, exc, ratio


def _since(flag: Array, exc: Array, ratio: Array, m: Array, ref: Array, cols: Array,
           since: Array, floor: float, ratio_min: float) -> None:
    """Re-measure columns `cols` over their rows `since` (bool [steps, len(cols)]), in place."""
    if cols.size == 0:
        return
    mm = np.where(since, m[:, cols], np.nan)
    rr = np.where(since, ref[:, cols], np.nan)
    with np.errstate(all="ignore"):
        e = np.nan_to_num(np.nanmean(np.maximum(mm - rr, 0.0), axis=0))
        q = np.nan_to_num(np.nanmean(mm, axis=0) / np.nanmean(rr, axis=0), nan=1.0)
    flag[cols] = (e >= floor) & (q >= ratio_min)
    exc[cols], ratio[cols] = e, q


def _trailing_run(m: Array, ref: Array) -> Array:
    """Per column: how many of the last steps, counted back from the newest, are all above the
    reference by more than 5 % (steps without a value end the run)."""
    with np.errstate(all="ignore"):
        above = (m - ref) / ref > 0.05
    below = ~above[::-1]
    return np.asarray(np.where(below.any(axis=0), np.argmax(below, axis=0), m.shape[0]))


def _full_steps(step: Array) -> Array:
    """Steps (ascending) with a stage record from at least 90 % of the ranks that have most."""
    steps, counts = np.unique(step, return_counts=True)
    return steps[counts >= 0.9 * max(int(counts.max()), 1)] if steps.size else steps


def reach_start(stages: Columns, extra_steps: int, config: SlowConfig | None = None
                ) -> int | None:
    """The earliest start among the stage records of the last `recent + extra_steps` full
    steps: the records `analyze` reads lie after it — its steps are the last `recent` full
    ones that no recovered stall overlaps (`_recent`), so with at most `extra_steps` such
    stalled steps among them they are all in this span (the analyst's sweep reads its raw rows
    from here). None when there are no stage records."""
    step = ints(stages, "step")
    if not step.size:
        return None
    keep = _full_steps(step)[-((config or SlowConfig()).recent + extra_steps):]
    return int(ints(stages, "t_start")[np.isin(step, keep)].min())


def _recent(w: Window, cfg: SlowConfig) -> tuple[Array, float]:
    st = w.get("stages")
    step = ints(st, "step")
    full = _full_steps(step)
    # a recovered stall is a transient hang (hang_rca.analyze_past_stall): its steps' excess
    # is that hang again, not a slowdown
    full = full[~np.isin(full, stalled_steps(w))]
    recent = full[-cfg.recent:]
    tot = sum(ints(st, c, 0) for c in ("data_next_wait", "model_fwd_loss", "model_backward",
                                       "callbacks", "optim_step", "step_other"))
    sel = _in_steps(step, full)
    step_ns = float(np.median(np.asarray(tot)[sel])) if sel.any() else 0.0
    return recent, step_ns


def _stage_matrix(ctx: _Ctx, name: str) -> Array:
    st = ctx.w.get("stages")
    sel = _in_steps(ints(st, "step"), ctx.steps)
    return _matrix(ctx, ints(st, "step")[sel], ints(st, "rank")[sel], ints(st, name, 0)[sel],
                   aligned=True)


def analyze(w: Window, now_ns: int, config: SlowConfig | None = None) -> Conclusion | None:
    cfg = config or SlowConfig()
    if not w.get("stages"):
        return None
    recent, step_ns = _recent(w, cfg)
    if recent.size < 3 or step_ns <= 0:
        return None
    st = w.get("stages")
    lo = int(ints(st, "t_start")[_in_steps(ints(st, "step"), recent)].min())
    ctx = _Ctx(w, cfg, recent, step_ns, w.grid.stage, lo)
    sus: list[Suspicion] = []
    sus += _compute(ctx)
    sus += _phases(ctx)
    sus += _launch(ctx)
    sus += _network(ctx)
    sus += _p2p(ctx, {r for x in sus for r in x.ranks})
    sus = _merge_hosts(w, sus)
    if not sus:
        return None
    sus.sort(key=lambda s: -s.score)
    top = sus[0]
    kind = _kind(ctx, top)
    stages = tuple(dict.fromkeys(s.stage for s in sus if s.stage))[:3]
    conf = float(min(0.95, 0.5 + 0.5 * top.score / max(top.score + (sus[1].score if len(sus) > 1
                                                                    else 0.0), 1.0)))
    labels = tuple(dict.fromkeys(("excess_over_peers", *(("host_level",) if len(top.ranks) > 1
                                                        else ()))))
    findings = tuple(Finding(rule=r, culprit_ranks=s.ranks, stage=s.stage, component=s.component,
                             score=s.score, kind=kind, evidence={"excess_ns_per_step": s.score})
                     for s in sus[:4] for r in s.rules)
    return Conclusion(kind, top.ranks, top.stage, top.component, conf, stages=stages,
                      labels=labels, findings=findings,
                      summaries=tuple((s.rules[0], s.summary) for s in sus[:4]),
                      suspects=tuple(sus[1:6]), onset_ns=_onset(ctx, top))


def _kind(ctx: _Ctx, top: Suspicion) -> Kind:
    return "jitter" if "intermittent" in top.summary else "slowdown"


def _onset(ctx: _Ctx, top: Suspicion) -> int | None:
    st = ctx.w.get("stages")
    sel = np.isin(ints(st, "rank"), top.ranks) & _in_steps(ints(st, "step"), ctx.steps)
    return int(ints(st, "t_start")[sel].min()) if sel.any() else None


def _persistence(m: Array, ref: Array) -> Array:
    """Per column: from the first step whose relative excess over the reference is above 5 %,
    the share of the (finite) steps that are above 5 % — 0 where none is. One pass over the
    matrix: the hits after the first are all hits; the steps counted are the finite ones from
    the first hit on (a reverse cumulative count)."""
    with np.errstate(all="ignore"):
        x = (m - ref) / ref
    fin = np.isfinite(x)
    hit = fin & (x > 0.05)
    n_hit = hit.sum(axis=0)
    first = np.argmax(hit, axis=0)
    from_row = np.cumsum(fin[::-1], axis=0)[::-1]  # finite steps at or after each row
    n_from = from_row[first, np.arange(m.shape[1])] if m.shape[0] else np.zeros(m.shape[1])
    with np.errstate(all="ignore"):
        return np.where(n_hit > 0, n_hit / np.maximum(n_from, 1), 0.0)


def _compute(ctx: _Ctx) -> list[Suspicion]:
    k = ctx.w.get("kernels")
    st = ctx.w.get("stages")
    if not k or not st:
        return []
    t_all = ints(k, "t_start")
    cls_all = _kclass(col(k, "kernel"))
    keep = np.flatnonzero((t_all >= ctx.lo_ns) & (cls_all != 0))
    c = cls_all[keep]
    t, r = t_all[keep], col(k, "rank")[keep].astype(np.int64)
    step = _assign_steps(t, r, ints(st, "rank"), ints(st, "step"), ints(st, "t_start"))
    inwin = _in_steps(step, ctx.steps)
    dur = ints(k, "duration")[keep][inwin]
    step, r, c, t = step[inwin], r[inwin], c[inwin], t[inwin]
    if step.size == 0:
        return []
    m = _matrix(ctx, step, r, dur, aligned=False)
    ref = _ref(m, ctx.stage_of)
    flag, exc, ratio = _flag(ctx, m, ctx.cfg.min_ratio, ref)
    flagged = np.flatnonzero(flag).tolist()
    if not flagged:
        return []
    by_class, near = _class_ratios(ctx, step, r, c, dur, t, m.shape[0], flagged)
    pers = _persistence(m[:, flagged], ref[:, flagged])
    out = []
    for i, x in enumerate(flagged):
        stage = "compute"
        meds = {name: float(v[i]) for name, v in by_class.items()}
        slow = [n for n, v in meds.items() if v >= ctx.cfg.class_ratio]
        mode = "persistent" if pers[i] >= 0.6 else "intermittent"
        how = mode
        if len(slow) == 1 and mode == "persistent" and all(
                v < ctx.cfg.other_ratio for n, v in meds.items() if n != slow[0]):
            # one kernel class carries the excess: a shift of its typical kernel (at least half
            # the class's excess) names the kernel (ARGUS Table 6, single-kernel degradation);
            # a near-normal typical kernel with a heavy tail is intermittent spikes (Table 6,
            # ECC correction): the rank's compute, in the pass where the long kernels ran
            q = CLASSES.index(slow[0])
            shift, excess, tail = _kernel_tail(ctx, x, q, *near)
            if shift - 1 >= 0.5 * (excess - 1):  # the typical kernel explains the excess
                stage = f"kernel {slow[0]}"
            else:
                stage = tail or stage
                how = f"intermittent: {slow[0]} kernels' tail, typical kernel {shift:.2f}x"
        out.append(Suspicion((x,), stage, "gpu_compute", float(exc[x]),
                             ("argus.l3", "rankwatch.excess.compute"),
                             f"rank {x}: GPU kernel time {ratio[x]:.2f}x its stage peers' lower "
                             f"quartile, +{exc[x] / 1e6:.1f} ms/step ({how})"))
    return out


def _class_ratios(ctx: _Ctx, step: Array, r: Array, c: Array, dur: Array, t: Array,
                  n_rows: int, flagged: list[int]) -> tuple[dict[str, Array], tuple[Array, ...]]:
    """Per kernel class present in every examined step: the median over steps of each flagged
    rank's class time / its stage peers' lower quartile. Only the flagged ranks' stages are
    tabulated (the reference is per stage); their kernel rows (step, rank, class, duration,
    start) come back for the tail test."""
    stages = np.unique(ctx.stage_of[flagged])
    mine = np.isin(ctx.stage_of[r], stages)
    step, r, c, dur, t = step[mine], r[mine], c[mine], dur[mine], t[mine]
    out: dict[str, Array] = {}
    for q in np.unique(c).tolist():
        sel = c == q
        mc = _matrix(ctx, step[sel], r[sel], dur[sel], aligned=False)
        if mc.shape[0] != n_rows:
            continue
        rc = _ref(mc, np.where(np.isin(ctx.stage_of, stages), ctx.stage_of, -1))
        with np.errstate(all="ignore"):
            out[CLASSES[q]] = np.nanmedian(mc[:, flagged] / rc[:, flagged], axis=0)
    return out, (step, r, c, dur, t)


def _kernel_tail(ctx: _Ctx, x: int, q: int, step: Array, r: Array, c: Array, dur: Array,
                 t: Array) -> tuple[float, float, str | None]:
    """(shift, excess, stage) of rank x's kernels of class q over the steps where their time is
    at least `class_ratio` × the stage's other ranks' mean: shift = median over those steps of
    the median kernel's ratio to the peers' median kernel, excess = median of the time ratio (a
    slower class shifts its typical kernel about as much as its time; a tail leaves the typical
    kernel ≈ 1); stage = "fwd|bwd [mb=m ]pp=s", the pass in which the long kernels ran (time
    beyond twice the pass kind's own median), from the rank's pass intervals (pipeline_ops:
    the ops are the narrow waist, VenusTrace §3.2.1); None when the passes cannot be timed (no
    TP collectives) or no kernel stands out."""
    own = (r == x) & (c == q)
    peers = (c == q) & (r != x) & (ctx.stage_of[r] == ctx.stage_of[x])
    n_peers = max(np.unique(r[peers]).size, 1)
    shifts, ratios = [], []
    for s_ in np.unique(step[own]).tolist():
        mo, mp = own & (step == s_), peers & (step == s_)
        if not mp.any():
            continue
        ratio = float(dur[mo].sum()) / max(float(dur[mp].sum()) / n_peers, 1.0)
        if ratio >= ctx.cfg.class_ratio:
            ratios.append(ratio)
            shifts.append(float(np.median(dur[mo])) / max(float(np.median(dur[mp])), 1.0))
    if not ratios:
        return 1.0, 1.0, None
    shift, excess = float(np.median(shifts)), float(np.median(ratios))
    d = dur[own].astype(np.float64)
    kind, mb = _pass_of(ctx, x, step[own], t[own])
    spike = np.zeros(d.size)
    for p in (0, 1):
        sel = kind == p
        if sel.any():
            med = float(np.median(d[sel]))
            spike[sel] = np.where(d[sel] > 2 * med, d[sel] - med, 0.0)
    if not spike.any():
        return shift, excess, None
    p = int(np.argmax(np.bincount(kind[kind >= 0], weights=spike[kind >= 0], minlength=2)))
    on = (kind == p) & (spike > 0)
    mbs = np.bincount(mb[on], weights=spike[on])
    one = f"mb={int(np.argmax(mbs))} " if mbs.max() >= 0.8 * mbs.sum() and on.sum() > 1 else ""
    return shift, excess, f"{'fwd' if p == 0 else 'bwd'} {one}pp={int(ctx.stage_of[x])}"


def _pass_of(ctx: _Ctx, x: int, step: Array, t: Array) -> tuple[Array, Array]:
    """(pass kind 0 = F / 1 = B, microbatch) of each of rank x's kernels at times `t` in
    `step`; (-1, 0) outside every timed pass."""
    kind = np.full(t.size, -1, dtype=np.int64)
    mb = np.zeros(t.size, dtype=np.int64)
    ops = ctx.w.get("ops")
    grid = ctx.w.grid
    pp_comm = next((cm for cm, mem in grid.comm_members.items()
                    if grid.comm_kind[cm] == "pp" and x in mem), "")
    tp_comm = next((cm for cm, mem in grid.comm_members.items()
                    if grid.comm_kind[cm] == "tp" and x in mem), None)
    if not ops or tp_comm is None or ctx.w.spec.tp_ops_per_pass < 1:
        return kind, mb
    index = OpsIndex(ops, ranks=np.asarray([x]))
    for s_ in np.unique(step).tolist():
        pt = pass_times(ops, ctx.w.spec, int(ctx.stage_of[x]), x, pp_comm, tp_comm, s_, index)
        ok = pt.complete & (pt.ready > 0)
        ki, mi = np.nonzero(ok)
        order = np.argsort(pt.ready[ok], kind="stable")
        ready, end = pt.ready[ok][order], pt.end[ok][order]
        ki, mi = ki[order], mi[order]
        here = np.flatnonzero(step == s_)
        j = np.searchsorted(ready, t[here], side="right") - 1
        inside = (j >= 0) & (t[here] <= end[np.maximum(j, 0)])
        kind[here[inside]] = ki[j[inside]]
        mb[here[inside]] = mi[j[inside]]
    return kind, mb


def _assign_steps(t: Array, rank: Array, st_rank: Array, st_step: Array,
                  st_start: Array) -> Array:
    """`window.assign_steps`, faster: with few steps whose starts increase with the step on
    every rank, one comparison per step against the rank's start (a [rank, step] table); else
    (rank, time) packed into one int64 key and a plain searchsorted, not one over a record
    array (25x faster on 10⁷ kernels). Same result either way."""
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
    pos = np.searchsorted(ks, rank * span + (t - lo), side="right") - 1
    ok = (pos >= 0) & (sr[np.maximum(pos, 0)] == rank)
    return np.where(ok, ss[np.maximum(pos, 0)], -1).astype(np.int64)


PHASES = (("data_next_wait", "data", "data_loader"), ("callbacks", "callbacks", "host_software"),
          ("step_other", "host cpu", "host_software"), ("optim_step", "optim", "gpu_compute"))
CPU_PHASES = ("data_next_wait", "callbacks", "step_other")


def _phases(ctx: _Ctx) -> list[Suspicion]:
    res = {}
    for name, _, _ in PHASES:
        m = _stage_matrix(ctx, name)
        ref = _ref(m, ctx.stage_of)
        flag, exc, ratio = _flag(ctx, m, ctx.cfg.min_ratio, ref, sparse=True)
        res[name] = (flag, exc, ratio, _persistence(m, ref))
    out: list[Suspicion] = []
    # a phase of a few microseconds (callbacks that print a loss line every 10 steps) reaches
    # any ratio on noise: only a phase whose own excess is material is a hit (seen on a real
    # 4-rank DDP job: rank 2's data wait 808x with callbacks 7.8x of peers made "host cpu")
    material = ctx.cfg.min_share / 3 * ctx.step_ns
    cpu_hits = np.sum([(res[n][2] >= ctx.cfg.phase_ratio) & (res[n][1] >= material)
                       for n in CPU_PHASES], axis=0)
    cpu_exc = np.sum([res[n][1] for n in CPU_PHASES], axis=0)
    cpu = (cpu_hits >= 2) & (cpu_exc >= ctx.cfg.min_share * ctx.step_ns)
    for x in np.flatnonzero(cpu).tolist():
        out.append(Suspicion((x,), "host cpu", "host_software", float(cpu_exc[x]),
                             ("argus.l2", "rankwatch.excess.host_cpu"),
                             f"rank {x}: CPU-side phases (data, callbacks, other) "
                             f"{', '.join(f'{res[n][2][x]:.1f}x' for n in CPU_PHASES)} of peers"))
    for name, stage, comp in PHASES:
        flag, exc, ratio, pers = res[name]
        for x in np.flatnonzero(flag & ~cpu).tolist():
            mode = "persistent" if pers[x] >= 0.6 else "intermittent"
            out.append(Suspicion((x,), stage, comp, float(exc[x]),  # type: ignore[arg-type]
                                 ("argus.l2", f"rankwatch.excess.{name}"),
                                 f"rank {x}: {name} {ratio[x]:.2f}x its peers, "
                                 f"+{exc[x] / 1e6:.1f} ms/step ({mode})"))
    return out


def _launch(ctx: _Ctx) -> list[Suspicion]:
    ops = ctx.w.get("ops")
    if not ops:
        return []
    sel = ctx.ops_recent()
    delay = (ints(ops, "t_start") - ints(ops, "t_enqueue"))[sel]
    rank = col(ops, "rank")[sel].astype(np.int64)
    m = _matrix(ctx, ints(ops, "step", -1)[sel], rank, np.maximum(delay, 0), aligned=True)
    flag, exc, _ = _flag(ctx, m, 1.5)
    flagged = np.flatnonzero(flag).tolist()
    if not flagged:
        return []
    rows = np.flatnonzero(sel)
    out = []
    for x in flagged:
        kinds = ctx.comm_kinds(rows[rank == x])
        late = np.maximum(delay[rank == x], 0)
        kk = np.unique(kinds)
        # the kind whose calls carry the most delay
        w = [float(late[kinds == q].sum()) for q in kk.tolist()]
        kind = str(kk[int(np.argmax(w))]) if kk.size else "dp"
        stage = {"dp": "dp_allreduce", "pp": "pp_p2p"}.get(kind, "tp_collectives")
        out.append(Suspicion((x,), stage, "host_software", float(exc[x]),
                             ("mycroft.table3.late_start", "rankwatch.excess.launch"),
                             f"rank {x}: calls start {exc[x] / 1e6:.1f} ms/step later after "
                             f"enqueue than its peers' (proxy/host thread)"))
    return out


def _network(ctx: _Ctx) -> list[Suspicion]:
    ops = ctx.w.get("ops")
    if not ops:
        return []
    sel = ctx.ops_of_kind("dp") & ctx.ops_recent()
    if not sel.any():
        return []
    uniq, code = codes(col(ops, "comm_id"))
    used, ci = np.unique(code[sel], return_inverse=True)
    cu = uniq[used]
    step = ints(ops, "step", -1)[sel]
    dur = (ints(ops, "t_end") - ints(ops, "t_start"))[sel].astype(np.float64)
    # transfer time per (comm, op_seq): the shortest member time; then summed per (step, comm)
    seq = ints(ops, "op_seq")[sel]
    key = ci.astype(np.int64) * (int(seq.max()) + 1) + seq
    uk, kinv = np.unique(key, return_inverse=True)
    mn = np.full(uk.size, np.inf)
    np.minimum.at(mn, kinv, dur)
    first = np.zeros(uk.size, dtype=np.int64)
    first[kinv] = np.arange(kinv.size)
    m = _comm_matrix(ctx, step[first], ci[first], mn, cu.size)
    with np.errstate(all="ignore"):
        ref = _q25(m)[:, None]
        exc = np.nan_to_num(np.nanmean(np.maximum(m - ref, 0), axis=0))
        ratio = np.nan_to_num(np.nanmean(m, axis=0) / np.nanmean(ref), nan=1.0)
    flag = (ratio >= ctx.cfg.net_ratio) & (exc >= ctx.cfg.net_abs_ns)
    out = []
    for c in np.flatnonzero(flag).tolist():
        name = str(cu[c])
        x, comp, why = _ring_member(ctx, name)
        out.append(Suspicion(x, "dp_allreduce", comp, float(exc[c]),
                             ("venustrace.ar_node", "mycroft.table4.temporal"),
                             f"{name}: transfer {ratio[c]:.2f}x the other rings', "
                             f"+{exc[c] / 1e6:.1f} ms/step; {why}"))
    return out


def _p2p(ctx: _Ctx, named: set[int]) -> list[Suspicion]:
    """PP transfers, per link (sender → receiver): the transfer time of one Send/Recv pair is
    the shorter of the two calls' times — the later poster's; the other includes waiting for
    it (the AR node's argument, VenusTrace, applied to a p2p pair) — summed per (step, link).
    Pairs: the n-th Send of a step from a to b with the n-th Recv of that step on b from a. The
    reference is the lower quartile over links of the same (sender stage, receiver stage);
    only hops between hosts are examined (a NIC carries them); thresholds as for the DP rings.
    A flagged link names its sender, whose NIC posts the data (component nic_rdma; stage
    dp_allreduce, the convention for a NIC culprit: the ring its NIC also carries) when its
    typical (median) transfer is slower by `net_ratio`, else its proxy (host_software: a few
    transfers stall, Mycroft #7's intermittent late start), unless
    another suspect already names the rank — a slower GPU or PCIe path of a rank is that
    suspect's to explain. A second host-level fault that no DP ring shows (a ring of many
    members dilutes one slower hop) is found here."""
    ops = ctx.w.get("ops")
    if not ops or "peer" not in ops:
        return []
    rows = np.flatnonzero(ctx.ops_of_kind("pp") & ctx.ops_recent())
    if rows.size == 0:
        return []
    uniq, code = codes(col(ops, "op"))
    send_code = int(np.searchsorted(uniq, "Send"))
    if send_code >= uniq.size or str(uniq[send_code]) != "Send":
        return []
    send = code[rows] == send_code
    world = ctx.w.grid.world
    rank = col(ops, "rank")[rows].astype(np.int64)
    peer = ints(ops, "peer")[rows]
    src, dst = np.where(send, rank, peer), np.where(send, peer, rank)
    hosts = _host_codes(ctx.w)
    ok = (peer >= 0) & (peer < world) & (rank < world)
    ok[ok] = hosts[src[ok]] != hosts[dst[ok]]  # a NIC carries the hop
    rows, send, src, dst, rank = rows[ok], send[ok], src[ok], dst[ok], rank[ok]
    if rows.size == 0:
        return []
    # a PP sender has two links (to the next and to the previous stage): link = 2·src + up,
    # and one call per microbatch on each; the 1F1B plan (pipeline_ops.pp_plan) gives each
    # call's microbatch from its op_seq, so the pair (link, step, microbatch) is a dense index
    up = (ctx.stage_of[dst] > ctx.stage_of[src]).astype(np.int64)
    link = 2 * src + up
    topo = ctx.w.topo
    mb, ok = pp_call_microbatch(topo.pp, topo.microbatches, ctx.stage_of[rank],
                                ints(ops, "op_seq")[rows], send, up == 1)
    if ok.sum() < 0.9 * ok.size:  # not a 1F1B plan: pairs unknown
        return []
    n_mb, n_steps, n_links = max(ctx.w.topo.microbatches, 1), ctx.steps.size, 2 * world
    si = ctx.step_index(ints(ops, "step", -1)[rows])
    pid = (link * n_steps + si) * n_mb + mb
    inside = (ints(ops, "t_end")[rows] - ints(ops, "t_start")[rows]).astype(np.float64)
    t_send = np.full(n_links * n_steps * n_mb, np.nan)
    t_recv = t_send.copy()
    ps, pr = ok & send, ok & ~send
    t_send[pid[ps]] = inside[ps]
    t_recv[pid[pr]] = inside[pr]
    tr = np.minimum(t_send, t_recv).reshape(n_links, n_steps, n_mb)  # nan unless paired
    paired = ~np.isnan(tr)
    m = np.where(paired.any(axis=2), np.nansum(tr, axis=2), np.nan).T  # [steps, links]
    cols = np.flatnonzero(paired.any(axis=(1, 2)))
    dst_of = np.full(n_links, -1, dtype=np.int64)
    dst_of[link] = dst
    ls, ld = cols // 2, dst_of[cols]
    m = m[:, cols]
    ref = _ref(m, ctx.stage_of[ls] * ctx.w.grid.pp + ctx.stage_of[ld])
    with np.errstate(all="ignore"):
        exc = np.nan_to_num(np.nanmean(np.maximum(m - ref, 0.0), axis=0))
        ratio = np.nan_to_num(np.nanmean(m, axis=0) / np.nanmean(ref, axis=0), nan=1.0)
    flag = (ratio >= ctx.cfg.net_ratio) & (exc >= ctx.cfg.net_abs_ns)
    out = []
    hit = np.flatnonzero(flag)
    hit = hit[np.argsort(-exc[hit], kind="stable")]
    cls = ctx.stage_of[ls] * ctx.w.grid.pp + ctx.stage_of[ld]
    for i in hit.tolist():
        x = int(ls[i])
        if x in named:
            continue
        named.add(x)  # one suspect per sender: its most delayed link
        # a slower NIC slows every transfer (the typical one too); a proxy that sometimes
        # starts late (Mycroft #7) leaves the typical transfer alone and stalls a few
        # (over the steps in which the link is slow: an onset inside the window does not
        # dilute it)
        hot = np.flatnonzero(m[:, i] >= ctx.cfg.net_ratio * ref[:, i])
        hot = hot if hot.size else np.arange(m.shape[0])
        like = tr[cols[cls == cls[i]]][:, hot]
        typical = float(np.nanmedian(tr[cols[i]][hot])) / max(float(np.nanmedian(like)), 1.0)
        nic = typical >= ctx.cfg.net_ratio
        out.append(Suspicion((x,), "dp_allreduce", "nic_rdma" if nic else "host_software",
                             float(exc[i]), ("venustrace.ar_node", "rankwatch.excess.p2p"),
                             f"rank {x}: its PP transfers to rank {int(ld[i])} take "
                             f"{ratio[i]:.2f}x those of like links, +{exc[i] / 1e6:.1f} ms/step "
                             "(the later poster's time: no waiting); the typical transfer "
                             f"{typical:.2f}x: " + ("its NIC" if nic else
                                                    "a few stall, its proxy starts them late")))
    return out


def _host_codes(w: Window) -> Array:
    """Host index per rank (equal host names → equal codes)."""
    return codes(np.asarray(w.grid.hosts, dtype=object))[1]


def _comm_matrix(ctx: _Ctx, step: Array, comm: Array, value: Array, n_comms: int) -> Array:
    """float64 [recent steps, comms]: Σ value per (step, communicator), nan where none."""
    flat = ctx.step_index(step) * n_comms + comm
    n = ctx.steps.size * n_comms
    acc = np.bincount(flat, weights=value, minlength=n)
    seen = np.bincount(flat, minlength=n) > 0
    return np.where(seen, acc, np.nan).reshape(ctx.steps.size, n_comms)


def _ring_member(ctx: _Ctx, comm: str) -> tuple[tuple[int, ...], Component | None, str]:
    members = ctx.w.grid.comm_members.get(comm)
    ch = ctx.w.get("chunks")
    if members is None:
        return (), "nic_rdma", "no members"
    late = _late_arriver(ctx, comm, members)
    if late is not None:
        return (late,), "host_software", (
            "it arrives last at the ring's collectives while the others wait in them (Mycroft "
            "Table 3 late start, clock-free: its time inside the op is the shortest) with no "
            "compute excess: its host/proxy starts the op late")
    if not ch:
        return tuple(int(r) for r in members), "nic_rdma", "no chunk counters: the whole ring"
    sel = _is_comm(ch, comm) & (ints(ch, "ts") >= ctx.lo_ns)
    r = ints(ch, "rank")[sel]
    tot = np.maximum(ints(ch, "total_chunks")[sel], 1).astype(np.float64)
    g, t, d = (ints(ch, k)[sel] for k in ("gpu_ready", "rdma_transmitted", "rdma_done"))
    n = members.size
    pos = np.full(ctx.w.grid.world, -1)
    pos[members] = np.arange(n)
    p = pos[r]
    ok = p >= 0
    cnt = np.maximum(np.bincount(p[ok], minlength=n), 1)
    gt = np.bincount(p[ok], weights=((g - t) / tot)[ok], minlength=n) / cnt
    td = np.bincount(p[ok], weights=((t - d) / tot)[ok], minlength=n) / cnt
    prog = np.bincount(p[ok], weights=(d / tot)[ok], minlength=n) / cnt
    i_td = int(np.argmax(td))
    if td[i_td] >= 0.02 and td[i_td] >= 3 * np.median(td) + 1e-9:
        return (int(members[i_td]),), "nic_rdma", "its RDMA completions lag its posts (2 > 3)"
    i_gt = int(np.argmax(gt))
    recv = (i_gt + 1) % n
    if prog[recv] <= prog.min() + 1e-9 and gt[recv] <= np.median(gt):
        return (int(members[recv]),), "pcie_host", (
            "it is the ring's laggard with its posts keeping up with staging (1 = 2): the host "
            "side (PCIe) of the rank, its kernels are normal")
    return (int(members[i_gt]),), "nic_rdma", "its NIC posts lag its staged data (1 > 2)"


def _is_comm(cols: Columns, comm: str) -> Array:
    """Mask of the rows on communicator `comm` (through the column's memoized codes)."""
    uniq, code = codes(col(cols, "comm_id"))
    j = int(np.searchsorted(uniq, comm))
    if j >= uniq.size or str(uniq[j]) != comm:
        return np.zeros(code.size, dtype=bool)
    return np.asarray(code == j)


def _late_arriver(ctx: _Ctx, comm: str, members: Array) -> int | None:
    """The member whose median time inside the ring's recent ops is below half the others'."""
    ops = ctx.w.get("ops")
    sel = _is_comm(ops, comm) & ctx.ops_recent()
    r = ints(ops, "rank")[sel]
    inside = (ints(ops, "t_end") - ints(ops, "t_start"))[sel].astype(np.float64)
    med = np.asarray([np.median(inside[r == m]) if (r == m).any() else np.nan
                      for m in members.tolist()])
    if np.isnan(med).any() or med.size < 2:
        return None
    i = int(np.argmin(med))
    others = np.delete(med, i)
    return int(members[i]) if med[i] < 0.5 * float(np.median(others)) else None


def _merge_hosts(w: Window, sus: list[Suspicion]) -> list[Suspicion]:
    """Flagged ranks of one host with the same (stage, component) → one host-level suspect."""
    hosts = w.grid.hosts
    groups: dict[tuple[str, str | None, str | None], list[Suspicion]] = {}
    for s in sus:
        h = {hosts[r] for r in s.ranks} if s.ranks else {""}
        key = (next(iter(h)) if len(h) == 1 else "", s.stage, s.component)
        groups.setdefault(key, []).append(s)
    out = []
    for (host, stage, comp), lst in groups.items():
        if host and len(lst) >= 2:
            ranks = tuple(sorted({r for s in lst for r in s.ranks}))
            merged: Component | None = "host_software" if comp == "gpu_compute" and \
                stage == "compute" else comp  # type: ignore[assignment]
            out.append(Suspicion(ranks, stage, merged,
                                 float(sum(s.score for s in lst) / len(lst)), lst[0].rules,
                                 f"host {host}: {len(ranks)} ranks alike — " + lst[0].summary))
        else:
            out += lst
    return out
