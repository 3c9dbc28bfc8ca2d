"""The stage of a hang: the halt point of the partial 1F1B graph (VenusTrace §3.3 "Locate hang
issue", Alg. 1 lines 9-12, App. B Fig. 15; MegaTrace §III-C step 3).

When a job hangs, the logs describe only part of the step's DAG. The halt point is the first node
whose completion is missing: a node that did not complete although all its predecessors did. It
names the faulty stage ("fwd mb=3 pp=1", "dp_allreduce", "data"); the ranks come from the drill
into the TP group of that node.

Procedure over the ops of the job's window (mapping in pipeline_ops.py):
1. The hung step k: the first step whose DP collectives have not completed on every rank (or the
   `step` argument).
2. A replica (PP group) whose every rank has called step k's DP collective finished all its F/B
   passes: it only waits at the DP AllReduce. Only the others are examined (vectorized over all
   ranks; the per-rank pass reconstruction runs for those few replicas alone — MegaTrace's
   "focus on the straggler PP group").
3. For each examined replica, a node is complete when it is complete on every TP rank of its
   stage; the frontier is every incomplete node whose DAG predecessors are complete; the halt
   point is the frontier node that became ready first (VenusTrace Alg. 1 line 12: argmin of the
   time since progress). Ties across hosts are within clock skew; the earliest is reported and
   the others are listed in the evidence.
4. Ranks: the TP ranks on which the node is incomplete when some completed it; when none did,
   the rank(s) that issued the fewest TP collectives for the pass (they stopped computing while
   their TP peers wait in the next collective — Mycroft's min-op); otherwise the whole TP group.
5. Stage and component: a forward on the first stage whose culprit ranks issued no TP call for
   the pass did not get through its first segment, which on stage 0 starts with fetching the
   batch (label "data_or_fwd"). It is reported as stage "data", component data_loader, when it
   is the step's first microbatch (the loader runs before the first forward — as in the
   simulator) or when no TP rank of the stage started the pass (they share the batch);
   otherwise as the forward pass. With tp = 1 this cannot be told (label "data_or_fwd" only).
   A node whose completion has no marker of its own (F on the last stage, B on the first, with
   tp = 1) carries the label "ambiguous_fwd_bwd". Otherwise the component is gpu_compute (a
   pass that never issued its next call). If every replica waits at the DP AllReduce, the stage is
   "dp_allreduce" and the ranks are left to Mycroft's min-data (mycroft_hang.py). If no replica
   issued any op of step k, the job stopped between steps (optimizer, callbacks, first batch):
   stage "between_steps", no culprit — the ops cannot tell which.

Cost: the comm_id → kind mask is computed once per call, and the per-rank pass reconstruction
(`pass_times`) selects its rows through one `OpsIndex` of the table (rows sorted once by
(rank, comm), a lookup is a binary search) instead of a full-table string mask per rank — the
mask was ~70 % of a hang's root cause at 1k ranks.
"""

from __future__ import annotations

import numpy as np

from diagnosis.columns import Columns, codes, col, ints
from diagnosis.groups import Grid
from diagnosis.rules.base import Component, Finding
from diagnosis.rules.critical_path import build_1f1b_dag
from diagnosis.rules.last_logs import reached
from diagnosis.rules.pipeline_ops import OpsIndex, PipelineSpec, pass_times

Array = np.ndarray


def _is_dp(ops: Columns, grid: Grid, comm_codes: tuple[Array, Array] | None = None) -> Array:
    """Row mask of ops on `dp` communicators (one dictionary lookup per distinct comm_id)."""
    uniq, inv = codes(col(ops, "comm_id")) if comm_codes is None else comm_codes
    kind = np.asarray([k == "dp" for k in grid.kinds_of(uniq)], dtype=bool)
    return kind[inv] if inv.size else np.zeros(0, dtype=bool)


