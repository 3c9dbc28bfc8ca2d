"""The ops → 1F1B mapping: which op of a rank marks which forward/backward pass of which step.

VenusTrace §3.2.1 treats communication calls as the "narrow waist" of computation: a call is
made when the computation before it is done, so op logs tell which pipeline passes completed and
how long they took. This module fixes the mapping the pipeline rules (critical_path.py,
halt_point.py) assume; it matches Megatron's non-interleaved 1F1B and the simulator in ingest/sim.

Schedule (PipeDream-Flush): stage s of P runs min(P − s − 1, M) warm-up forwards, then one
forward / one backward alternately, then the remaining backwards (`stage_order`).

Per pass (kind, m) on stage s, a rank issues, in this order:
1. Recv on its `pp` communicator — from stage s−1 for F (if s > 0), from s+1 for B (if s < P−1);
2. K compute segments, each followed by one TP collective on its `tp` communicator (K =
   `tp_ops_per_pass`, the same for F and B; none when tp = 1);
3. Send on its `pp` communicator — to s+1 for F (if s < P−1), to s−1 for B (if s > 0).
After the last pass: `dp_ops_per_step` collectives on its `dp` communicator (the gradient
AllReduce; 2 with a distributed optimizer's ReduceScatter + AllGather).

op_seq counts per (rank, communicator) from 0 at the first step observed, so with
n_pp(s) = Σ over passes of (#Recv + #Send) on stage s (2M on the first and last stage, 4M in
between), step k's pp ops on stage s are op_seq ∈ [k·n_pp(s), (k+1)·n_pp(s)), its TP ops
[k·2M·K, (k+1)·2M·K) and its DP ops [k·D, (k+1)·D). `step_base` shifts k when op_seq started
counting at a later step; an op's `step` column, when ≥ 0, is used instead of this arithmetic.

A pass is *complete* on a rank when (a) its last TP collective completed, or (b) its Send was
enqueued, or (c) any later op of the step on that rank was enqueued (it moved past the pass).
Passes with no Send (F on the last stage, B on the first) and tp = 1 are only known complete by
(c); that is the ambiguity halt_point.py reports. Pass durations (VenusTrace: "the interval
between the first and the last AllReduce call") need K ≥ 1: duration = end of the last TP op −
ready time, where ready = max(end of the pass's Recv, end of the previous pass on the stage), and
the step's first pass without a Recv starts at its first TP call (its first segment is not seen —
the paper's "except the first layer's computation time"). `tp_wait` is the time the rank spent
inside the pass's TP collectives (t_end − t_start, one host's clock): the TP rank that computes
slowly waits least, because its peers wait for it — the drill-down signal of critical_path.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from diagnosis.columns import Columns, codes, col, ints

Array = np.ndarray
Pass = Literal["F", "B"]


def stage_order(pp: int, microbatches: int, stage: int) -> list[tuple[Pass, int]]:
    """1F1B pass order on one stage: warm-up forwards, steady 1F1B, cool-down backwards."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1}")
    warm = min(pp - stage - 1, microbatches)
    out: list[tuple[Pass, int]] = [("F", i) for i in range(warm)]
    for i in range(microbatches - warm):
        out += [("F", warm + i), ("B", i)]
    out += [("B", i) for i in range(microbatches - warm, microbatches)]
    return out


def pp_plan(pp: int, microbatches: int, stage: int) -> list[tuple[str, Pass, int]]:
    """The (op, pass kind, microbatch) of each pp op of one step on a stage, in op_seq order."""
    out: list[tuple[str, Pass, int]] = []
    for kind, m in stage_order(pp, microbatches, stage):
        src = stage - 1 if kind == "F" else stage + 1
        dst = stage + 1 if kind == "F" else stage - 1
        if 0 <= src < pp:
            out.append(("Recv", kind, m))
        if 0 <= dst < pp:
            out.append(("Send", kind, m))
    return out


