"""Mycroft Alg. 2, AnalyzeFailureRootCause: who stopped a hung job, and why (Mycroft §5.2).

The paper: take each group's last logs (AcquireGroupLastLog); if ranks disagree on the last op,
the rank with the minimum op is the culprit (CheckMinOp) — its peers wait in a collective it never
reached; otherwise every rank sits in the same op and the rank that moved the least data is the
culprit (CheckMinData); the state table (Table 4) names the failure category.

How we implement it, from the ops of all ranks in the job's window at `now_ns`:
1. Last log per (rank, comm_id): the row with the largest op_seq.
2. A rank is *stuck* in a communicator when that last op is in flight (t_end = 0) and was
   enqueued more than `stuck_ns` before now.
3. Waits-for edges a → b, per stuck op of a:
   - collective: every member b of the communicator whose last op_seq there is below a's (b
     never reached the op) — Mycroft's min-op test, done per member rather than per group;
   - Send/Recv (op_seq is not aligned across pp ranks, see pipeline_ops.py): the peer b, unless b
     has the matching call (Recv for a's Send, Send for a's Recv) in flight on the same
     communicator — any in-flight row, not only its last log: then both sides posted and the
     transfer itself stalled, not a missing call.
4. Root causes are the sinks reachable from stuck ranks: a rank with no outgoing edge. A sink
   that is not stuck anywhere never reached the op its peers wait in (min-op culprit). Stuck
   ranks without edges share a stalled op with all its members present: min-data — the chunk
   counters of that op (mycroft_state.py, Table 4) name the rank and component. A cycle with
   no sink is a deadlock (ops issued in different orders): its ranks are reported with label
   "deadlock_cycle", component host_software.
5. Process death vs live hang for a min-op culprit: its last record (ops, beats) is more than
   `death_gap_ns` older than now and than the median rank's last record → "process" stage,
   component host_software (records stop: Mycroft #1 sees the culprit "stop earlier than the
   others"). Otherwise the process is alive (beats continue) but never issued its next op: a
   compute-side hang, gpu_compute, labels "live_hang" (and "no_beats" when no beats were given).

Never blaming waiters: a rank is blamed only as a sink (it is not waiting on anyone in the ops)
or by its own chunk counters; an in-flight op, however long, only adds outgoing edges. The stage
of a min-op culprit is the op it failed to reach ("dp_allreduce" for a dp communicator,
"tp <op>" / "pp <op>" otherwise); halt_point.py refines it to the 1F1B node.

Cost (1k-16k ranks, 10⁵-10⁶ ops rows): the string columns (comm_id, op) are factorized once per
window (`columns.codes`), string tests run on their distinct values, the last logs are one
sort on a packed (rank, comm) key, and the waits-for test is one array comparison per stuck
communicator; results are the same as the row-by-row formulation above.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from diagnosis.columns import Columns, codes, col, ints, last_per_group
from diagnosis.groups import Grid
from diagnosis.rules.base import Finding
from diagnosis.rules.mycroft_state import COLLECTIVE_KINDS, chunk_states, state_findings
from diagnosis.window import last_record_ns

Array = np.ndarray
SECOND = 1_000_000_000
P2P = ("Send", "Recv")


@dataclass(frozen=True)
class HangConfig:
    stuck_ns: int = 5 * SECOND
    death_gap_ns: int = 10 * SECOND


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
    rank had reached at `now_ns` (`reached`)."""
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
    return LastLogs(
        rank=ints(ops, "rank")[rows], comm_id=uniq[ccode[last]].astype(str),
        op_seq=ints(ops, "op_seq")[rows], op=_op_names(ops, rows),
        peer=ints(ops, "peer", -1)[rows], t_enqueue=enq[rows], t_end=t_end,
        stuck=(t_end == 0) & (now_ns - enq[rows] > stuck_ns),
    )


def _op_names(ops: Columns, rows: Array) -> Array:
    """The op column's `rows` as str (the column is factorized once, then expanded)."""
    uniq, code = codes(col(ops, "op", "AllReduce"))
    return np.asarray(uniq.astype(str)[code[rows]])


