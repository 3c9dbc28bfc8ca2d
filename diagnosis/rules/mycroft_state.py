"""Mycroft Table 4: the state of an in-flight op from its chunk counters, and who it blames.

For every (rank, comm_id, op_seq, channel) the latest `chunks` snapshot at or before `now_ns`
holds three cumulative counters (Mycroft §4.2, Table 2): ① gpu_ready (chunks the kernel staged),
② rdma_transmitted (chunks the proxy posted to the NIC) and ③ rdma_done (completions back).
Table 4 reads them as states; several may hold at once, so `state` is a bitmask:

| state            | condition     | local cause → component     | remote cause                    |
|------------------|---------------|-----------------------------|---------------------------------|
| NOT_STARTED      | ①=②=③=0       | uninitialized → (Alg. 2)    | blocked (everyone is at 0)      |
| NOT_TRANSMITTED  | ① > ②         | RDMA issue → nic_rdma       | receiver not ready → receiver   |
| NOT_DELIVERED    | ② > ③         | RDMA issue → nic_rdma       | receiver failed → receiver      |
| GPU_NOT_READY    | ①=②=③ > 0     | GPU issue → gpu_compute     | — (waiting for a predecessor)   |

plus COMPLETE (③ = total) for snapshots of finished ops.

Local vs remote, and where we do better than the table:
- NOT_STARTED is local ("uninitialized": the rank never joined the op) when another member of
  the same (comm_id, op_seq) has progressed; if every member is at 0 the op is blocked from
  outside and nobody is blamed here. The component is left to Alg. 2 (mycroft_hang.py), which
  knows why the rank did not arrive.
- NOT_TRANSMITTED is remote ("receiver not ready") when the receiver's own row for the op is
  NOT_STARTED, or when the receiver has no row for the op on any channel and the op is a
  collective (a communicator of kind tp/dp/cp/ep/world in the grid: every member runs the same
  op_seq, so a member without a snapshot never started its kernel — the GPU stream was still
  busy); the receiver is blamed. A Send/Recv's receiver counts its own op_seq (pipeline_ops.py),
  so a missing row proves nothing there, and without a grid nothing is inferred from absence.
  Otherwise the sender's NIC is not posting: local nic_rdma.
- NOT_DELIVERED: Mycroft §5.3 compares sender and receiver — sender ②>③ with receiver ①=②=③
  blames the receiver. That pairwise rule misfires when a NIC is down: both the link into and
  the link out of the dead NIC are undelivered, and the receiver downstream of it looks healthy.
  We first count, per rank, the undelivered links it is an endpoint of (in + out); the endpoint
  with more of them is blamed (a dead NIC has both). Only on a tie do we apply Mycroft's pairwise
  rule (receiver all equal → receiver; otherwise the sender).
- GPU_NOT_READY: in a ring every rank waiting for data also shows ①=②=③, so the state alone
  does not name a culprit. It is local only when the rank's progress (③/total) is the unique
  minimum of its op by at least one chunk and no member shows a NIC-side state; otherwise the row
  is "ambiguous" and the op-timing rules (mycroft_flow.py) decide. The component is gpu_compute
  with the label "gpu_or_pcie": a downgraded PCIe link shows the same counters (Mycroft #3).

Who receives a channel's data: the `peer` column of the rows if present, else the flows log
(`flows` rows with the same rank, comm_id, op_seq and channel), else the next member of the
communicator in topology order (NCCL's ring order is assumed to follow it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnosis.columns import Columns, codes, col, group_key, ints, last_per_group
from diagnosis.groups import Grid
from diagnosis.rules.base import Component, Finding

Array = np.ndarray

NOT_STARTED, NOT_TRANSMITTED, NOT_DELIVERED, GPU_NOT_READY, COMPLETE = 1, 2, 4, 8, 16
STATE_NAMES = {NOT_STARTED: "not_started", NOT_TRANSMITTED: "not_transmitted",
               NOT_DELIVERED: "not_delivered", GPU_NOT_READY: "gpu_not_ready",
               COMPLETE: "complete"}
LOCAL, REMOTE, VICTIM, AMBIGUOUS = "local", "remote", "victim", "ambiguous"
COLLECTIVE_KINDS = ("tp", "dp", "cp", "ep", "world")


@dataclass(frozen=True)
class ChunkStates:
    """Latest snapshot per (rank, comm_id, op_seq, channel), classified; arrays are row-aligned."""

    rank: Array
    comm_id: Array
    op_seq: Array
    channel: Array
    ts: Array
    peer: Array  # receiver of this rank's data on the channel, -1 if unknown
    state: Array  # bitmask of the constants above
    cause: Array  # object: local | remote | victim | ambiguous | "" (complete)
    blamed: Array  # rank the row blames, -1 for none
    component: Array  # object: a Component or ""


def classify_states(g: Array, t: Array, d: Array, total: Array) -> Array:
    """Table 4 conditions as a bitmask per row (vectorized)."""
    s = np.zeros(g.size, dtype=np.int64)
    s |= np.where((g == 0) & (t == 0) & (d == 0), NOT_STARTED, 0)
    s |= np.where(g > t, NOT_TRANSMITTED, 0)
    s |= np.where(t > d, NOT_DELIVERED, 0)
    s |= np.where((g == t) & (t == d) & (d > 0) & (d < total), GPU_NOT_READY, 0)
    s |= np.where((total > 0) & (d >= total), COMPLETE, 0)
    return s


def _lookup(table_keys: Array, values: Array, query: Array, missing: int = -1) -> Array:
    """values[i] where table_keys[i] == query (row-wise; rows of `table_keys` unique)."""
    if table_keys.shape[0] == 0 or query.shape[0] == 0:
        return np.full(query.shape[0], missing, dtype=np.int64)
    both = np.concatenate([table_keys, query])
    gid, _ = group_key(*both.T)
    tg, qg = gid[: table_keys.shape[0]], gid[table_keys.shape[0]:]
    out = np.full(int(gid.max()) + 1, missing, dtype=np.int64)
    out[tg] = values
    return np.asarray(out[qg], dtype=np.int64)


def _receivers(chunks: Columns, rows: Array, comm: Array, grid: Grid | None,
               flows: Columns | None, cols: tuple[Array, ...]) -> Array:
    rank, seq, ch = cols
    if "peer" in chunks:
        return np.asarray(ints(chunks, "peer")[rows], dtype=np.int64)
    peer = np.full(rows.size, -1, dtype=np.int64)
    if flows:
        # the flows' comm_id column is factorized once per window; the few snapshot rows are
        # looked up in its distinct values (-1: a communicator no flow names)
        funiq, fcode = codes(col(flows, "comm_id"))
        code_of = {str(c): i for i, c in enumerate(funiq.tolist())}
        ccode = np.fromiter((code_of.get(str(c), -1) for c in comm.tolist()), dtype=np.int64,
                            count=comm.size)
        fseq = ints(flows, "op_seq")
        near = np.flatnonzero(np.isin(fcode, ccode) & np.isin(fseq, seq))  # the queried ops'
        table = np.stack([fcode[near], fseq[near], ints(flows, "channel")[near],
                          ints(flows, "rank")[near]], axis=1)
        query = np.stack([ccode, seq, ch, rank], axis=1)
        peer = _lookup(table, ints(flows, "peer")[near], query)
    if grid is not None:
        for c in np.unique(comm[peer < 0]).tolist():
            m = grid.comm_members.get(str(c))
            if m is None or m.size < 2:
                continue
            succ = np.full(grid.world, -1, dtype=np.int64)
            succ[m] = np.roll(m, -1)
            sel = (peer < 0) & (comm == c)
            peer[sel] = succ[rank[sel]]
    return peer


def chunk_states(chunks: Columns, now_ns: int, grid: Grid | None = None,
                 flows: Columns | None = None) -> ChunkStates:
    """Classify the latest snapshot (ts ≤ now_ns) of every (rank, comm, op_seq, channel)."""
    ts_all = ints(chunks, "ts")
    ok = np.flatnonzero(ts_all <= now_ns)
    comm_all = col(chunks, "comm_id").astype(str)
    _, ccode = codes(comm_all[ok])
    key, _ = group_key(ccode, ints(chunks, "op_seq")[ok], ints(chunks, "channel")[ok],
                       ints(chunks, "rank")[ok])
    rows = ok[last_per_group(key, ts_all[ok])] if ok.size else ok
    rank, seq, ch = (ints(chunks, k)[rows] for k in ("rank", "op_seq", "channel"))
    comm = comm_all[rows]
    g, t, d, total = (ints(chunks, k)[rows] for k in ("gpu_ready", "rdma_transmitted",
                                                      "rdma_done", "total_chunks"))
    state = classify_states(g, t, d, total)
    peer = _receivers(chunks, rows, comm, grid, flows, (rank, seq, ch))
    cause, blamed, comp = _attribute(rank, comm, seq, ch, peer, state, d, total,
                                     collective_rows(comm, grid))
    return ChunkStates(rank, comm, seq, ch, ts_all[rows], peer, state, cause, blamed, comp)


def collective_rows(comm: Array, grid: Grid | None) -> Array:
    """Row mask: the row's communicator is a collective one in `grid` (kind tp, dp, cp, ep or
    world — not pp, whose Send/Recv number their calls per rank); all False without a grid."""
    if grid is None or comm.size == 0:
        return np.zeros(comm.size, dtype=bool)
    uniq, inv = codes(comm)
    coll = np.asarray([k in COLLECTIVE_KINDS for k in grid.kinds_of(uniq)], dtype=bool)
    return np.asarray(coll[inv], dtype=bool)


def _attribute(rank: Array, comm: Array, seq: Array, ch: Array, peer: Array, state: Array,
               d: Array, total: Array, collective: Array | None = None
               ) -> tuple[Array, Array, Array]:
    n = rank.size
    cause = np.full(n, "", dtype=object)
    blamed = np.full(n, -1, dtype=np.int64)
    comp = np.full(n, "", dtype=object)
    if n == 0:
        return cause, blamed, comp
    _, ccode = codes(comm)
    op, _ = group_key(ccode, seq)
    n_op = int(op.max()) + 1
    # the receiver's own row for the same op and channel
    table = np.stack([op, ch, rank], axis=1)
    recv_row = _lookup(table, np.arange(n), np.stack([op, ch, peer], axis=1))
    has_recv = recv_row >= 0
    recv_state = np.where(has_recv, state[np.maximum(recv_row, 0)], 0)
    progressed = np.zeros(n_op, dtype=bool)
    np.logical_or.at(progressed, op, (state & NOT_STARTED) == 0)
    nic_side = np.zeros(n_op, dtype=bool)
    np.logical_or.at(nic_side, op, (state & (NOT_TRANSMITTED | NOT_DELIVERED)) != 0)

    ns = (state & NOT_STARTED) != 0
    local = ns & progressed[op]
    cause[ns] = np.where(local, LOCAL, VICTIM)[ns]
    blamed[local] = rank[local]
    # NOT_TRANSMITTED: receiver not ready (remote) or the sender's NIC (local); a collective's
    # receiver with no row for the op at all never started it
    nt = (state & NOT_TRANSMITTED) != 0
    op_rank = np.stack([op, rank], axis=1)
    recv_any = _lookup(op_rank, np.ones(n, dtype=np.int64), np.stack([op, peer], axis=1), 0) > 0
    absent = ~recv_any & (peer >= 0) & (np.zeros(n, dtype=bool) if collective is None
                                        else collective)
    remote = nt & ((has_recv & ((recv_state & NOT_STARTED) != 0)) | absent)
    cause[nt] = np.where(remote, REMOTE, LOCAL)[nt]
    blamed[nt] = np.where(remote, peer, rank)[nt]
    comp[nt & ~remote] = "nic_rdma"
    # NOT_DELIVERED: vote by undelivered links per endpoint, tie → Mycroft's pairwise rule
    nd = ((state & NOT_DELIVERED) != 0) & ~nt
    ends = np.concatenate([rank[nd], peer[nd][peer[nd] >= 0]])
    deg = np.bincount(ends, minlength=int(max(rank.max(), peer.max(), 0)) + 1)
    ds, dr = deg[rank], deg[np.maximum(peer, 0)]
    recv_equal = has_recv & ((recv_state & (NOT_TRANSMITTED | NOT_DELIVERED)) == 0)
    to_recv = (peer >= 0) & ((dr > ds) | ((dr == ds) & recv_equal))
    cause[nd] = np.where(to_recv, REMOTE, LOCAL)[nd]
    blamed[nd] = np.where(to_recv, peer, rank)[nd]
    comp[nd] = "nic_rdma"
    # GPU_NOT_READY: local only for the unique laggard of an op with no NIC-side state
    gn = (state & GPU_NOT_READY) != 0
    laggard = gn & _unique_laggard(op, rank, d, total, n_op) & ~nic_side[op]
    cause[gn] = np.where(laggard, LOCAL, AMBIGUOUS)[gn]
    blamed[laggard] = rank[laggard]
    comp[gn] = "gpu_compute"
    return cause, blamed, comp


def _unique_laggard(op: Array, rank: Array, d: Array, total: Array, n_op: int) -> Array:
    """Row mask: the row's rank is the only one at its op's minimum progress (③/total, min over
    channels), at least one chunk behind every other rank of the op."""
    rk, first = group_key(op, rank)
    n_rk = int(rk.max()) + 1
    prog = np.where(total > 0, d / np.maximum(total, 1), 0.0)
    rank_prog = np.full(n_rk, np.inf)
    np.minimum.at(rank_prog, rk, prog)
    op_rk = op[first]
    lo = np.full(n_op, np.inf)
    np.minimum.at(lo, op_rk, rank_prog)
    at_lo = rank_prog <= lo[op_rk]
    n_lo = np.bincount(op_rk[at_lo], minlength=n_op)
    second = np.full(n_op, np.inf)
    np.minimum.at(second, op_rk[~at_lo], rank_prog[~at_lo])
    step = np.zeros(n_op)
    np.maximum.at(step, op, 1.0 / np.maximum(total, 1))
    ok_rk = at_lo & (n_lo[op_rk] == 1) & (second[op_rk] - rank_prog >= step[op_rk] - 1e-12)
    return np.asarray(ok_rk[rk])


def state_fractions(chunks: Columns, ranks: Array) -> dict[str, Array]:
    """Temporal view (Mycroft §5.3): per rank of `ranks`, the fraction of its snapshots in each
    state — e.g. frequent ①=②=③ points at the GPU side, frequent ①>② at the NIC."""
    r = ints(chunks, "rank")
    s = classify_states(*(ints(chunks, k) for k in ("gpu_ready", "rdma_transmitted",
                                                    "rdma_done", "total_chunks")))
    pos = np.searchsorted(ranks, r)
    ok = (pos < ranks.size) & (ranks[np.minimum(pos, max(ranks.size - 1, 0))] == r)
    n = np.bincount(pos[ok], minlength=ranks.size).astype(np.float64)
    return {name: np.bincount(pos[ok], weights=((s[ok] & bit) != 0).astype(np.float64),
                              minlength=ranks.size) / np.maximum(n, 1)
            for bit, name in STATE_NAMES.items()}


def state_findings(states: ChunkStates, kind: str = "hang") -> list[Finding]:
    """One finding per blamed rank: score = share of blaming rows; evidence lists the states."""
    hit = states.blamed >= 0
    if not hit.any():
        return []
    out: list[Finding] = []
    total = int(hit.sum())
    for r in np.unique(states.blamed[hit]).tolist():
        rows = hit & (states.blamed == r)
        comps = [c for c in states.component[rows].tolist() if c]
        comp: Component | None = max(set(comps), key=comps.count) if comps else None
        names = sorted({STATE_NAMES[b] for b in STATE_NAMES for s in states.state[rows].tolist()
                        if s & b})
        causes = sorted({str(c) for c in states.cause[rows].tolist()})
        labels = tuple(sorted({*causes, *(["gpu_or_pcie"] if comp == "gpu_compute" else [])}))
        out.append(Finding(
            rule="mycroft.table4", culprit_ranks=(int(r),), component=comp,
            score=float(rows.sum()) / total, labels=labels, kind=kind,  # type: ignore[arg-type]
            onset_ns=int(states.ts[rows].min()),
            evidence={"states": names, "rows": int(rows.sum()),
                      "ops": sorted({f"{c}#{s}" for c, s in zip(
                          states.comm_id[rows].tolist(), states.op_seq[rows].tolist(),
                          strict=True)})[:20]},
        ))
    return sorted(out, key=lambda f: -f.score)