def pp_call_microbatch(pp: int, microbatches: int, stage: Array, seq: Array, is_send: Array,
                       forward: Array) -> tuple[Array, Array]:
    """(microbatch, consistent) of PP calls (`stage`: the calling rank's; one outside 0..pp−1
    is not consistent),
    vectorized: a call's place in its stage's plan is its op_seq modulo the plan's length
    (op_seq counts from 0 at a step boundary, see the module docstring); `consistent` where
    the plan's op (Send or Recv) and pass (F: data flows to the next stage, `forward`) match
    the call's own — elsewhere the mapping does not hold (another schedule, op_seq not
    aligned) and the microbatch means nothing."""
    plans = [pp_plan(pp, microbatches, s) for s in range(pp)]
    width = max(max((len(p) for p in plans), default=1), 1)
    plan_send = np.zeros(pp * width, dtype=bool)
    plan_fwd = np.zeros(pp * width, dtype=bool)
    plan_mb = np.zeros(pp * width, dtype=np.int64)
    length = np.ones(pp, dtype=np.int64)
    for s, plan in enumerate(plans):
        length[s] = max(len(plan), 1)
        for i, (op, kind, m) in enumerate(plan):
            j = s * width + i
            plan_send[j], plan_fwd[j], plan_mb[j] = op == "Send", kind == "F", m
    known = (stage >= 0) & (stage < pp)  # a stage the plan has (else: not consistent)
    st = np.where(known, stage, 0)
    at = st * width + seq % length[st]
    ok = known & (plan_send[at] == is_send) & (plan_fwd[at] == forward)
    return plan_mb[at], np.asarray(ok)


@dataclass(frozen=True)
class PipelineSpec:
    """What the mapping needs to know about the job."""

    pp: int
    microbatches: int
    tp_ops_per_pass: int = 0  # K; 0 when tp = 1 or unknown
    dp_ops_per_step: int = 1
    step_base: int = 0


@dataclass(frozen=True)
class PassTimes:
    """Per pass of one rank's step (arrays [2, M], index 0 = F, 1 = B), ns; 0 = not observed."""

    ready: Array  # when the pass could start (its Recv ended / previous pass ended)
    end: Array  # when it was seen complete (0 if not)
    tp_calls: Array  # TP collectives the rank issued for the pass
    complete: Array  # bool
    tp_wait: Array  # ns spent inside the pass's finished TP collectives (one host's clock)


class OpsIndex:
    """Rows of an ops table grouped by (rank, comm_id), built once per table.

    `pass_times` is called per rank; selecting a rank's rows with a mask over the whole table
    converts the object comm_id column to str on every call (O(rows) each, the bulk of a halt
    point at 1k+ ranks). The index sorts the rows once by (rank, comm code) with a stable
    `np.lexsort`; a lookup is then two `searchsorted` calls and returns row indices in their
    original order, so results are identical to the mask.
    """

    def __init__(self, ops: Columns, comm_codes: tuple[Array, Array] | None = None,
                 ranks: Array | None = None) -> None:
        """`comm_codes`: (uniques, code per row) of the comm_id column, if already known;
        `ranks`: index only these ranks' rows (lookups of other ranks find none)."""
        self.uniq, code = codes(col(ops, "comm_id")) if comm_codes is None else comm_codes
        rank = ints(ops, "rank")
        sub = np.arange(rank.size) if ranks is None else np.flatnonzero(np.isin(rank, ranks))
        self.order = sub[np.lexsort((code[sub], rank[sub]))].astype(np.int64)
        self.n_codes = max(int(self.uniq.size), 1)
        self.key = rank[self.order] * self.n_codes + code[self.order]

    def rows(self, rank: int, comm: str) -> Array:
        """Row indices (ascending) of `rank` on communicator `comm`."""
        j = int(np.searchsorted(self.uniq, comm))
        if j >= self.uniq.size or str(self.uniq[j]) != comm:
            return np.zeros(0, dtype=np.int64)
        k = rank * self.n_codes + j
        lo, hi = np.searchsorted(self.key, [k, k + 1])
        return self.order[int(lo):int(hi)]


def _rows(ops: Columns, rank: int, comm: str, *extra: str,
          index: OpsIndex | None = None) -> tuple[Array, ...]:
    sel: Array
    if index is not None:
        sel = index.rows(rank, comm)
    else:
        sel = (ints(ops, "rank") == rank) & (col(ops, "comm_id").astype(str) == comm)
    if extra:
        return tuple(ints(ops, e)[sel] for e in extra)
    return (ints(ops, "op_seq")[sel], ints(ops, "t_enqueue")[sel], ints(ops, "t_end")[sel],
            ints(ops, "step", -1)[sel])