def _is_p2p(ops: Columns) -> Array:
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
    sel = np.flatnonzero(_is_p2p(ops) & on & ((t_end == 0) | (t_end > now_ns)))
    op = col(ops, "op", "AllReduce")[sel].astype(str)
    return set(zip(ints(ops, "rank")[sel].tolist(), col(ops, "comm_id")[sel].astype(str).tolist(),
                   ints(ops, "peer", -1)[sel].tolist(), op.tolist(), strict=True))


def _edges(ll: LastLogs, grid: Grid,
           posted: set[tuple[int, str, int, str]]) -> dict[int, set[int]]:
    """Waits-for edges from every stuck (rank, comm) last log (loops over stuck groups only).

    The last logs are grouped by communicator once (stable sort) and, per stuck communicator,
    the "member never reached op k" test is one [stuck rows × members] comparison instead of a
    Python loop per (stuck rank, member); edges are inserted in the same order as that loop."""
    edges: dict[int, set[int]] = {}
    stuck = np.flatnonzero(ll.stuck)
    if stuck.size == 0:
        return edges
    cuniq, cinv = np.unique(ll.comm_id, return_inverse=True)
    cinv = cinv.reshape(-1)
    by_comm = np.argsort(cinv, kind="stable")
    bounds = np.searchsorted(cinv[by_comm], np.arange(cuniq.size + 1))
    is_p2p = np.isin(ll.op, P2P)
    for j in np.unique(cinv[stuck]).tolist():
        c = str(cuniq[j])
        rows_c = by_comm[bounds[j]:bounds[j + 1]]  # ascending row order
        rc, qc = ll.rank[rows_c], ll.op_seq[rows_c]
        members = np.asarray(grid.comm_members.get(c, np.unique(rc)), dtype=np.int64)
        o = np.argsort(rc, kind="stable")
        pos = np.searchsorted(rc[o], members, side="right") - 1  # last row per rank (dict)
        found = (pos >= 0) & (rc[o][np.maximum(pos, 0)] == members)
        seq_m = np.where(found, qc[o][np.maximum(pos, 0)], -1)
        mine = rows_c[ll.stuck[rows_c]]
        coll = mine[~is_p2p[mine]]
        late = ((seq_m[None, :] < ll.op_seq[coll][:, None])
                & (members[None, :] != ll.rank[coll][:, None]))
        late_of = {int(i): late[n] for n in np.flatnonzero(late.any(axis=1)).tolist()
                   for i in [coll[n]]}
        for i in mine.tolist():
            a = int(ll.rank[i])
            if is_p2p[i]:
                b = int(ll.peer[i])
                match = "Send" if ll.op[i] == "Recv" else "Recv"
                if b >= 0 and (b, c, a, match) not in posted:  # b never posted its side
                    edges.setdefault(a, set()).add(b)
                continue
            if i in late_of:
                edges.setdefault(a, set()).update(members[late_of[i]].tolist())
    return edges


def _reachable_sinks(edges: dict[int, set[int]],
                     starts: list[int]) -> tuple[dict[int, int], set[int]]:
    """Sinks reachable from `starts` with how many start ranks (other than the sink itself)
    reach each; plus every node reachable from a start that reaches no sink (a cycle).

    One pass over the graph instead of a search per start (16k stuck ranks at 16k ranks): the
    strongly connected components (Tarjan, iterative) come out sinks-first, so each component's
    set of reachable sinks is the union of its successors' sets, known by then."""
    comp_of: dict[int, int] = {}
    comp_sinks: list[frozenset[int]] = []
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    for root in starts:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(edges.get(root, ())))]
        while work:
            x, it = work[-1]
            y = next(it, None)
            if y is not None:
                if y not in index:
                    index[y] = low[y] = len(index)
                    stack.append(y)
                    on_stack.add(y)
                    work.append((y, iter(edges.get(y, ()))))
                elif y in on_stack:
                    low[x] = min(low[x], index[y])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[x])
            if low[x] != index[x]:
                continue
            members: list[int] = []
            while True:
                z = stack.pop()
                on_stack.discard(z)
                members.append(z)
                if z == x:
                    break
            c = len(comp_sinks)
            for z in members:
                comp_of[z] = c
            if len(members) == 1 and not edges.get(x):
                comp_sinks.append(frozenset((x,)))
            else:
                comp_sinks.append(frozenset().union(*(
                    comp_sinks[comp_of[y]] for z in members for y in edges.get(z, ())
                    if comp_of[y] != c)))
    reach: dict[int, int] = {}
    cyclic: set[int] = set()
    for s in starts:
        sinks = comp_sinks[comp_of[s]]
        for t in sinks:
            reach[t] = reach.get(t, 0) + (t != s)
        if not sinks:
            cyclic |= _reachable(edges, s)
    return reach, cyclic


