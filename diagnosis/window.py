"""One job's window of records, as root cause reads it: numpy columns per record kind.

The root-cause agent fills a `Window` from ClickHouse (all ranks, `[start_ns, now_ns]`), the
in-process evaluation from the simulator; rules never know which. Helpers here derive what
several rules need: the job's `Grid`, the ops → 1F1B `PipelineSpec` (K TP collectives per pass
and D DP collectives per step are counted from the ops of a complete step, since the topology
does not say), and the per-(step, rank) matrix of any per-rank quantity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from diagnosis.columns import (
    Columns,
    all_distinct,
    codes,
    col,
    distinct,
    group_key,
    ints,
    last_per_group,
)
from diagnosis.groups import Grid, grid_of
from diagnosis.rules.pipeline_ops import PipelineSpec
from ingest.inflight import superseded
from ingest.records import JobTopology

Array = np.ndarray
KINDS = ("ops", "flows", "chunks", "stages", "kernels", "wr", "beats")


def latest_op_rows(ops: Columns) -> Columns:
    """One row per op: where a tracer published an op twice — once in flight (`t_end = 0`) and
    again when it completed (the host agent does, so a hang is visible while it lasts) — keep the
    row with the largest `t_end`. Raw tables keep both rows; every rule assumes one per op."""
    if not ops or "rank" not in ops or not len(ops["rank"]):
        return ops
    _, comm = codes(col(ops, "comm_id"))
    keys = (ints(ops, "rank"), comm, ints(ops, "op_seq"))
    if all_distinct(*keys):
        return ops  # every op read once (no call also read in flight): nothing to pick
    group, _ = group_key(*keys)
    keep = last_per_group(group, ints(ops, "t_end"))
    if len(keep) == len(group):
        return ops
    keep.sort()
    return {k: np.asarray(v)[keep] for k, v in ops.items()}


def without_superseded_in_flight(ops: Columns, now_ns: int) -> Columns:
    """Drop in-flight rows (`t_end = 0`) of calls that completed by `now_ns`
    (`ingest.inflight.superseded`: a later call on the same communicator completed; for p2p
    calls, on the same communicator, direction and peer).

    `latest_op_rows` pairs an in-flight row with its completed row when both are read; this
    covers the row read alone — the window reads in-flight rows from up to an hour back, and
    the completed row of a call that started before the window is outside it, so a call the
    host agent stored in flight during a stall that recovered stayed "stuck" in every window
    for an hour."""
    if not ops or "rank" not in ops or not len(ops["rank"]):
        return ops
    _, comm = codes(col(ops, "comm_id"))
    comm = comm.astype(np.int64)
    if "peer" in ops and "op" in ops:
        # p2p calls complete in order only per direction and peer: an isend still in flight is
        # not superseded by a later Recv on the same communicator that completed
        peer = ints(ops, "peer", -1)
        names, op = codes(col(ops, "op", ""))  # a read's op column is dictionary-coded
        send = np.isin(op, np.flatnonzero(names == "Send"))
        p2p = (peer >= 0) & (send | np.isin(op, np.flatnonzero(names == "Recv")))
        if p2p.any():
            lane = np.where(p2p, 2 * (peer + 1) + send, 0)
            comm = comm * (2 * int(peer.max()) + 4) + lane
    stale = superseded(ints(ops, "rank"), comm, ints(ops, "op_seq"), ints(ops, "t_end"), now_ns)
    if not stale.any():
        return ops
    keep = ~stale
    return {k: np.asarray(v)[keep] for k, v in ops.items()}


#: the most receives of a pair whose sends were posted before a window began (so are not in it)
ALIGN_MAX = 3


def with_delivered_sends(ops: Columns, start_ns: int, now_ns: int) -> Columns:
    """`ops` with each Send still in flight at `now_ns` whose data its receiver took given that
    Recv's end. The tracer sees an asynchronous send (isend) complete only at its rank's next
    call or stage boundary (`ingest.torch.tracer`): a rank that posts one and then hangs in its
    own compute leaves it in flight for ever, and the hang analysis took that rank for one
    waiting inside its send rather than the one its peers wait for (a real 8-rank pipeline
    hung in a backward was not diagnosed at all).

    Sends and receives between one pair of ranks on one communicator match in order: the n-th
    Send the window holds (posted since `start_ns`) is taken by the (n + e)-th Recv, e the
    receives posted in the window whose sends came before it (0 but for a send crossing its
    start). e is the smallest of 0…`ALIGN_MAX` under which no Recv ended before its Send was
    posted; a pair none fits (clock offsets between hosts larger than a transfer) is left as
    it is — as is a Send whose Recv has not ended. A smaller e than the true one fits only if
    the sender ran a message ahead of its receiver through the whole window (or the receiver's
    clock runs ahead of the sender's by more than that lead). Only the pairs
    with a Send in flight are looked at: one sort of their sends and receives."""
    if not ops or "peer" not in ops or "op" not in ops or not len(ops["rank"]):
        return ops
    t_end = ints(ops, "t_end")
    rank, peer, t0 = ints(ops, "rank"), ints(ops, "peer", -1), ints(ops, "t_start")
    op_names, op_code = codes(col(ops, "op", ""))
    names = op_names.astype(str)
    send_code, recv_code = np.flatnonzero(names == "Send"), np.flatnonzero(names == "Recv")
    rows = np.flatnonzero(np.isin(op_code, np.r_[send_code, recv_code]) & (t0 >= start_ns)
                          & (t0 <= now_ns) & (peer >= 0))
    is_send = np.isin(op_code[rows], send_code)
    todo = is_send & ((t_end[rows] == 0) | (t_end[rows] > now_ns))
    if not todo.any():
        return ops
    rank, peer = rank[rows], peer[rows]
    _, comm = codes(col(ops, "comm_id")[rows])
    span = int(max(int(rank.max()), int(peer.max()))) + 2
    c64 = comm.astype(np.int64)
    # (comm, sender, receiver) of a Send, and of a Recv
    pair = np.where(is_send, (c64 * span + (rank + 1)) * span + (peer + 1),
                    (c64 * span + (peer + 1)) * span + (rank + 1))
    wanted = np.unique(pair[todo])
    mine = np.isin(pair, wanted)
    s_rows = rows[mine & is_send]
    r_rows = rows[mine & ~is_send]
    if r_rows.size == 0:
        return ops
    pair_of = np.zeros(len(t_end), dtype=np.int64)
    pair_of[rows] = pair
    pair = pair_of
    s_rows = s_rows[np.lexsort((t0[s_rows], pair[s_rows]))]
    r_rows = r_rows[np.lexsort((t0[r_rows], pair[r_rows]))]
    s_pair = np.searchsorted(wanted, pair[s_rows])
    r_pair = np.searchsorted(wanted, pair[r_rows])
    r_first = np.searchsorted(r_pair, np.arange(wanted.size), side="left")
    r_count = np.bincount(r_pair, minlength=wanted.size)
    s_first = np.searchsorted(s_pair, np.arange(wanted.size), side="left")
    s_ord = np.arange(s_rows.size) - s_first[s_pair]  # n-th Send of its pair (from 0)
    r_done = (t_end[r_rows] > 0) & (t_end[r_rows] <= now_ns)
    shift = np.full(wanted.size, -1, dtype=np.int64)
    for e in range(ALIGN_MAX + 1):
        j = s_ord + e
        has = j < r_count[s_pair]
        rr = np.where(has, r_first[s_pair] + j, 0)
        bad = has & r_done[rr] & (t_end[r_rows[rr]] < t0[s_rows])
        fits = (np.bincount(s_pair[bad], minlength=wanted.size) == 0) & (shift < 0)
        shift[fits] = e
    j = s_ord + shift[s_pair]
    flying = (t_end[s_rows] == 0) | (t_end[s_rows] > now_ns)
    ok = flying & (shift[s_pair] >= 0) & (j < r_count[s_pair])
    rr = np.where(ok, r_first[s_pair] + j, 0)
    ok &= r_done[rr]
    if not ok.any():
        return ops
    out = dict(ops)
    end = t_end.copy()
    end[s_rows[ok]] = t_end[r_rows[rr[ok]]]
    out["t_end"] = end
    return out


@dataclass
class Window:
    topo: JobTopology
    tables: Mapping[str, Columns] = field(default_factory=dict)
    start_ns: int = 0
    now_ns: int = 0

    def get(self, kind: str) -> Columns:
        t = self.tables.get(kind)
        return t if t is not None and "rank" in t and len(t["rank"]) else {}

    @cached_property
    def grid(self) -> Grid:
        return grid_of(self.topo)

    @cached_property
    def comm_kind_of_ops(self) -> Array:
        """Per ops row: the kind of its communicator ("" if unknown)."""
        ops = self.get("ops")
        if not ops:
            return np.zeros(0, dtype=object)
        uniq, inv = codes(col(ops, "comm_id"))
        kinds = self.grid.kinds_of(uniq)
        return np.asarray(kinds[inv], dtype=object)

    @cached_property
    def spec(self) -> PipelineSpec:
        ops = self.get("ops")
        m = self.topo.microbatches
        k, d, base = 0, 1, 0
        if ops:
            step, rank = ints(ops, "step", -1), ints(ops, "rank")
            known = step[step >= 0]
            if known.size:
                base = int(known.min())
                # a complete step: the median step of the window
                s = int(np.median(_distinct_ints(known)))
                # the first rank's rows of that step only (kinds per distinct comm_id)
                mine = np.flatnonzero((rank == int(rank[0])) & (step == s))
                uniq, inv = codes(col(ops, "comm_id"))
                kinds = self.grid.kinds_of(uniq)
                kind = kinds[inv[mine]]
                done = ints(ops, "t_end")[mine] > 0
                k = int(((kind == "tp") & done).sum()) // max(2 * m, 1)
                d = max(int(((kind == "dp") & done).sum()), 1)
        return PipelineSpec(pp=self.topo.pp, microbatches=m, tp_ops_per_pass=k,
                            dp_ops_per_step=d, step_base=base)

    @cached_property
    def step_ns(self) -> float:
        """Median step time over the window (from stages), 0 when unknown."""
        st = self.get("stages")
        if not st:
            return 0.0
        tot = sum(ints(st, c, 0) for c in ("data_next_wait", "model_fwd_loss", "model_backward",
                                           "callbacks", "optim_step", "step_other"))
        return float(np.median(np.asarray(tot)))

    @cached_property
    def _gap_memo(self) -> dict[int, tuple[int, int] | None]:
        return {}

    def completion_gap(self, min_ns: int) -> tuple[int, int] | None:
        """(a, b): the longest gap between consecutive op completions (`t_end`) in the window
        if it is at least `min_ns` long, else None (the hang and slowdown analyses both ask: a
        recovered stall). O(n), no sort of the completions: with bins of width h = min_ns / 2,
        such a gap contains a whole empty bin, so only the completions in the bins next to runs
        of empty bins can bound one; the gap across a run is (first completion after it) −
        (last before it). Cached per `min_ns`."""
        memo = self._gap_memo
        if min_ns not in memo:
            memo[min_ns] = self._completion_gap(min_ns)
        return memo[min_ns]

    def _completion_gap(self, min_ns: int) -> tuple[int, int] | None:
        ops = self.get("ops")
        if not ops or min_ns < 2:
            return None
        ends = ints(ops, "t_end")
        ends = ends[ends > 0]
        if ends.size < 2:
            return None
        h = min_ns // 2
        t0 = int(ends.min())
        b = (ends - t0) // h
        counts = np.bincount(b)
        empty = counts == 0
        if not empty.any():
            return None
        # bins just before and just after a run of empty bins; the completions in them
        edge = np.zeros(counts.size, dtype=bool)
        edge[:-1] |= empty[1:] & ~empty[:-1]
        edge[1:] |= empty[:-1] & ~empty[1:]
        sel = edge[b]
        x, xb = ends[sel], b[sel]
        order = np.argsort(x, kind="stable")
        x, xb = x[order], xb[order]
        # consecutive edge completions straddle one run when every bin between them is empty
        n_empty = np.concatenate([[0], np.cumsum(empty)])
        between = xb[1:] - xb[:-1] - 1
        across = (between > 0) & (n_empty[xb[1:]] - n_empty[xb[:-1] + 1] == between)
        gaps = np.where(across, x[1:] - x[:-1], -1)
        if gaps.size == 0 or int(gaps.max()) < min_ns:
            return None
        i = int(np.argmax(gaps))
        return int(x[i]), int(x[i + 1])

    @cached_property
    def _last_seen_memo(self) -> dict[int, Array]:
        return {}

    def last_seen(self, now_ns: int) -> Array:
        """int64 [world]: each rank's newest record time at or before `now_ns` (see
        `last_record_ns`), computed once per `now_ns` for all the rules that ask; read-only."""
        hit = self._last_seen_memo.get(now_ns)
        if hit is None:
            hit = last_record_ns(self.get("ops"), self.get("beats"), self.grid.world, now_ns)
            hit.setflags(write=False)
            self._last_seen_memo[now_ns] = hit
        return hit

    def beat_interval_ns(self) -> float:
        b = self.get("beats")
        if not b:
            return 1e9
        r, ts = ints(b, "rank"), ints(b, "ts")
        sel = r == r[0]
        t = distinct(ts[sel])
        return float(np.median(np.diff(t))) if t.size > 2 else 1e9


def _distinct_ints(x: Array) -> Array:
    """np.unique(x) of an int array; by counting when its range is small (steps: a few
    hundred values over 10⁶ rows), which needs no sort."""
    lo, hi = int(x.min()), int(x.max())
    if hi - lo < 4 * x.size + 1024:
        return np.flatnonzero(np.bincount(x - lo, minlength=hi - lo + 1)) + lo
    return distinct(x)


def last_record_ns(ops: Columns, beats: Columns, world: int, now_ns: int) -> Array:
    """int64 [world]: per rank, the newest time at or before `now_ns` among its ops' t_enqueue,
    t_start, t_end and its beats' ts (0 for a rank with none; ranks ≥ world are ignored).

    Rows after `now_ns` (or of ranks ≥ world) add a 0 to rank 0 instead of being selected out,
    so each table is one unmasked `np.maximum.at` (its fast path, ~10× the masked one); the
    maxima start at 0, so those zeros change nothing."""
    seen = np.zeros(world, dtype=np.int64)
    for t, names in ((ops, ("t_enqueue", "t_start", "t_end")), (beats, ("ts",))):
        if not t:
            continue
        r = ints(t, "rank")
        ts = ints(t, names[0], 0)
        for c in names[1:]:
            ts = np.maximum(ts, ints(t, c, 0))
        ok = (ts <= now_ns) & (r < world)
        np.maximum.at(seen, np.where(ok, r, 0), np.where(ok, ts, 0))
    return seen


def step_matrix(step: Array, rank: Array, value: Array, world: int,
                how: str = "sum") -> tuple[Array, Array]:
    """(steps ascending, float64 [n_steps, world]) of `value` per (step, rank); nan where a
    rank has no row for a step; rows with the same key are summed (or maxed)."""
    steps, si = np.unique(step, return_inverse=True)
    out = np.full((steps.size, world), np.nan)
    ok = (rank >= 0) & (rank < world)
    if how == "sum":
        acc = np.zeros((steps.size, world))
        seen = np.zeros((steps.size, world), dtype=bool)
        np.add.at(acc, (si[ok], rank[ok]), value[ok].astype(np.float64))
        seen[si[ok], rank[ok]] = True
        out = np.where(seen, acc, np.nan)
    else:
        acc = np.full((steps.size, world), -np.inf)
        np.maximum.at(acc, (si[ok], rank[ok]), value[ok].astype(np.float64))
        out = np.where(np.isfinite(acc), acc, np.nan)
    return steps, out


def assign_steps(t: Array, rank: Array, st_rank: Array, st_step: Array,
                 st_start: Array) -> Array:
    """Step of each (t, rank) event from the stages' per-rank step starts (-1 before the first)."""
    out = np.full(t.size, -1, dtype=np.int64)
    if st_rank.size == 0 or t.size == 0:
        return out
    order = np.lexsort((st_start, st_rank))
    sr, ss, s0 = st_rank[order], st_step[order], st_start[order]
    # search per rank with one combined key: rank * 2^62-safe offset is too big for ns; use
    # searchsorted on (rank, time) via a structured sort
    key_st = np.rec.fromarrays([sr, s0])
    key_ev = np.rec.fromarrays([rank.astype(sr.dtype), t.astype(s0.dtype)])
    pos = np.searchsorted(key_st, key_ev, side="right") - 1
    ok = (pos >= 0) & (sr[np.maximum(pos, 0)] == rank)
    out[ok] = ss[pos[ok]]
    return out


