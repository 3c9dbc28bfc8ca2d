"""Launch delay: Σ (t_start − t_enqueue) of a rank's calls per step — the NCCL proxy or host
thread starting its calls late (Mycroft Table 3, #7), compared with its stage peers."""

from __future__ import annotations

import numpy as np

from diagnosis.columns import col, ints
from diagnosis.conclusion import Suspicion
from diagnosis.slow.context import Ctx, judge, matrix


def suspects(ctx: Ctx) -> list[Suspicion]:
    ops = ctx.w.get("ops")
    if not ops:
        return []
    sel = ctx.ops_recent()
    delay = (ints(ops, "t_start") - ints(ops, "t_enqueue"))[sel]
    rank = col(ops, "rank")[sel].astype(np.int64)
    m = matrix(ctx, ints(ops, "step", -1)[sel], rank, np.maximum(delay, 0), aligned=True)
    v = judge(ctx, m, 1.5, sparse=True)  # a proxy that sometimes starts late (Mycroft #7)
    flagged = np.flatnonzero(v.flag).tolist()
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
        out.append(Suspicion((x,), stage, "host_software", float(v.exc[x]),
                             ("mycroft.table3.late_start",),
                             f"rank {x}: calls start {v.exc[x] / 1e6:.1f} ms/step later after "
                             f"enqueue than its peers' (proxy/host thread; {v.how[x]} "
                             f"{v.z[x]:.1f}σ)", float(v.z[x]), str(v.how[x]),
                             int(ctx.steps[v.since[x]])))
    return out
