"""ARGUS L3 (§6.2) over the stored kernel summaries: does the culprit run a kernel whose
duration *distribution* deviates from its stage peers'?

The worker summarizes kernel events per window into (count, p50, p99) clusters (ARGUS §5.2,
`kernel_summaries`). For a culprit named for its GPU compute, every kernel it ran is compared
with the same kernel on the ranks of its PP stage (the ranks doing the same work) by
`diagnosis.rules.argus_l3.detect`: CDFs reconstructed from the summaries, mean W1 distance to
the other ranks, Tukey's IQR fence. A culprit above the fence for some kernel is ARGUS's
independent confirmation — a finding `argus.l3` and a stronger confidence; ARGUS does not name
culprits on its own here (its fence needs at least four ranks and knows no change in time).
"""

from __future__ import annotations

import numpy as np

from diagnosis.columns import codes, col, ints
from diagnosis.conclusion import Suspicion
from diagnosis.rules import argus_l3
from diagnosis.rules.base import Finding
from diagnosis.slow.context import Ctx

MAX_KERNELS = 64  # the kernels with most time on the culprit


def confirm(ctx: Ctx, top: Suspicion) -> Finding | None:
    """The `argus.l3` finding for `top` when one of its kernels is an outlier, else None."""
    ks = ctx.w.get("kernel_summaries")
    if not ks or top.component != "gpu_compute" or not top.ranks:
        return None
    stage = ctx.stage_of
    rank = ints(ks, "rank")
    peers = np.isin(stage[np.clip(rank, 0, stage.size - 1)], stage[list(top.ranks)]) \
        & (rank >= 0) & (rank < stage.size)
    names, code = codes(col(ks, "kernel"))
    count, p50, p99 = ints(ks, "count"), ints(ks, "p50_ns"), ints(ks, "p99_ns")
    ok = peers & (count > 0) & (p50 > 0) & (p99 >= p50)
    ok &= ~np.char.startswith(names.astype(str), "nccl")[code]
    mine = ok & np.isin(rank, top.ranks)
    if not mine.any():
        return None
    weight = np.bincount(code[mine], weights=(count * p50)[mine].astype(np.float64),
                         minlength=names.size)
    hits: dict[str, argus_l3.L3Result] = {}
    for k in np.argsort(-weight)[:MAX_KERNELS].tolist():
        if weight[k] <= 0:
            break
        sel = ok & (code == k)
        res = argus_l3.detect(rank[sel], count[sel], p50[sel], p99[sel])
        if set(res.outliers) & set(top.ranks):
            hits[str(names[k])] = res
    if not hits:
        return None
    worst = max(hits, key=lambda n: float(hits[n].scores.max() / max(hits[n].fence, 1e-9)))
    f = argus_l3.findings(worst, hits[worst])[0]
    return Finding(rule=f.rule, culprit_ranks=tuple(sorted(set(f.culprit_ranks)
                                                           & set(top.ranks))),
                   stage=f"kernel {worst}", component="gpu_compute", score=f.score,
                   kind=f.kind, evidence={**f.evidence, "kernels": sorted(hits)[:16]})
