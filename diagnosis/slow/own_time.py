"""Own compute time of the forward and backward passes: a stage's duration minus the time the
rank spent inside communication calls during it.

A rank's `model_backward` stage time contains the waiting inside it: DDP's gradient all-reduce
waits at the end of backward for the slowest replica, a pipeline stage's backward waits in Recv
for the next stage's gradient. Compared as it is, every rank's backward looks as slow as the
culprit's. What the rank spent *itself* is the stage's span with the union of its calls'
[t_start, t_end] intervals inside that span taken out: the culprit arrives last at each call,
so its time inside them is short (the transfer only — VenusTrace's AR node argument, §3.2.2,
Mycroft Fig. 2), while the ranks waiting for it have long calls that are taken out. What is
left is compared with the ranks of the same PP stage (`judge`).

Stage spans are laid end to end from the step's start in the contract's order (data, forward,
backward, callbacks, optimizer; the residual `step_other` last), which is how the tracer's
stage context managers nest in a training loop. Asynchronous calls that overlap compute (DDP's
bucketed all-reduces) are taken out too: that under-counts every rank's own time alike, and the
culprit's least, since its calls are the shortest.

Used for ranks without kernel records (CPU training, no CUPTI): with kernels the device time
itself is measured (`diagnosis.slow.compute`). A rank whose forward, backward and optimizer
are all slower by a like ratio is starved of CPU (a co-located process; "host cpu",
host_software), not slower at one pass.
"""

from __future__ import annotations

import numpy as np

from diagnosis.columns import ints
from diagnosis.conclusion import Suspicion
from diagnosis.rules.base import Component
from diagnosis.slow.context import Array, Ctx, in_steps, judge, matrix, stage_matrix

PASSES = (("model_fwd_loss", "fwd"), ("model_backward", "bwd"))
#: stage columns before each pass in the step's span order
BEFORE = {"model_fwd_loss": ("data_next_wait",),
          "model_backward": ("data_next_wait", "model_fwd_loss")}
ALIKE_RATIO = 1.3  # fwd, bwd and optim all this much slower: CPU starvation


def own_times(ctx: Ctx, name: str) -> Array:
    """float [steps, world]: the `name` stage's duration minus the union of the rank's calls'
    intervals inside its span, per judged step (nan where there is no stage record)."""
    st, ops = ctx.w.get("stages"), ctx.w.get("ops")
    world, n = ctx.w.grid.world, ctx.steps.size
    sel = in_steps(ints(st, "step"), ctx.steps) & (ints(st, "rank") < world)
    rank, step = ints(st, "rank")[sel], ints(st, "step")[sel]
    a = ints(st, "t_start")[sel] + sum((ints(st, c, 0)[sel] for c in BEFORE[name]),
                                       np.zeros(rank.size, np.int64))
    dur = ints(st, name, 0)[sel]
    busy = np.zeros(rank.size)
    known = np.zeros(rank.size, dtype=bool)
    if ops:
        osel = ctx.ops_recent()
        orank, ostep = ints(ops, "rank")[osel], ints(ops, "step", -1)[osel]
        t0, t1 = ints(ops, "t_start")[osel], ints(ops, "t_end")[osel]
        # the stage row of each call: a dense (step, rank) table of row positions
        table = np.full(n * world, -1, dtype=np.int64)
        table[ctx.step_index(step) * world + rank] = np.arange(rank.size)
        ok = (orank >= 0) & (orank < world)
        row = np.full(orank.size, -1, dtype=np.int64)
        row[ok] = table[ctx.step_index(ostep[ok]) * world + orank[ok]]
        hit = row >= 0
        row, t0, t1 = row[hit], t0[hit], t1[hit]
        lo, hi = a[row], a[row] + dur[row]
        cs, ce = np.maximum(t0, lo) - lo, np.minimum(t1, hi) - lo  # relative to the span
        inside = ce > cs
        busy = _union_by(row[inside], cs[inside], ce[inside], rank.size)
        # a step is complete once the rank has a stored call of a later step: the calls of
        # the newest steps may not all be stored yet
        newest = np.full(world, -1, dtype=np.int64)
        np.maximum.at(newest, orank[ok], ostep[ok])
        known = step < newest[rank]
    own = np.where(known, np.maximum(dur - busy, 0.0), np.nan)
    return matrix(ctx, step, rank, own, aligned=True)


def _union_by(group: Array, start: Array, end: Array, n: int) -> Array:
    """Σ length of the union of [start, end) intervals per group (times ≥ 0, relative)."""
    if group.size == 0:
        return np.zeros(n)
    big = int(end.max()) + 1
    s = group.astype(np.int64) * big + start
    e = group.astype(np.int64) * big + end
    order = np.lexsort((s, group))
    s, e, g = s[order], e[order], group[order]
    reach = np.maximum.accumulate(e)
    prev = np.concatenate([[np.iinfo(np.int64).min], reach[:-1]])
    prev = np.where(np.concatenate([[False], g[1:] == g[:-1]]), prev, np.iinfo(np.int64).min)
    length = np.maximum(e - np.maximum(s, prev), 0)
    return np.bincount(g, weights=length.astype(np.float64), minlength=n)


def suspects(ctx: Ctx) -> list[Suspicion]:
    if not ctx.w.get("stages") or not ctx.w.get("ops"):
        return []
    k = ctx.w.get("kernels")
    with_kernels = np.unique(ints(k, "rank")) if k else np.zeros(0, np.int64)
    verdicts = {}
    for name, short in PASSES:
        m = own_times(ctx, name)
        m[:, with_kernels[with_kernels < m.shape[1]]] = np.nan  # their device time is measured
        verdicts[short] = judge(ctx, m, ctx.cfg.min_ratio)
    optim = judge(ctx, stage_matrix(ctx, "optim_step"), 1.0)
    out = []
    for short, v in verdicts.items():
        other = verdicts["bwd" if short == "fwd" else "fwd"]
        for x in np.flatnonzero(v.flag).tolist():
            starved = min(other.ratio[x], optim.ratio[x], v.ratio[x]) >= ALIKE_RATIO
            stage = "host cpu" if starved else f"{short} pp={int(ctx.stage_of[x])}"
            comp: Component = "host_software" if starved else "gpu_compute"
            what = "forward" if short == "fwd" else "backward"
            out.append(Suspicion(
                (x,), stage, comp, float(v.exc[x]), (f"rankwatch.own_time.{short}",),
                f"rank {x}: own {what} time (calls' time inside it taken out) "
                f"{v.ratio[x]:.2f}x its stage peers', +{v.exc[x] / 1e6:.1f} ms/step"
                + (f"; forward {verdicts['fwd'].ratio[x]:.2f}x, backward "
                   f"{verdicts['bwd'].ratio[x]:.2f}x, optimizer {optim.ratio[x]:.2f}x alike: "
                   "its CPU" if starved else "")
                + f" ({v.how[x]} {v.z[x]:.1f}σ)", float(v.z[x]), str(v.how[x]),
                             int(ctx.steps[v.since[x]])))
    return out