def beats_current(beats: Columns, at_ns: int, gap_ns: int,
                  hosts: Sequence[str] | None = None) -> bool:
    """Whether a job's beats are stored up to about `at_ns`: on every host (`hosts`: each
    rank's host; without it the job is one host), the newest beat at or before `at_ns` is at
    most `gap_ns` older, or every rank of that host that beat has ended (its last beat is an
    exit beat: nothing more is coming). Host agents beat every second while their ranks live,
    hung or not, so a host whose beats stop for every rank at once is one the store has not
    received yet — a partition without a leader while a broker fails over, whose backlog then
    arrives as a prefix of each host's batches, one host a batch or two ahead of another — or a
    host that went as a whole (the wait is bounded by the caller). True for a job without beats
    (nothing to wait for)."""
    if not beats or "ts" not in beats:
        return True
    ts = ints(beats, "ts")
    sel = ts <= at_ns
    if not sel.any():
        return True
    rank = ints(beats, "rank")[sel] if "rank" in beats else np.zeros(int(sel.sum()), np.int64)
    ts = ts[sel]
    if hosts is not None and len(hosts) and rank.size:
        # one code per rank from the topology's hosts (world-sized), then one lookup per beat;
        # ranks outside the topology share code 0
        _, of_rank = np.unique(np.asarray(hosts, dtype=str), return_inverse=True)
        ok = (rank >= 0) & (rank < of_rank.size)
        host_code = np.zeros(rank.size, dtype=np.int64)
        host_code[ok] = of_rank[rank[ok]] + 1
    else:
        host_code = np.zeros(rank.size, dtype=np.int64)
    newest = np.full(int(host_code.max()) + 1, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(newest, host_code, ts)
    behind = newest < at_ns - gap_ns
    if not behind.any():
        return True
    if "exited" not in beats or "rank" not in beats:
        return False
    exited = ints(beats, "exited")[sel]
    ended = np.isin(rank, np.unique(rank[exited != 0]))
    # a host is done when each of its ranks that beat has ended
    live = np.bincount(host_code, weights=(~ended).astype(np.float64), minlength=behind.size)
    return bool(np.all(live[behind] == 0))


def announced_ops_stored(ops: Columns, beats: Columns, at_ns: int) -> bool:
    """Whether every op the ranks' beats up to `at_ns` announce is among the stored `ops`: per
    (rank, communicator), the newest `last_op_seq` of its beats is at most the highest op_seq
    stored (in flight or completed). The host agent stamps each beat with what it has drained
    from the rank's ring, and publishes the op records of the same drain on another topic, so
    a window read at a beat's time may hold the beat before those records: a rank whose newest
    calls are not stored yet looks as if it never made them. True without counters in the
    beats (nothing announced)."""
    if not beats or "last_op_seq" not in beats:
        return True
    seq, ts = ints(beats, "last_op_seq"), ints(beats, "ts")
    comm = np.asarray(col(beats, "comm_id")).astype(str) if "comm_id" in beats else None
    if comm is None:
        return True
    sel = (ts <= at_ns) & (seq >= 0) & (comm != "") & (ints(beats, "rank") >= 0)
    if not sel.any():
        return True
    b_rank, b_comm, b_seq = ints(beats, "rank")[sel], comm[sel], seq[sel]
    if ops and "op_seq" in ops:
        o_rank, o_seq = ints(ops, "rank"), ints(ops, "op_seq")
        o_comm = np.asarray(col(ops, "comm_id")).astype(str)
    else:
        o_rank, o_seq, o_comm = (np.zeros(0, np.int64), np.zeros(0, np.int64),
                                 np.zeros(0, dtype=str))
    names, code = np.unique(np.concatenate([b_comm, o_comm]), return_inverse=True)
    n = names.size
    top = int(max(b_rank.max(), o_rank.max(initial=0))) + 1
    announced = np.full(top * n, -1, dtype=np.int64)
    np.maximum.at(announced, b_rank * n + code[: b_rank.size], b_seq)
    stored = np.full(top * n, -1, dtype=np.int64)
    ok = o_rank >= 0
    np.maximum.at(stored, (o_rank * n + code[b_rank.size:])[ok], o_seq[ok])
    return bool((announced <= stored).all())
