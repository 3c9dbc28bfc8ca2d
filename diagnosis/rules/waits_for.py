"""The waits-for graph of a hung job (Mycroft Alg. 2, CheckMinOp per member) and its sinks.

Edges a → b, per stuck last log of a (last_logs.py):
- collective: every member b of the communicator whose last op_seq there is below a's (b never
  reached the op) — Mycroft's min-op test, done per member rather than per group;
- Send/Recv (op_seq is not aligned across pp ranks, see pipeline_ops.py): the peer b, unless b
  has the matching call (Recv for a's Send, Send for a's Recv) in flight on the same
  communicator — any in-flight row, not only its last log: then both sides posted and the
  transfer itself stalled, not a missing call.

`reachable_sinks` returns the ranks with no outgoing edge reachable from the stuck ranks (with
how many stuck ranks reach each) and the nodes of cycles that reach none (a deadlock).

Cost: the last logs are grouped by communicator once and, per stuck communicator, the "member
never reached op k" test is one [stuck rows × members] comparison; the sinks come from one
strongly-connected-components pass, not a search per stuck rank (16k at 16k ranks).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from diagnosis.groups import Grid
from diagnosis.rules.last_logs import P2P, LastLogs

Array = np.ndarray


def edges(ll: LastLogs, grid: Grid,
           posted: set[tuple[int, str, int, str]]) -> dict[int, set[int]]:
    """Waits-for edges from every stuck (rank, comm) last log (loops over stuck groups only).

    The last logs are grouped by communicator once (stable sort) and, per stuck communicator,
    the "member never reached op k" test is one [stuck rows × members] comparison instead of a
    Python loop per (stuck rank, member); edges are inserted in the same order as that loop."""
    out: dict[int, set[int]] = {}
    stuck = np.flatnonzero(ll.stuck)
    if stuck.size == 0:
        return out
    cuniq, cinv = np.unique(ll.comm_id, return_inverse=True)
    cinv = cinv.reshape(-1)
    by_comm = np.argsort(cinv, kind="stable")
    bounds = np.searchsorted(cinv[by_comm], np.arange(cuniq.size + 1))
    p2p = np.isin(ll.op, P2P)
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
        coll = mine[~p2p[mine]]
        late = ((seq_m[None, :] < ll.op_seq[coll][:, None])
                & (members[None, :] != ll.rank[coll][:, None]))
        late_of = {int(i): late[n] for n in np.flatnonzero(late.any(axis=1)).tolist()
                   for i in [coll[n]]}
        for i in mine.tolist():
            a = int(ll.rank[i])
            if p2p[i]:
                b = int(ll.peer[i])
                match = "Send" if ll.op[i] == "Recv" else "Recv"
                if b >= 0 and (b, c, a, match) not in posted:  # b never posted its side
                    out.setdefault(a, set()).add(b)
                continue
            if i in late_of:
                out.setdefault(a, set()).update(members[late_of[i]].tolist())
    return out


def reachable_sinks(edges: dict[int, set[int]],
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
            succ = {comp_of[y] for z in members for y in edges.get(z, ())}
            succ.discard(c)
            if len(members) == 1 and not edges.get(x):
                comp_sinks.append(frozenset((x,)))
            elif len(succ) == 1:  # the common case: one successor component, share its set
                comp_sinks.append(comp_sinks[succ.pop()])
            else:
                comp_sinks.append(frozenset().union(*(comp_sinks[k] for k in succ)))
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
