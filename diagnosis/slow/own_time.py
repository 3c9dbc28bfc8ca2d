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

A pipeline is the exception: its schedule interleaves the microbatches' forwards and backwards
(1F1B), so only their combined span — from the end of data loading, forward plus backward long —
is where it looks; where each pass lies inside it is not known. Its point-to-point calls between
stages are therefore given to a pass by their direction (activations go to a later stage: the
forward's Recv from the previous stage and Send to the next; gradients the other way: the
backward's), and taken out wherever they lie in that span. Those sends are asynchronous and the
tracer sees them complete only at its next call or stage boundary (`ingest.torch.tracer`), so a
call counts only until the rank's next call starts: a send posted before more compute does not
take that compute out, while time spent inside the call (a transport slow to accept the data)
or a blocking receive stays out. Laid end to end instead, a 4x slower backward on the last
stage showed as a slower forward as often as not, its backward's own time as a few ms.

Used for ranks without kernel records (CPU training, no CUPTI): with kernels the device time
itself is measured (`diagnosis.slow.compute`).

A rank whose forward, backward and optimizer are all slower by a like ratio — each at least
`ALIKE_RATIO`, the largest within `ALIKE_SPREAD` of the smallest — is starved of CPU (a
co-located process; "host cpu", host_software), not slower at one pass: a process that loses a
share of its core loses it in every phase alike. That inference stands in for the scheduler's
counters and is drawn only for a rank whose judged steps carry none (an older tracer): where
they do, `cpu.refine_steps` judges the rank's CPU from them. Asking only that every ratio
pass 1.3 named a rank of a simulated pipeline × TP job whose backward was 4× slower "host cpu"
whenever its optimizer's ratio crossed 1.31–1.34 (forward 2.0–2.3×, backward 4.0–4.6×: one
pass far slower than the others; its counters showed no wait), and its pass otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diagnosis.columns import Columns, codes, col, ints
from diagnosis.conclusion import Suspicion
from diagnosis.rules.base import Component
from diagnosis.slow.context import (
    Array,
    Ctx,
    by_rank_time,
    in_steps,
    judge,
    matrix,
    stage_matrix,
    step_waits,
)

PASSES = (("model_fwd_loss", "fwd"), ("model_backward", "bwd"))
#: stage columns before each pass in the step's span order
BEFORE = {"model_fwd_loss": ("data_next_wait",),
          "model_backward": ("data_next_wait", "model_fwd_loss")}
ALIKE_RATIO = 1.3  # fwd, bwd and optim all this much slower: CPU starvation …
ALIKE_SPREAD = 1.5  # … by ratios this close (largest / smallest)


def own_times(ctx: Ctx, name: str, ranks: Array | None = None) -> Array:
    """float [steps, world]: the `name` stage's duration minus the union of the rank's calls'
    intervals inside its span, per judged step (nan where there is no stage record). Computed
    once per analysis (`ctx.memo`); callers must not change it. `ranks`: only those columns are
    needed (the others may be nan) — a rank's own time reads only its own stage rows and
    calls, so a few ranks of a large job cost a few ranks' rows, unless every rank's is known
    already."""
    key = f"own_time:{name}"
    if key in ctx.memo:
        return ctx.memo[key]  # type: ignore[no-any-return]
    if ranks is not None:
        return _own_times(ctx, name, np.unique(np.asarray(ranks, dtype=np.int64)))
    ctx.memo[key] = _own_times(ctx, name)
    return ctx.memo[key]  # type: ignore[no-any-return]


