"""Mycroft Alg. 2, AnalyzeFailureRootCause: who stopped a hung job, and why (Mycroft §5.2).

The paper: take each group's last logs (AcquireGroupLastLog); if ranks disagree on the last op,
the rank with the minimum op is the culprit (CheckMinOp) — its peers wait in a collective it never
reached; otherwise every rank sits in the same op and the rank that moved the least data is the
culprit (CheckMinData); the state table (Table 4) names the failure category.

How we implement it, from the ops of all ranks in the job's window at `now_ns`:
1. Last log per (rank, comm_id): of the calls the rank had reached by now, the one with the
   largest op_seq (last_logs.py). A call its host posted but whose kernel had not started
   `stuck_ns` after the enqueue is not reached (seen only when a recovered stall is analysed).
2. A rank is *stuck* in a communicator when that last op is in flight (t_end = 0) and was
   enqueued more than `stuck_ns` before now.
3. Waits-for edges a → b, per stuck op of a (waits_for.py): a collective's members b whose last
   op_seq there is below a's (b never reached the op — Mycroft's min-op test, per member); for
   Send/Recv the peer, unless it posted the matching call (then the transfer itself stalled).
4. Root causes are the sinks reachable from stuck ranks: a rank with no outgoing edge. A sink
   that is not stuck anywhere never reached the op its peers wait in (min-op culprit). Stuck
   ranks without edges share a stalled op with all its members present: min-data — the chunk
   counters of that op (mycroft_state.py, Table 4) name the rank and component; a rank named
   only because its kernel never started the op (no counters, or all zero while its peers
   progressed) is gpu_compute, label "kernel_not_started". A cycle with no sink is a deadlock
   (ops issued in different orders): its ranks are reported with label "deadlock_cycle",
   component host_software.
5. Process death vs live hang for a min-op culprit: its last record (ops, beats) is more than
   `death_gap_ns` older than now and than the median rank's last record → "process" stage,
   component host_software (records stop: Mycroft #1 sees the culprit "stop earlier than the
   others"). Otherwise the process is alive (beats continue) but never issued its next op: a
   compute-side hang, gpu_compute, labels "live_hang" (and "no_beats" when no beats were given).
   A culprit with no record at all in the window is neither: label "no_records" (its rows are
   not stored yet, or it never started), component undecided.

Never blaming waiters: a rank is blamed only as a sink (it is not waiting on anyone in the ops)
or by its own chunk counters; an in-flight op, however long, only adds outgoing edges. The stage
of a min-op culprit is the op it failed to reach ("dp_allreduce" for a dp communicator,
"tp <op>" / "pp <op>" otherwise); halt_point.py refines it to the 1F1B node.

Cost (1k-16k ranks, 10⁵-10⁶ ops rows): see last_logs.py and waits_for.py; the min-data path
selects the stalled ops' chunk rows with one `isin` on codes. Results are those of the
row-by-row formulation above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnosis.columns import Columns, codes, col, ints
from diagnosis.groups import Grid
from diagnosis.rules.base import Finding
from diagnosis.rules.last_logs import LastLogs, is_p2p, last_logs, posted_p2p
from diagnosis.rules.mycroft_state import COLLECTIVE_KINDS, chunk_states, state_findings
from diagnosis.rules.waits_for import edges as waits_for_edges
from diagnosis.rules.waits_for import reachable_sinks
from diagnosis.window import last_record_ns
from ingest.units import SECOND

Array = np.ndarray


@dataclass(frozen=True)
class HangConfig:
    stuck_ns: int = 5 * SECOND
    death_gap_ns: int = 10 * SECOND


def op_stage(grid: Grid, comm: str, op: str) -> str:
    """The diagnosis stage of a call: "dp_allreduce" on a dp communicator, else "<kind> <op>"."""
    kind = grid.kind_of(comm)
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
    edges = waits_for_edges(ll, grid, posted)
    stuck_ranks = sorted({int(r) for r in ll.rank[ll.stuck]})
    reach, cyclic = reachable_sinks(edges, stuck_ranks)
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
    stage = op_stage(grid, comm, str(ll.op[first])) if first >= 0 else None
    mine = np.flatnonzero(ll.rank == x)
    last = mine[np.argmax(ll.t_enqueue[mine])] if mine.size else -1
    # a rank with no record at all in the window did not "stop earlier": its rows are not
    # stored (yet), so death cannot be told from a live hang (label "no_records")
    dead = bool(seen[x] > 0) and (now_ns - seen[x] > cfg.death_gap_ns) and (
        median_seen - seen[x] > cfg.death_gap_ns)
    labels = ("min_op", "records_stopped") if dead else ("min_op", "no_records") if not seen[x] \
        else ("min_op", "live_hang", *(() if have_beats else ("no_beats",)))
    return Finding(
        rule="mycroft.alg2.min_op", culprit_ranks=(x,), kind="hang",
        stage="process" if dead else stage,
        component="host_software" if dead else None if not seen[x] else "gpu_compute",
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
    p2p = np.flatnonzero(is_p2p(ops) & np.isin(ints(ops, "rank"), ranks)
                         & ((t_end == 0) | (t_end > now_ns)) & (ints(ops, "t_enqueue") <= now_ns))
    ops_key |= set(zip(col(ops, "comm_id")[p2p].astype(str).tolist(),
                       ints(ops, "op_seq")[p2p].tolist(), strict=True))
    if chunks:
        sub = _stalled_chunks(chunks, ops_key, [*ranks, *(int(x) for x in ll.rank[sel])], grid)
        found = state_findings(chunk_states(sub, now_ns, grid, flows))
        if found:
            return [Finding(rule="mycroft.alg2.min_data", culprit_ranks=f.culprit_ranks,
                            stage=op_stage(grid, *_op_of(ll, sel)),
                            component=f.component or "gpu_compute", score=f.score,
                            labels=("min_data", *f.labels,
                                    *(() if f.component else ("kernel_not_started",))),
                            kind="hang", onset_ns=f.onset_ns, evidence=dict(f.evidence))
                    for f in found]
    return [Finding(rule="mycroft.alg2.min_data", culprit_ranks=(), kind="hang",
                    stage=op_stage(grid, *_op_of(ll, sel)), score=0.1,
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
    coll = np.asarray([k in COLLECTIVE_KINDS for k in grid.kinds_of(uniq)], dtype=bool)
    keep &= coll[cc] | np.isin(ints(chunks, "rank"), ranks)
    return {k: np.asarray(v)[keep] for k, v in chunks.items()}


def _op_of(ll: LastLogs, sel: Array) -> tuple[str, str]:
    i = sel[np.argmin(ll.t_enqueue[sel])]
    return str(ll.comm_id[i]), str(ll.op[i])
