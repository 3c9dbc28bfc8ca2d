"""AcquireGroupLastLog (Mycroft Alg. 2, line 2): each rank's last op per communicator at a time.

`last_logs(ops, now_ns, stuck_ns)` keeps, per (rank, comm_id), the row with the largest op_seq
among the calls the rank had *reached* at `now_ns` (`reached`), and marks it *stuck* when it is
in flight (t_end = 0, or ends after now) and was enqueued more than `stuck_ns` before now.
`posted_p2p` lists every Send/Recv in flight, not only last logs, for the waits-for test of
p2p pairs (waits_for.py).

Reached: enqueued by `now_ns`, and not a call whose kernel was still waiting to start more than
`stuck_ns` after its enqueue. Only rows written after `now_ns` — a stall analysed after it
recovered (hang_rca.analyze_past_stall) — can show that; the hung rank's host had posted the
call with its peers', but its GPU stream never got to it, so for CheckMinOp it never reached
the op its peers wait in. The `stuck_ns` margin keeps ms of clock skew from counting.

Cost (10⁶ ops rows): comm_id and op are factorized once per window (`columns.codes`), the
string tests run on their distinct values, and the last logs are one sort on a packed
(rank, comm, op_seq) key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnosis.columns import Columns, codes, col, ints, last_per_group

Array = np.ndarray
P2P = ("Send", "Recv")


@dataclass(frozen=True)
class LastLogs:
    """One row per (rank, comm_id): the rank's last op there."""

    rank: Array
    comm_id: Array
    op_seq: Array
    op: Array
    peer: Array
    t_enqueue: Array
    t_end: Array
    stuck: Array  # bool


def reached(ops: Columns, now_ns: int, stuck_ns: int) -> Array:
    """Row mask: the rank had reached the op at `now_ns` — enqueued by then, and not an op whose
    kernel was still waiting to start more than `stuck_ns` after its enqueue (t_start > now):
    the host posted the call, but the GPU stream never got to it (its previous kernel hangs).

    The second case is only visible when the rows were written after `now_ns` — a stall analysed
    after it recovered (hang_rca.analyze_past_stall) — and stays clear of clock skew (ms) by the
    `stuck_ns` margin. Its rank has not reached the op, as in Alg. 2's CheckMinOp; treating the
    call as reached would put the rank beside its waiting peers in the same op and hand the
    decision to the chunk counters, where the peer that staged data for it looks like a NIC that
    does not transmit."""
    enq = ints(ops, "t_enqueue")
    pending = (ints(ops, "t_start", 0) > now_ns) & (now_ns - enq > stuck_ns)
    return np.asarray((enq <= now_ns) & ~pending, dtype=bool)


def last_logs(ops: Columns, now_ns: int, stuck_ns: int) -> LastLogs:
    """AcquireGroupLastLog for every communicator at once: per (rank, comm_id) the last op the
    rank had reached at `now_ns` (`reached`). `stuck`: in flight for more than `stuck_ns`, or
    in flight in a collective (same communicator and op_seq) another rank is stuck in."""
    enq = ints(ops, "t_enqueue")
    ok = np.flatnonzero(reached(ops, now_ns, stuck_ns))
    uniq, ccode = codes(col(ops, "comm_id"))
    ccode = ccode[ok]
    # one packed (rank, comm) key and one stable sort — the same rows, in the same order, as
    # group_key + last_per_group
    rank = ints(ops, "rank")[ok]
    key = (rank - (int(rank.min()) if ok.size else 0)) * max(int(uniq.size), 1) + ccode
    last = last_per_group(key, ints(ops, "op_seq")[ok]) if ok.size else ok
    rows = ok[last]
    t_end = ints(ops, "t_end")[rows]
    t_end = np.where(t_end > now_ns, 0, t_end)
    names = op_names(ops, rows)
    flight = t_end == 0
    stuck = flight & (now_ns - enq[rows] > stuck_ns)
    late = flight & ~stuck
    if stuck.any() and late.any():
        # a rank that joined a collective its peers are stuck in, less than `stuck_ns` ago,
        # waits with them: it is not a rank that "never reached" anything (a sink)
        coll = ~np.isin(names, P2P)
        op_key = ccode[last].astype(np.int64) * (int(ints(ops, "op_seq").max()) + 1) \
            + ints(ops, "op_seq")[rows]
        stuck |= late & coll & np.isin(op_key, op_key[stuck & coll])
    return LastLogs(
        rank=ints(ops, "rank")[rows], comm_id=uniq[ccode[last]].astype(str),
        op_seq=ints(ops, "op_seq")[rows], op=names,
        peer=ints(ops, "peer", -1)[rows], t_enqueue=enq[rows], t_end=t_end, stuck=stuck,
    )


def op_names(ops: Columns, rows: Array) -> Array:
    """The op column's `rows` as str (the column is factorized once, then expanded)."""
    uniq, code = codes(col(ops, "op", "AllReduce"))
    return np.asarray(uniq.astype(str)[code[rows]])


def is_p2p(ops: Columns) -> Array:
    """Row mask of Send/Recv ops (the string test runs on the distinct op names only)."""
    uniq, code = codes(col(ops, "op", "AllReduce"))
    return np.asarray(np.isin(uniq.astype(str), P2P)[code], dtype=bool)


def posted_p2p(ops: Columns, now_ns: int,
               stuck_ns: int | None = None) -> set[tuple[int, str, int, str]]:
    """(rank, comm_id, peer, op) of every Send/Recv in flight at `now_ns` — not only last logs:
    a rank may have posted a Send and then a Recv that both hang (a dead link both ways).
    With `stuck_ns`, a call whose kernel had not started (`reached`) is not posted: its peer's
    matching call waits for it, as for a missing call."""
    t_end, enq = ints(ops, "t_end"), ints(ops, "t_enqueue")
    on = reached(ops, now_ns, stuck_ns) if stuck_ns is not None else enq <= now_ns
    sel = np.flatnonzero(is_p2p(ops) & on & ((t_end == 0) | (t_end > now_ns)))
    op = col(ops, "op", "AllReduce")[sel].astype(str)
    return set(zip(ints(ops, "rank")[sel].tolist(), col(ops, "comm_id")[sel].astype(str).tolist(),
                   ints(ops, "peer", -1)[sel].tolist(), op.tolist(), strict=True))