def _own_times(ctx: Ctx, name: str, ranks: Array | None = None) -> Array:
    st = ctx.w.get("stages")
    shared = _calls(ctx, ranks)
    sel, rank, step = shared["sel"], shared["rank"], shared["step"]
    a = ints(st, "t_start")[sel] + sum((ints(st, c, 0)[sel] for c in BEFORE[name]),
                                       np.zeros(rank.size, np.int64))
    dur = ints(st, name, 0)[sel]
    busy = np.zeros(rank.size)
    known = np.zeros(rank.size, dtype=bool)
    if "row" in shared:
        row, t0, t1, flow = shared["row"], shared["t0"], shared["t1"], shared["flow"]
        lo, hi = a[row], a[row] + dur[row]
        base = lo
        if flow is not None:  # a pipeline (module docstring)
            blo, bhi = shared["blo"], shared["bhi"]
            between = flow != 0
            mine = flow == (1 if name == "model_fwd_loss" else -1)
            lo = np.where(between, blo, lo)
            hi = np.where(between, np.where(mine, bhi, blo), hi)
            base = blo  # the row's own origin: its span or its block
        cs, ce = np.maximum(t0, lo) - base, np.minimum(t1, hi) - base  # relative to the row
        inside = ce > cs
        busy = _union_by(row[inside], cs[inside], ce[inside], rank.size)
        known = shared["known"]
    own = np.where(known, np.maximum(dur - busy, 0.0), np.nan)
    return matrix(ctx, step, rank, own, aligned=True)


def _calls(ctx: Ctx, ranks: Array | None = None) -> dict[str, Any]:
    """What the forward's and the backward's own times share, computed once per analysis
    (`ctx.memo`): the judged steps' stage rows (`sel`, their `rank` and `step`); with calls,
    each call's stage row (`row`, the calls without one dropped), its interval (`t0`, `t1`: a
    pipeline's point-to-point call cut at the rank's next call), its direction (`flow`, None
    outside a pipeline) and its row's forward + backward block (`blo`, `bhi`); and whether
    each stage row's step is complete (`known`: the rank has a stored call of a later step).
    `ranks` (ascending): those ranks' rows and calls only, not remembered."""
    key = "own_time:calls"
    if ranks is None and key in ctx.memo:
        return ctx.memo[key]  # type: ignore[no-any-return]
    st, ops = ctx.w.get("stages"), ctx.w.get("ops")
    world, n = ctx.w.grid.world, ctx.steps.size
    sel = in_steps(ints(st, "step"), ctx.steps) & (ints(st, "rank") < world)
    if ranks is not None:
        sel &= np.isin(ints(st, "rank"), ranks)
    rank, step = ints(st, "rank")[sel], ints(st, "step")[sel]
    out: dict[str, Any] = {"sel": sel, "rank": rank, "step": step}
    if ops:
        osel = ctx.ops_recent()
        if ranks is not None:
            osel = osel & np.isin(ints(ops, "rank"), ranks)
        orank, ostep = ints(ops, "rank")[osel], ints(ops, "step", -1)[osel]
        t0, t1 = ints(ops, "t_start")[osel], ints(ops, "t_end")[osel]
        # the stage row of each call: a dense (step, rank) table of row positions
        table = np.full(n * world, -1, dtype=np.int64)
        table[ctx.step_index(step) * world + rank] = np.arange(rank.size)
        ok = (orank >= 0) & (orank < world)
        row = np.full(orank.size, -1, dtype=np.int64)
        row[ok] = table[ctx.step_index(ostep[ok]) * world + orank[ok]]
        hit = row >= 0
        flow = _pipeline_direction(ctx, ops, osel)
        if flow is not None:
            t1 = np.where(flow != 0, np.minimum(t1, _next_call(orank, t0, t1)), t1)
            combined = ints(st, "model_fwd_loss", 0)[sel] + ints(st, "model_backward", 0)[sel]
            block_lo = ints(st, "t_start")[sel] + ints(st, "data_next_wait", 0)[sel]
            out["blo"] = block_lo[row[hit]]
            out["bhi"] = out["blo"] + combined[row[hit]]
            flow = flow[hit]
        out.update(row=row[hit], t0=t0[hit], t1=t1[hit], flow=flow)
        # a step is complete once the rank has a stored call of a later step: the calls of
        # the newest steps may not all be stored yet
        newest = np.full(world, -1, dtype=np.int64)
        np.maximum.at(newest, orank[ok], ostep[ok])
        out["known"] = step < newest[rank]
    if ranks is None:
        ctx.memo[key] = out
    return out