def _dp_entered(ops: Columns, grid: Grid, spec: PipelineSpec, step: int,
                is_dp: Array | None = None) -> tuple[Array, Array]:
    """Per rank: entered step `step`'s DP collectives; completed them."""
    is_dp = _is_dp(ops, grid) if is_dp is None else is_dp
    rank, seq = ints(ops, "rank")[is_dp], ints(ops, "op_seq")[is_dp]
    stp = ints(ops, "step", -1)[is_dp]
    k = np.where(stp >= 0, stp, seq // spec.dp_ops_per_step + spec.step_base)
    last_of_step = np.where(stp >= 0, True, seq % spec.dp_ops_per_step == spec.dp_ops_per_step - 1)
    sel = (k == step) & last_of_step
    entered = np.zeros(grid.world, dtype=bool)
    done = np.zeros(grid.world, dtype=bool)
    entered[rank[sel]] = True
    done[rank[sel & (ints(ops, "t_end")[is_dp] > 0)]] = True
    return entered, done


def hung_step(ops: Columns, grid: Grid, spec: PipelineSpec, is_dp: Array | None = None) -> int:
    """The first step whose DP collectives have not completed on every rank."""
    is_dp = _is_dp(ops, grid) if is_dp is None else is_dp
    if not is_dp.any():
        return spec.step_base
    seq, stp = ints(ops, "op_seq")[is_dp], ints(ops, "step", -1)[is_dp]
    k = np.where(stp >= 0, stp, seq // spec.dp_ops_per_step + spec.step_base)
    fin = ints(ops, "t_end")[is_dp] > 0
    last = np.full(grid.world, spec.step_base - 1)
    np.maximum.at(last, ints(ops, "rank")[is_dp][fin], k[fin])
    return int(last.min()) + 1


def halt_point(ops: Columns, grid: Grid, spec: PipelineSpec, now_ns: int,
               step: int | None = None, stuck_ns: int | None = None) -> list[Finding]:
    """Halt point(s) of the hung step; see the module docstring. With `stuck_ns`, the calls
    visible at `now_ns` are those the ranks had reached (last_logs.reached: not a call whose
    kernel was still waiting to start), as for Alg. 2."""
    seen = reached(ops, now_ns, stuck_ns) if stuck_ns is not None \
        else ints(ops, "t_enqueue") <= now_ns
    uniq, inv = codes(col(ops, "comm_id"))  # the whole column's codes (factorized once)
    if seen.all():  # the usual case (now = the window's end): no copy of the table
        visible = {k: np.asarray(v) for k, v in ops.items()}
        comm_codes = (uniq, inv)
    else:
        visible = {k: np.asarray(v)[seen] for k, v in ops.items()}
        comm_codes = (uniq, inv[seen])
    visible["t_end"] = np.where(visible["t_end"] > now_ns, 0, visible["t_end"])
    is_dp = _is_dp(visible, grid, comm_codes)
    k = hung_step(visible, grid, spec, is_dp) if step is None else step
    entered, done = _dp_entered(visible, grid, spec, k, is_dp)
    rg = grid.replica_grid()
    waiting = [d for d in range(grid.dp) if entered[rg[d]].all()]
    comms = (grid.comm_of("pp"), grid.comm_of("tp"))
    examined = [d for d in range(grid.dp) if d not in waiting]
    # the per-rank pass reconstruction reads the examined replicas' rows only
    index = OpsIndex(visible, comm_codes, rg[examined].reshape(-1)) if examined else None
    out = [f for d in examined
           for f in [_replica_halt(visible, grid, spec, k, d, rg, comms, waiting, index)]
           if f is not None]
    if out and len(waiting) == 0 and all(f.evidence["started"] is False for f in out):
        # no replica issued any op of step k: the job stopped between steps (optimizer,
        # callbacks or the first batch's data) — the ops cannot say which
        return [Finding(rule="venustrace.halt_point", culprit_ranks=(), stage="between_steps",
                        component=None, score=0.2, labels=("halt_point", "no_ops_in_step"),
                        kind="hang", evidence={"step": k})]
    if not out and grid.dp > 1 and not done.all():
        out.append(Finding(rule="venustrace.halt_point", culprit_ranks=(), stage="dp_allreduce",
                           component=None, score=0.5, labels=("halt_point", "all_replicas_in_dp"),
                           kind="hang", evidence={"step": k, "see": "mycroft.alg2.min_data",
                                                  "waiting_replicas": waiting[:64]}))
    return out


def _replica_halt(ops: Columns, grid: Grid, spec: PipelineSpec, step: int, d: int,
                  rg: Array, comms: tuple[Array, Array], waiting: list[int],
                  index: OpsIndex | None = None) -> Finding | None:
    m_n, pp = spec.microbatches, spec.pp
    complete = np.ones((pp, grid.tp, 2, m_n), dtype=bool)
    ready = np.zeros((pp, 2, m_n), dtype=np.int64)
    calls = np.zeros((pp, grid.tp, 2, m_n), dtype=np.int64)
    for s in range(pp):
        for t in range(grid.tp):
            r = int(rg[d, s, t])
            if r < 0:
                continue
            pt = pass_times(ops, spec, s, r, str(comms[0][r]), str(comms[1][r]) or None, step,
                            index)
            complete[s, t], calls[s, t] = pt.complete, pt.tp_calls
            ready[s] = np.maximum(ready[s], pt.ready)
    node_done = complete.all(axis=1).reshape(-1)  # [P·2·M] in DAG node order
    dag = build_1f1b_dag(np.zeros((pp, 2, m_n)))
    npass = pp * 2 * m_n
    frontier = [i for i in range(npass) if not node_done[i]
                and all(node_done[p] for p in dag.preds[i] if p < npass)]
    if not frontier:
        return None
    flat_ready = ready.reshape(-1)
    frontier.sort(key=lambda i: (flat_ready[i] == 0, flat_ready[i], i))
    i = frontier[0]
    s, rest = divmod(i, 2 * m_n)
    kind, m = divmod(rest, m_n)
    done_t = complete[s, :, kind, m]
    calls_t = calls[s, :, kind, m]
    ranks_t = rg[d, s]
    labels = ["halt_point"]
    if done_t.any():
        culprit = ranks_t[~done_t]
    elif spec.tp_ops_per_pass > 0 and calls_t.min() < calls_t.max():
        culprit = ranks_t[calls_t == calls_t.min()]
        labels.append("min_tp_calls")
    else:
        culprit = ranks_t
    stage, comp = dag.label(i), "gpu_compute"
    culprit_calls = calls_t[np.isin(ranks_t, culprit)]
    if kind == 0 and s == 0:
        if spec.tp_ops_per_pass == 0:
            labels.append("data_or_fwd")
        elif culprit_calls.max(initial=0) == 0:
            labels += ["no_tp_calls_in_pass", "data_or_fwd"]
            if m == 0 or calls_t.max() == 0:
                stage, comp = "data", "data_loader"
    if spec.tp_ops_per_pass == 0 and ((kind == 0 and s == pp - 1) or (kind == 1 and s == 0)):
        labels.append("ambiguous_fwd_bwd")
    component: Component = "data_loader" if comp == "data_loader" else "gpu_compute"
    return Finding(
        rule="venustrace.halt_point", culprit_ranks=tuple(sorted(int(r) for r in culprit)),
        stage=stage, component=component, score=1.0, labels=tuple(labels), kind="hang",
        onset_ns=int(flat_ready[i]) or None,
        evidence={"replica": d, "step": step, "node": dag.label(i),
                  "frontier": [dag.label(j) for j in frontier][:16],
                  "tp_calls": calls_t.tolist(), "completed_passes": int(node_done.sum()),
                  "passes": npass, "waiting_replicas": waiting[:64],
                  "started": bool(node_done.any() or calls.any() or ready.any())},
    )
