"""Launch delay: Σ (t_start − t_enqueue) of a rank's calls per step, less the time its own
device was still busy — the NCCL proxy or host thread starting its calls late (Mycroft Table 3,
#7), compared with its stage peers.

A call's `t_start` is when its kernel begins on the device; one enqueued behind the rank's
compute kernels on a stream (a tensor-parallel all-reduce issued right after the matmul it
reduces) starts when they end. That wait is the device's work, not the host's: a rank whose
GPU got slower starts those calls later by exactly its extra compute. Counted whole, it named
a GPU-slow rank's TP all-reduces `tp_collectives` / host_software whenever the rank's kernel
records were read behind its calls (the end-to-end slowdown test under load: rank 3 of a
simulated TP 2 × PP 2 × DP 2 job, its GPU ×1.8). So a call's delay here is `t_start −
max(t_enqueue, latest end of the rank's compute kernels begun at or before t_start, capped at
t_start)`: the time nothing of the rank's own ran before the call did. A kernel still running
when the call started (another stream's) kept the device busy up to the start: counting only
kernels that had ended, a call that began while its rank's long matmul ran was charged the time
since some earlier kernel's end (property test: a rank whose collectives were recorded 30 ms
earlier, waiting longer, was named `tp_collectives` / host_software at 0.51). Mycroft names
the same dependency (§3: a collective's kernels launched but left unscheduled behind other
kernels on the device) and reads its late start (#7) off the proxy's first transmission, which
the records here do not carry.

Where the job has kernel records, a call is judged only once its rank's kernels are stored past
its start (the newest calls wait for their kernels: unknown until then), and a rank without
kernel records in such a job is not judged (its device's queue is unknown). Without kernel
records a call started as it was enqueued has no delay (CPU training: gloo's calls start when
they are made), and one that started later is unknown: the gap may be the host's or the
device's queue, and nothing here tells which. Counted as the host's, a TP × PP job's backward
×4 (the simulated realistic catalog, no kernel records) was named `tp_collectives` /
host_software at 0.77 on the tries whose newest backward times were not known yet, every other
version of it.

Kernel records can have gaps: an injector whose buffer filled drops and counts, and a job may
record kernels on some steps only (the simulator's `kernel_every`). A step of the rank's with
no compute kernel begun before the call would read as a device idle since the previous step,
and every call of such a step as started late: a GPU-slow rank of a simulated 4,096-rank job
with kernels on every second step was named `tp_collectives` / host_software at 0.7. So where
the stage records give the call's step start on its rank (`step_start`), a call before which
no compute kernel of its rank ran in its step (the latest end of those begun before the call
lies before the step's start) is not judged (nan) — unless it started as it was enqueued. A
call that a step's compute really does not precede (a pipeline's first receive) is then not
judged either: that is what the records cannot tell from a gap.
"""

from __future__ import annotations

import numpy as np

from diagnosis.columns import col, ints, search
from diagnosis.conclusion import Suspicion
from diagnosis.slow.compute import kernel_classes
from diagnosis.slow.context import Array, Ctx, in_steps, judge, matrix