def _pipeline_direction(ctx: Ctx, ops: Columns, osel: Array) -> Array | None:
    """Per selected call: +1 a point-to-point call carrying activations (Send to a later stage,
    Recv from an earlier one), -1 one carrying gradients, 0 any other; None when the job's
    ranks form one stage (no pipeline)."""
    if np.unique(ctx.stage_of).size < 2 or "peer" not in ops:
        return None
    names, code = codes(col(ops, "op"))
    labels = names.astype(str)
    send = np.isin(code[osel], np.flatnonzero(labels == "Send"))
    recv = np.isin(code[osel], np.flatnonzero(labels == "Recv"))
    rank, peer = ints(ops, "rank")[osel], ints(ops, "peer", -1)[osel]
    world = ctx.stage_of.size
    ok = (send | recv) & (peer >= 0) & (peer < world) & (rank >= 0) & (rank < world)
    out = np.zeros(rank.size, dtype=np.int64)
    me, other = ctx.stage_of[rank[ok]], ctx.stage_of[peer[ok]]
    later = np.sign(other - me)  # +1: the peer is a later stage
    out[ok] = np.where(send[ok], later, -later)
    return out


def _next_call(rank: Array, t0: Array, t1: Array) -> Array:
    """Per call: the start of the same rank's next call (t1 itself for its last one)."""
    order = by_rank_time(rank, t0)
    nxt = t1.copy()
    same = rank[order][1:] == rank[order][:-1]
    nxt[order[:-1][same]] = t0[order][1:][same]
    return np.asarray(np.maximum(nxt, t0))


def _union_by(group: Array, start: Array, end: Array, n: int) -> Array:
    """Σ length of the union of [start, end) intervals per group (times ≥ 0, relative)."""
    if group.size == 0:
        return np.zeros(n)
    big = int(end.max()) + 1
    s = group.astype(np.int64) * big + start
    e = group.astype(np.int64) * big + end
    order = np.argsort(s, kind="stable")  # s holds the group above the start: lexsort's order
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
    world = ctx.w.grid.world
    measured = np.zeros(world, dtype=bool)  # ranks with kernel records: their device time
    if k:  #                                  is measured (diagnosis.slow.compute)
        kr = ints(k, "rank")
        measured[kr[(kr >= 0) & (kr < world)]] = True
    if measured.all():
        return []  # no rank judged here
    verdicts = {}
    for name, short in PASSES:
        m = own_times(ctx, name).copy()
        m[:, measured[:m.shape[1]]] = np.nan
        verdicts[short] = judge(ctx, m, ctx.cfg.min_ratio)
    optim = judge(ctx, stage_matrix(ctx, "optim_step"), 1.0)
    waits = step_waits(ctx)
    counted = (np.zeros(ctx.w.grid.world, dtype=bool) if waits is None
               else ~np.all(np.isnan(waits[0]), axis=0))
    out = []
    for short, v in verdicts.items():
        other = verdicts["bwd" if short == "fwd" else "fwd"]
        for x in np.flatnonzero(v.flag).tolist():
            starved = not (x < counted.size and counted[x]) and alike(
                (float(v.ratio[x]), float(other.ratio[x]), float(optim.ratio[x])))
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


def alike(ratios: tuple[float, ...]) -> bool:
    """Whether a rank's phases are all slower by a like ratio (module docstring): each at least
    `ALIKE_RATIO`, the largest within `ALIKE_SPREAD` of the smallest; a ratio not known (nan)
    is not alike."""
    if not all(np.isfinite(ratios)):
        return False
    low, high = min(ratios), max(ratios)
    return bool(low >= ALIKE_RATIO and high <= ALIKE_SPREAD * low)
