"""Compute: Σ GPU kernel time per (step, rank), NCCL kernels excluded (they spin while
waiting) — the rank's own device time, compared with the ranks of its PP stage (`judge`).

A flagged rank's excess is broken down by kernel class (gemm, attn, elementwise, optimizer):
when one class carries it and the class's typical kernel is slower, the stage names the kernel
("kernel attn"); when the typical kernel is near normal and a tail of long kernels carries it
(ARGUS Table 6: ECC correction shows as tail latency on specific kernels), the stage is the
fwd/bwd pass the long kernels ran in ("bwd pp=2", from the rank's pass intervals, VenusTrace
§3.2.1's narrow waist). This is a per-class comparison of kernel time sums and medians, not
ARGUS's W1 distance over reconstructed CDFs (`diagnosis.rules.argus_l3`, which runs on the
stored kernel summaries: `diagnosis.slow.kernel_dist`).
Kernel names are classified per distinct name (`columns.codes`, memoized per window column).
"""

from __future__ import annotations

import numpy as np

from diagnosis.columns import codes, col, ints
from diagnosis.conclusion import Suspicion
from diagnosis.rules.pipeline_ops import OpsIndex, pass_times
from diagnosis.slow.context import (
    Array,
    Ctx,
    assign_steps_fast,
    in_steps,
    judge,
    matrix,
    persistence,
    reference,
)

KERNEL_CLASS = (("gemm", "gemm"), ("flash", "attn"), ("attn", "attn"),
                ("elementwise", "elementwise"), ("multi_tensor", "optimizer"))


CLASSES = ("", "gemm", "attn", "elementwise", "optimizer", "other")


def _classify(name: str) -> int:
    low = name.lower()
    if low.startswith("nccl"):
        return 0
    return CLASSES.index(next((v for k, v in KERNEL_CLASS if k in low), "other"))


def kernel_classes(names: Array) -> Array:
    """Kernel class code per row (index into CLASSES; 0 = NCCL, excluded): the column is
    factorized once (`codes`, memoized per window column) and only its few distinct names are
    classified."""
    uniq, code = codes(names)
    table = np.asarray([_classify(str(n)) for n in uniq.tolist()], dtype=np.int8)
    return table[code] if table.size else np.zeros(code.size, dtype=np.int8)


def suspects(ctx: Ctx) -> list[Suspicion]:
    k = ctx.w.get("kernels")
    st = ctx.w.get("stages")
    if not k or not st:
        return []
    t_all = ints(k, "t_start")
    cls_all = kernel_classes(col(k, "kernel"))
    keep = np.flatnonzero((t_all >= ctx.lo_ns) & (cls_all != 0))
    c = cls_all[keep]
    t, r = t_all[keep], col(k, "rank")[keep].astype(np.int64)
    step = assign_steps_fast(t, r, ints(st, "rank"), ints(st, "step"), ints(st, "t_start"))
    inwin = in_steps(step, ctx.steps)
    dur = ints(k, "duration")[keep][inwin]
    step, r, c, t = step[inwin], r[inwin], c[inwin], t[inwin]
    if step.size == 0:
        return []
    m = matrix(ctx, step, r, dur, aligned=True)
    ref = reference(m, ctx.stage_of)
    v = judge(ctx, m, ctx.cfg.min_ratio, ref=ref, sparse=True)
    exc, ratio = v.exc, v.ratio
    flagged = np.flatnonzero(v.flag).tolist()
    if not flagged:
        return []
    n_rows = int((~np.isnan(m).all(axis=1)).sum())
    by_class, near = _class_ratios(ctx, step, r, c, dur, t, n_rows, flagged)
    stepped = np.isin(v.how[flagged], ("change", "absorbed"))
    pers = persistence(m[:, flagged], ref[:, flagged], np.where(stepped, v.since[flagged], -1))
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
                             ("rankwatch.excess.compute",),
                             f"rank {x}: GPU kernel time {ratio[x]:.2f}x its stage peers' lower "
                             f"quartile, +{exc[x] / 1e6:.1f} ms/step ({how}; {v.how[x]} "
                             f"{v.z[x]:.1f}σ)", float(v.z[x]), str(v.how[x]),
                             int(ctx.steps[v.since[x]])))
    return out


def _class_ratios(ctx: Ctx, step: Array, r: Array, c: Array, dur: Array, t: Array,
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
        mc = matrix(ctx, step[sel], r[sel], dur[sel], aligned=False)
        if mc.shape[0] != n_rows:
            continue
        rc = reference(mc, np.where(np.isin(ctx.stage_of, stages), ctx.stage_of, -1))
        with np.errstate(all="ignore"):
            out[CLASSES[q]] = np.nanmedian(mc[:, flagged] / rc[:, flagged], axis=0)
    return out, (step, r, c, dur, t)


def _kernel_tail(ctx: Ctx, x: int, q: int, step: Array, r: Array, c: Array, dur: Array,
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


def _pass_of(ctx: Ctx, x: int, step: Array, t: Array) -> tuple[Array, Array]:
    """(pass kind 0 = F / 1 = B, microbatch) of each of rank x's kernels at times `t` in
    `step`; (-1, 0) outside every timed pass."""
    kind = np.full(t.size, -1, dtype=np.int64)
    mb = np.zeros(t.size, dtype=np.int64)
    ops = ctx.w.get("ops")
    grid = ctx.w.grid
    pp_comm = next((cm for cm, mem in grid.comm_members.items()
                    if grid.kind_of(cm) == "pp" and x in mem), "")
    tp_comm = next((cm for cm, mem in grid.comm_members.items()
                    if grid.kind_of(cm) == "tp" and x in mem), None)
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