def _reachable(edges: dict[int, set[int]], s: int) -> set[int]:
    seen = {s}
    q = deque([s])
    while q:
        for y in edges.get(q.popleft(), set()) - seen:
            seen.add(y)
            q.append(y)
    return seen


def _stage(grid: Grid, comm: str, op: str) -> str:
    kind = grid.comm_kind.get(comm, "")
    if kind == "dp":
        return "dp_allreduce"
    return f"{kind} {op}".strip()


def analyze_hang(ops: Columns, grid: Grid, now_ns: int, *, chunks: Columns | None = None,
                 beats: Columns | None = None, flows: Columns | None = None,
                 config: HangConfig | None = None,
                 last_seen: Array | None = None) -> list[Finding]:
    """Alg. 2 over one job's window; returns findings (empty when nothing is stuck).

    `last_seen`: each rank's newest record time at `now_ns` (`window.last_record_ns` of these
    ops and beats), when the caller already has it."""
    cfg = config or HangConfig()
    ll = last_logs(ops, now_ns, cfg.stuck_ns)
    if not ll.stuck.any():
        return []
    posted = posted_p2p(ops, now_ns, cfg.stuck_ns)
    edges = _edges(ll, grid, posted)
    stuck_ranks = sorted({int(r) for r in ll.rank[ll.stuck]})
    reach, cyclic = _reachable_sinks(edges, stuck_ranks)
    stuck_set = set(stuck_ranks)
    seen = last_record_ns(ops, beats or {}, grid.world, now_ns) if last_seen is None \
        else last_seen
    active = seen[seen > 0]
    median_seen = int(np.median(active)) if active.size else now_ns
    out: list[Finding] = []
    for x in sorted(r for r in reach if r not in stuck_set):
        out.append(_min_op(x, ll, edges, reach[x], len(stuck_ranks), seen, median_seen,
                           now_ns, grid, cfg, beats is not None and bool(beats)))
    same_op = [r for r in reach if r in stuck_set]
    if same_op:
        out.extend(_min_data(same_op, ll, now_ns, grid, chunks, flows, ops))
    if cyclic:
        out.append(Finding(rule="mycroft.alg2.deadlock", culprit_ranks=tuple(sorted(cyclic)),
                           component="host_software", score=1.0, labels=("deadlock_cycle",),
                           kind="hang", evidence={"edges": {str(a): sorted(b) for a, b in
                                                            edges.items() if a in cyclic}}))
    return sorted(out, key=lambda f: -f.score)


def _min_op(x: int, ll: LastLogs, edges: dict[int, set[int]], waiting: int, n_stuck: int,
            seen: Array, median_seen: int, now_ns: int, grid: Grid, cfg: HangConfig,
            have_beats: bool) -> Finding:
    waiters = [a for a, bs in edges.items() if x in bs]
    wi = np.flatnonzero(ll.stuck & np.isin(ll.rank, waiters))
    first = wi[np.argmin(ll.t_enqueue[wi])] if wi.size else -1
    comm = str(ll.comm_id[first]) if first >= 0 else ""
    stage = _stage(grid, comm, str(ll.op[first])) if first >= 0 else None
    mine = np.flatnonzero(ll.rank == x)
    last = mine[np.argmax(ll.t_enqueue[mine])] if mine.size else -1
    dead = (now_ns - seen[x] > cfg.death_gap_ns) and (median_seen - seen[x] > cfg.death_gap_ns)
    labels = ("min_op", "records_stopped") if dead else \
        ("min_op", "live_hang", *(() if have_beats else ("no_beats",)))
    return Finding(
        rule="mycroft.alg2.min_op", culprit_ranks=(x,), kind="hang",
        stage="process" if dead else stage, component="host_software" if dead else "gpu_compute",
        score=(waiting + 1) / max(n_stuck, 1), labels=labels,
        onset_ns=int(seen[x]) if dead else (int(ll.t_enqueue[first]) if first >= 0 else None),
        evidence={
            "waited_in": {"comm_id": comm, "op_seq": int(ll.op_seq[first]),
                          "op": str(ll.op[first])} if first >= 0 else None,
            "direct_waiters": sorted(waiters)[:32], "ranks_waiting": waiting,
            "culprit_last_op": {"comm_id": str(ll.comm_id[last]), "op_seq": int(ll.op_seq[last]),
                                "t_end": int(ll.t_end[last])} if last >= 0 else None,
            "last_record_ns": int(seen[x]), "median_last_record_ns": median_seen,
            "death_gap_ns": cfg.death_gap_ns,
        },
    )