def device_idle_delay(ctx: Ctx, rank: Array, t_enqueue: Array, t_start: Array,
                      step_start: Array | None = None) -> Array:
    """Per call, ns from `t_enqueue` (or the latest end of the rank's compute kernels begun at
    or before `t_start`, capped at `t_start`, when later) to `t_start`, ≥ 0; nan where the
    rank's kernels are not stored past `t_start`, or where none of them ran between the call's
    step start (`step_start`, per call; -1 unknown) and `t_start`: a gap in the kernel records.
    Without compute kernel records: 0 for a call started as it was enqueued, else nan (module
    docstring). One stable sort of the kernels' (rank, start) keys, one running maximum of
    their ends, one search per call."""
    gap: Array = np.maximum(t_start - t_enqueue, 0).astype(np.float64)
    unknown: Array = np.where(gap > 0, np.nan, 0.0)
    k = ctx.w.get("kernels")
    if not k or not rank.size:
        return unknown
    ks = ints(k, "t_start")
    ke = ks + ints(k, "duration")
    # a kernel that ended before the earliest call was enqueued holds no call back
    base = int(t_enqueue.min())
    keep = np.flatnonzero((ke >= base) & (col(k, "rank") >= 0))
    keep = keep[kernel_classes(col(k, "kernel"))[keep] != 0]  # NCCL kernels: the calls
    kr = col(k, "rank")[keep].astype(np.int64)
    ks, ke = np.maximum(ks[keep], base), ke[keep]
    if not kr.size:
        return unknown  # no rank's compute kernels stored past these calls
    # per call, the latest end of its rank's kernels begun at or before its start — a kernel
    # still running when the call started kept the device busy up to it (capped there): keys
    # (rank, start) and (rank, end) in one int64 each (40 bits of ns from `base`: 18 minutes,
    # more than a window holds); the running maximum of the end keys in (rank, start) order
    # is, within a rank's run, the latest end so far (a rank's keys exceed every lower rank's)
    span = np.int64(1) << 40
    t_hi = int(max(int(ke.max()), int(t_start.max())))
    if t_hi - base >= span or int(max(kr.max(), rank.max())) >= 1 << 22:
        return unknown
    # stable: timsort merges the runs a window's kernels come in (per rank, in time)
    order = np.argsort((kr << 40) | (ks - base), kind="stable")
    skey = ((kr << 40) | (ks - base))[order]
    ends = np.maximum.accumulate(((kr << 40) | (ke - base))[order])
    ckey = (rank.astype(np.int64) << 40) | np.maximum(t_start - base, 0)
    at = search(skey, ckey, side="right") - 1
    prev = ends[np.maximum(at, 0)]
    same = (at >= 0) & ((prev >> 40) == (ckey >> 40))
    if step_start is not None:  # no kernel of the rank's ran in its step before the call
        gap_in_records = (step_start >= 0) & ~(same & ((prev & (span - 1)) + base >= step_start))
    busy = np.where(same, np.minimum((prev & (span - 1)) + base, t_start),
                    np.iinfo(np.int64).min)
    out: Array = np.maximum(t_start - np.maximum(t_enqueue, busy), 0).astype(np.float64)
    # known once the rank's kernels are stored past the call's start: each rank's newest
    # kernel end is the last of its run's running maximum
    kr_sorted = skey >> 40
    last = np.flatnonzero(np.r_[kr_sorted[1:] != kr_sorted[:-1], True])
    newest = np.full(int(max(kr_sorted[-1], rank.max())) + 1, np.iinfo(np.int64).min, np.int64)
    newest[kr_sorted[last]] = (ends[last] & (span - 1)) + base
    ok = rank >= 0
    known = np.zeros(rank.size, dtype=bool)
    known[ok] = newest[rank[ok]] >= t_start[ok]
    if step_start is not None:
        known &= ~gap_in_records
    out[~known & (gap > 0)] = np.nan  # a call started as it was enqueued waited for nothing
    return out


def _step_starts(ctx: Ctx, rank: Array, step: Array) -> Array:
    """Per call (of a judged step): its step's start on its rank, from the stage records; -1
    where the rank has no stage record of that step."""
    st = ctx.w.get("stages")
    world, n = ctx.w.grid.world, ctx.steps.size
    out = np.full(rank.size, -1, dtype=np.int64)
    if not st or not n:
        return out
    srank, sstep = ints(st, "rank"), ints(st, "step")
    keep = in_steps(sstep, ctx.steps) & (srank >= 0) & (srank < world)
    table = np.full(n * world, -1, dtype=np.int64)
    table[ctx.step_index(sstep[keep]) * world + srank[keep]] = ints(st, "t_start")[keep]
    ok = (rank >= 0) & (rank < world) & in_steps(step, ctx.steps)
    out[ok] = table[ctx.step_index(step[ok]) * world + rank[ok]]
    return out


def suspects(ctx: Ctx) -> list[Suspicion]:
    ops = ctx.w.get("ops")
    if not ops:
        return []
    sel = ctx.ops_recent()
    rank = col(ops, "rank")[sel].astype(np.int64)
    step = ints(ops, "step", -1)[sel]
    delay = device_idle_delay(ctx, rank, ints(ops, "t_enqueue")[sel], ints(ops, "t_start")[sel],
                              _step_starts(ctx, rank, step))
    m = matrix(ctx, step, rank, delay, aligned=True)
    v = judge(ctx, m, 1.5, sparse=True)  # a proxy that sometimes starts late (Mycroft #7)
    flagged = np.flatnonzero(v.flag).tolist()
    if not flagged:
        return []
    rows = np.flatnonzero(sel)
    out = []
    for x in flagged:
        kinds = ctx.comm_kinds(rows[rank == x])
        late = np.nan_to_num(delay[rank == x])
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