def pass_times(ops: Columns, spec: PipelineSpec, stage: int, rank: int, pp_comm: str,
               tp_comm: str | None, step: int, index: OpsIndex | None = None) -> PassTimes:
    """Observed times of every pass of `step` on one rank (see the module docstring).

    `index` (an `OpsIndex` of `ops`) makes the row selection O(log rows) when called for many
    ranks of the same table; the result is the same without it."""
    m_n = spec.microbatches
    order = stage_order(spec.pp, m_n, stage)
    plan = pp_plan(spec.pp, m_n, stage)
    ready, end, calls = (np.zeros((2, m_n), dtype=np.int64) for _ in range(3))
    k = step - spec.step_base
    seq, enq, t_end, stp = _rows(ops, rank, pp_comm, index=index)
    base = k * len(plan)
    in_step = np.where(stp >= 0, stp == step, (seq >= base) & (seq < base + len(plan)))
    pos = np.where(stp >= 0, seq % max(len(plan), 1), seq - base)
    pp_enq = np.zeros(len(plan), dtype=np.int64)
    pp_end = np.zeros(len(plan), dtype=np.int64)
    pp_enq[pos[in_step]] = enq[in_step]
    pp_end[pos[in_step]] = t_end[in_step]
    last_enq = int(pp_enq.max()) if len(plan) else 0
    kk = spec.tp_ops_per_pass
    tp_first = tp_last_end = np.zeros(len(order), dtype=np.int64)
    wait = np.zeros((2, m_n), dtype=np.int64)
    pass_wait = np.zeros(len(order), dtype=np.int64)
    if kk > 0 and tp_comm is not None:
        tseq, tenq, tend, tstp = _rows(ops, rank, tp_comm, index=index)
        tbase = k * len(order) * kk
        idx = np.where(tstp >= 0, tseq % (len(order) * kk), tseq - tbase)
        ok = np.where(tstp >= 0, tstp == step, (idx >= 0) & (idx < len(order) * kk))
        grid_enq = np.zeros((len(order), kk), dtype=np.int64)
        grid_end = np.zeros((len(order), kk), dtype=np.int64)
        grid_enq[idx[ok] // kk, idx[ok] % kk] = tenq[ok]
        grid_end[idx[ok] // kk, idx[ok] % kk] = tend[ok]
        tstart = _rows(ops, rank, tp_comm, "t_start", index=index)[0]
        inside = np.where(tend[ok] > 0, tend[ok] - tstart[ok], 0)
        np.add.at(pass_wait, idx[ok] // kk, inside)
        tp_first, tp_last_end = grid_enq[:, 0], grid_end[:, -1]
        n_calls = (grid_enq > 0).sum(axis=1)
        last_enq = max(last_enq, int(grid_enq.max()))
    prev_end = 0
    op_i = 0
    for p, (kind, m) in enumerate(order):
        ki = 0 if kind == "F" else 1
        recv_end = 0
        if op_i < len(plan) and plan[op_i][0] == "Recv":
            recv_end = int(pp_end[op_i])
            op_i += 1
        ready[ki, m] = max(recv_end, prev_end) or (int(tp_first[p]) if kk > 0 else 0)
        send_enq = 0
        if op_i < len(plan) and plan[op_i][0] == "Send" and plan[op_i][1:] == (kind, m):
            send_enq = int(pp_enq[op_i])
            op_i += 1
        later = int(pp_enq[op_i:].max()) if op_i < len(plan) else 0
        if kk > 0 and tp_comm is not None:
            calls[ki, m] = n_calls[p]
            wait[ki, m] = pass_wait[p]
            later = max(later, int(tp_first[p + 1:].max()) if p + 1 < len(order) else 0)
        e = int(tp_last_end[p]) if kk > 0 else 0
        end[ki, m] = e or send_enq or later
        prev_end = int(end[ki, m])
    del last_enq
    return PassTimes(ready, end, calls, end > 0, wait)


def durations(times: PassTimes) -> Array:
    """float64 [2, M] pass durations in ns (nan where the pass is not complete or not timed)."""
    ok = times.complete & (times.ready > 0) & (times.end >= times.ready)
    return np.where(ok, (times.end - times.ready).astype(np.float64), np.nan)