def _min_data(ranks: list[int], ll: LastLogs, now_ns: int, grid: Grid,
              chunks: Columns | None, flows: Columns | None, ops: Columns) -> list[Finding]:
    sel = np.flatnonzero(ll.stuck & np.isin(ll.rank, ranks))
    ops_key = {(str(ll.comm_id[i]), int(ll.op_seq[i])) for i in sel}
    # the stalled transfers of p2p pairs include in-flight Sends/Recvs that are not last logs
    t_end = ints(ops, "t_end")
    p2p = np.flatnonzero(_is_p2p(ops) & np.isin(ints(ops, "rank"), ranks)
                         & ((t_end == 0) | (t_end > now_ns)) & (ints(ops, "t_enqueue") <= now_ns))
    ops_key |= set(zip(col(ops, "comm_id")[p2p].astype(str).tolist(),
                       ints(ops, "op_seq")[p2p].tolist(), strict=True))
    if chunks:
        sub = _stalled_chunks(chunks, ops_key, [*ranks, *(int(x) for x in ll.rank[sel])], grid)
        found = state_findings(chunk_states(sub, now_ns, grid, flows))
        if found:
            return [Finding(rule="mycroft.alg2.min_data", culprit_ranks=f.culprit_ranks,
                            stage=_stage(grid, *_op_of(ll, sel)),
                            component=f.component or "gpu_compute", score=f.score,
                            labels=("min_data", *f.labels,
                                    *(() if f.component else ("kernel_not_started",))),
                            kind="hang", onset_ns=f.onset_ns, evidence=dict(f.evidence))
                    for f in found]
    return [Finding(rule="mycroft.alg2.min_data", culprit_ranks=(), kind="hang",
                    stage=_stage(grid, *_op_of(ll, sel)), score=0.1,
                    labels=("min_data", "no_counter_evidence"),
                    evidence={"stalled_ops": sorted(f"{c}#{s}" for c, s in ops_key)[:20],
                              "ranks_in_op": sorted(ranks)[:64]})]


def _stalled_chunks(chunks: Columns, ops_key: set[tuple[str, int]], ranks: list[int],
                    grid: Grid) -> Columns:
    """The chunk rows of the stalled ops: of a collective, every member's rows (a member
    without any is one whose kernel never started: Table 4's "receiver not ready"); of a
    Send/Recv, only the stuck ranks' own (p2p op_seq is per rank, another rank's row with the
    same number is another call)."""
    uniq, cc = codes(col(chunks, "comm_id"))
    q = ints(chunks, "op_seq")
    code_of = {str(u): i for i, u in enumerate(uniq.tolist())}
    wanted = [(code_of[c], k) for c, k in ops_key if c in code_of]
    if not wanted or q.size == 0:
        return {k: np.asarray(v)[:0] for k, v in chunks.items()}
    span = int(max(int(q.max()), max(k for _, k in wanted))) + 1
    keep = np.isin(cc * span + q, [c * span + k for c, k in wanted])
    coll = np.asarray([grid.comm_kind.get(str(u), "") in COLLECTIVE_KINDS for u in uniq],
                      dtype=bool)
    keep &= coll[cc] | np.isin(ints(chunks, "rank"), ranks)
    return {k: np.asarray(v)[keep] for k, v in chunks.items()}


def _op_of(ll: LastLogs, sel: Array) -> tuple[str, str]:
    i = sel[np.argmin(ll.t_enqueue[sel])]
    return str(ll.comm_id[i]), str(ll.op[i])
