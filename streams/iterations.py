"""Iteration rows: one per (rank, step), from stage records or inferred from the DP gradient
collective, with exposed communication time per group kind. Pure numpy; no per-record loops.

`iteration_rows(stages, ops, ws, we, ...)` returns the rows of the steps that END in the window
[ws, we) (event time). The caller passes every stage record and op of the job with t_start in
[ws − max_step_ns, we), so a step that started up to `max_step_ns` before the window is whole.

Step boundaries, in order of preference:
1. **Stage records** (StageFrontier's contract): the step starts at the record's `t_start` and
   lasts the sum of its six durations (`step_other` is the residual, so that sum is the step
   time). `source = "stages"`, and the stage vector is filled in.
2. **The DP gradient collective** (VenusTrace §4.2: a training iteration ends with the data-parallel
   gradient synchronisation): a completed AllReduce or ReduceScatter on a communicator of kind `dp`
   ends a step. Its step index is the op's `step` column when the producer knew it, else its
   op_seq divided by `grad_collectives_per_step` (1 by default: one bucket per step; set it to the
   number of gradient buckets). The step starts where the rank's previous step ended; for the
   first step seen, at the rank's earliest op start within `max_step_ns` before the end.
   `source = "dp_collective"`, stage durations −1.

Communication accounting: each op of the rank belongs to the step whose [t_start, t_end) holds the
op's t_start. Exposed time per group kind (tp, pp, dp) is the length of the union of the rank's op
intervals of that kind, clipped to the step (overlapping calls are counted once; an op still in
flight counts until the step's end); `compute_ns` is the step time minus the union over all kinds.
A call is "exposed" here in the host-visible sense: the records do not say how much of it
overlapped with kernels on another stream, so a fully overlapped call still counts.

Previews (`preview=True`, streams/derived.py): rows computed from a frame that may start after
some steps began, published before their window closes. Only rows whose bounds are known exactly
are kept: a stage record's row, and an inferred row whose start is the rank's previous gradient
collective (not the estimated first step of a rank); inferred rows of a rank that has stage
records in the frame, or is known from earlier rows to publish them (`staged`), are dropped too,
so a step is never previewed from the other source than the one its window will use, even while
the stages topic is read behind the ops topic. A step missing from a preview comes with its
window's rows. A preview frame may start at the earliest of the ranks' last known step ends
(`prior`, from earlier previews and windows) instead of reaching back a step before: a rank's
next step starts at its known end, so the collective that ended it need not be read again.

Determinism: the rows depend only on the records, not on their arrival order, so recomputing a
window after late records arrive yields the complete rows (streams/derived.py replaces them).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ingest.records import COMM_KIND_CODES, COMM_KIND_OTHER

STAGE_NAMES = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step",
               "step_other")
#: kind codes of the ops (ingest.records: the one communicator-kind decision)
KIND_CODES = COMM_KIND_CODES
OTHER_KIND = COMM_KIND_OTHER
GRAD_OPS = ("AllReduce", "ReduceScatter")
#: the largest `op_bytes` written: 2^62, a float64 exactly and far below int64's end
MAX_BYTES = float(2**62)


@dataclass(frozen=True)
class OpFrame:
    """The ops of one job in a time frame, as arrays (kind: KIND_CODES or OTHER_KIND)."""

    rank: np.ndarray
    kind: np.ndarray
    grad: np.ndarray  # bool: a DP gradient collective (AllReduce/ReduceScatter on a dp comm)
    op_seq: np.ndarray
    step: np.ndarray
    bytes: np.ndarray
    t_start: np.ndarray
    t_end: np.ndarray


def union_length(group: np.ndarray, start: np.ndarray, end: np.ndarray, n_groups: int
                 ) -> np.ndarray:
    """Per group, the length of the union of intervals [start, end) (int64 ns)."""
    if not len(group):
        return np.zeros(n_groups, np.int64)
    order = _group_time_order(group, start)
    return _union_sorted(group[order], start[order], end[order], n_groups)


def _group_time_order(group: np.ndarray, start: np.ndarray) -> np.ndarray:
    """The permutation sorting by (group, start): one argsort of `group << b | start − base`
    when both fit in 63 bits (about half a lexsort's time), else a lexsort."""
    if not len(group):
        return np.zeros(0, np.int64)
    base = int(start.min())
    span = int(start.max()) - base + 1
    if int(group.min()) >= 0 and int(group.max()).bit_length() + span.bit_length() <= 63:
        return np.argsort((group.astype(np.int64) << span.bit_length()) + (start - base))
    return np.lexsort((start, group))


def _union_sorted(g: np.ndarray, s: np.ndarray, e: np.ndarray, n_groups: int) -> np.ndarray:
    """`union_length` of intervals already in (group, start) order."""
    out = np.zeros(n_groups, np.int64)
    if not len(g):
        return out
    base = int(s.min())
    span = int(max(e.max(), s.max()) - base) + 1
    if (int(g.max()) + 1) * span < 1 << 62:
        # running max of end within each group: shift groups apart so one accumulate suffices
        shifted = g.astype(np.int64) * span + (e - base)
        run = np.maximum.accumulate(shifted) - g.astype(np.int64) * span + base
    else:  # times spread too far to shift the groups apart in int64: one accumulate each
        run = np.empty_like(e)
        bounds = np.flatnonzero(np.r_[True, g[1:] != g[:-1], True])
        for a, b in itertools.pairwise(bounds.tolist()):
            run[a:b] = np.maximum.accumulate(e[a:b])
    prev = np.empty_like(run)
    prev[0] = np.iinfo(np.int64).min
    prev[1:] = run[:-1]
    first = np.r_[True, g[1:] != g[:-1]]
    prev[first] = np.iinfo(np.int64).min
    contrib = np.maximum(0, e - np.maximum(s, prev))
    np.add.at(out, g, contrib)
    return out


_SHIFT = 40  # a key is rank << 40 | ns since the frame's base: frames up to ~18 minutes


def _key(rank: np.ndarray, t: np.ndarray, base: int) -> np.ndarray:
    """One sortable int64 per (rank, time) for searchsorted (13x faster than structured keys)."""
    rel = np.clip(t.astype(np.int64) - base, 0, (1 << _SHIFT) - 1)
    return np.asarray((rank.astype(np.int64) << _SHIFT) + rel)


Bounds = tuple[np.ndarray, np.ndarray, np.ndarray]  # (rank ascending, step, end ns): one per rank


def _dp_steps(ops: OpFrame, per_step: int, max_step_ns: int, prior: Bounds | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, step, t_start, t_end, exact) of steps inferred from DP gradient collectives;
    `exact` is False where the start is estimated (a rank's first step in the frame) — unless
    `prior` holds the end of that rank's previous step (then it is that end)."""
    m = ops.grad & (ops.t_end > 0)
    rank, end = ops.rank[m].astype(np.int64), ops.t_end[m]
    step = np.where(ops.step[m] >= 0, ops.step[m], ops.op_seq[m] // per_step)
    if not len(rank):
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, empty, np.zeros(0, bool)
    # several buckets of one step: the step ends with its last one
    order = np.lexsort((end, step, rank))
    rank, step, end = rank[order], step[order], end[order]
    last = np.r_[(rank[1:] != rank[:-1]) | (step[1:] != step[:-1]), True]
    rank, step, end = rank[last], step[last], end[last]
    prev_ok = np.r_[False, (rank[1:] == rank[:-1]) & (step[1:] == step[:-1] + 1)]
    start = np.full(len(rank), -1, np.int64)
    start[1:][prev_ok[1:]] = end[:-1][prev_ok[1:]]
    if prior is not None and len(prior[0]):
        first = np.flatnonzero(start < 0)
        i = np.minimum(np.searchsorted(prior[0], rank[first]), len(prior[0]) - 1)
        hit = ((prior[0][i] == rank[first]) & (prior[1][i] == step[first] - 1)
               & (prior[2][i] <= end[first]))
        start[first[hit]] = prior[2][i[hit]]
    # first step seen on a rank: its earliest op start within max_step_ns before the end
    need = np.flatnonzero(start < 0)
    exact = start >= 0
    if len(need) and len(ops.rank):
        base = int(min(ops.t_start.min(), (end[need] - max_step_ns).min()))
        if int(ops.t_start.max()) - base < 1 << _SHIFT:  # keys hold the times exactly
            keys = np.sort(_key(ops.rank, ops.t_start, base))  # (rank, t_start) order
            at_rank, at_start = keys >> _SHIFT, (keys & ((1 << _SHIFT) - 1)) + base
        else:
            o = np.lexsort((ops.t_start, ops.rank))
            keys = _key(ops.rank[o], ops.t_start[o], base)
            at_rank, at_start = ops.rank[o].astype(np.int64), ops.t_start[o]
        i = np.searchsorted(keys, _key(rank[need], end[need] - max_step_ns, base), "left")
        i_ok = i < len(keys)
        i = np.minimum(i, len(keys) - 1)
        first = at_start[i]
        ok = i_ok & (at_rank[i] == rank[need]) & (first < end[need])
        start[need] = np.where(ok, first, end[need])
    elif len(need):
        start[need] = end[need]
    return rank, step, start, end, exact


def iteration_rows(stages: Mapping[str, np.ndarray], ops: OpFrame, ws: int, we: int, *,
                   max_step_ns: int, grad_collectives_per_step: int = 1,
                   preview: bool = False, report: dict[str, int] | None = None,
                   prior: Bounds | None = None, staged: np.ndarray | None = None
                   ) -> dict[str, np.ndarray]:
    """Iteration columns (the `iterations` contract, without job_id) for steps ending in
    [ws, we); `preview` keeps only exactly known rows. See the module docstring. `report`, when
    given, gets "estimated": how many of the rows have a start estimated (a rank's first step
    in the frame) — 0 means the frame reached back far enough for every row. `prior`: per
    rank, the step and end of its last step known before the frame (previews, module
    docstring): the next step of that rank starts there, exactly, though the gradient
    collective that ended the known step is not in the frame. `staged` (previews): ranks known
    to publish stage records, from earlier previews and windows — none of their steps is
    previewed from its gradient collective, though the frame holds none of their stage records
    yet (the stages topic may be read behind the ops topic)."""
    s_rank = stages["rank"].astype(np.int64)
    s_step = stages["step"].astype(np.int64)
    durations = np.stack([stages[n].astype(np.int64) for n in STAGE_NAMES]) if len(s_rank) \
        else np.zeros((6, 0), np.int64)
    s_t0 = stages["t_start"].astype(np.int64)
    s_t1 = s_t0 + durations.sum(axis=0)
    d_rank, d_step, d_t0, d_t1, d_exact = _dp_steps(ops, grad_collectives_per_step, max_step_ns,
                                                    prior)
    # a stage record wins over an inferred step with the same (rank, step)
    s_key = s_rank * (1 << 32) + s_step
    d_key = d_rank * (1 << 32) + d_step
    d_keep = ~np.isin(d_key, s_key)
    if preview:
        with_stages = s_rank if staged is None else np.r_[s_rank, staged.astype(np.int64)]
        d_keep &= d_exact & ~np.isin(d_rank, with_stages)
    if report is not None:
        d_in = d_keep & (d_t1 >= ws) & (d_t1 < we)
        report["estimated"] = int((d_in & ~d_exact).sum())
    rank = np.r_[s_rank, d_rank[d_keep]]
    step = np.r_[s_step, d_step[d_keep]]
    t0 = np.r_[s_t0, d_t0[d_keep]]
    t1 = np.r_[s_t1, d_t1[d_keep]]
    from_stages = np.r_[np.ones(len(s_rank), bool), np.zeros(int(d_keep.sum()), bool)]
    stage_vec = np.c_[durations, np.full((6, int(d_keep.sum())), -1, np.int64)]
    inside = (t1 >= ws) & (t1 < we)
    if not inside.all():
        rank, step, t0, t1, from_stages = (a[inside] for a in (rank, step, t0, t1, from_stages))
        stage_vec = stage_vec[:, inside]
    _, first = np.unique(rank * (1 << 32) + step, return_index=True)  # one row per (rank, step)
    rank, step, t0, t1, from_stages = (a[first] for a in (rank, step, t0, t1, from_stages))
    stage_vec = stage_vec[:, first]
    cols = _comm_columns(rank, t0, t1, ops)
    out: dict[str, np.ndarray] = {
        "rank": rank.astype(np.int32), "step": step,
        "source": np.where(from_stages, "stages", "dp_collective").astype(object),
        "t_start": t0, "t_end": t1, "step_ns": np.maximum(t1 - t0, 0),
    }
    out.update({n: stage_vec[i] for i, n in enumerate(STAGE_NAMES)})
    out.update(cols)
    return out


def _comm_columns(rank: np.ndarray, t0: np.ndarray, t1: np.ndarray, ops: OpFrame
                  ) -> dict[str, np.ndarray]:
    n = len(rank)
    zero = np.zeros(n, np.int64)
    if not n or not len(ops.rank):
        return {"compute_ns": np.maximum(t1 - t0, 0), "tp_comm_ns": zero, "pp_comm_ns": zero,
                "dp_comm_ns": zero.copy(), "ops": zero.copy(), "op_bytes": zero.copy()}
    # rows sorted by (rank, t0); an op belongs to the last row of its rank starting at or before it
    base = int(min(t0.min(), ops.t_start.min()))
    order = np.lexsort((t0, rank))
    pos = np.searchsorted(_key(rank[order], t0[order], base), _key(ops.rank, ops.t_start, base),
                          "right") - 1
    valid = pos >= 0
    row = order[np.maximum(pos, 0)]
    valid &= (rank[row] == ops.rank) & (ops.t_start < t1[row]) & (ops.t_start >= t0[row])
    row, kind = row[valid], ops.kind[valid].astype(np.int64)
    s = ops.t_start[valid]
    e = np.where(ops.t_end[valid] > 0, np.minimum(ops.t_end[valid], t1[row]), t1[row])
    order = _group_time_order(row, s)  # one sort; each kind's subset stays in order
    row_o, s_o, e_o, kind_o = row[order], s[order], e[order], kind[order]
    out = {}
    for k, c in KIND_CODES.items():
        m = kind_o == c
        out[f"{k}_comm_ns"] = _union_sorted(row_o[m], s_o[m], e_o[m], n)
    exposed = _union_sorted(row_o, s_o, e_o, n)
    out["compute_ns"] = np.maximum(t1 - t0 - exposed, 0)
    done = ops.t_end[valid] > 0
    out["ops"] = np.bincount(row[done], minlength=n).astype(np.int64)
    # float64 sums never wrap; clamped below 2^63 before the cast (the contract allows any
    # int64 bytes, and a cast past int64 gives its minimum)
    out["op_bytes"] = np.minimum(np.bincount(row[done], ops.bytes[valid][done], minlength=n),
                                 MAX_BYTES).astype(np.int64)
    return out
