"""A tiny 1F1B op generator following diagnosis.rules.pipeline_ops' mapping, with a hang option.

Timing comes from the critical-path engine itself (EST/EFT of each pass with uniform F/B
durations), so ops are consistent with the DAG by construction. Used by the halt-point and
pipeline-ops tests; not a simulator (ingest/sim is).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnosis.groups import Grid, grid_of
from diagnosis.rules.critical_path import build_1f1b_dag, critical_path
from diagnosis.rules.pipeline_ops import PipelineSpec, pp_plan, stage_order
from ingest.units import MILLISECOND as MS
from tests.unit.topo_fixtures import megatron_topology

F_NS, B_NS = 10 * MS, 20 * MS


@dataclass(frozen=True)
class Hang:
    step: int
    replica: int
    stage: int
    kind: int  # 0 = F, 1 = B
    mb: int
    tp_rank: int  # the TP rank that stops; -1: all stop before their first TP call
    calls_done: int  # TP calls of the pass it completed before stopping


def _descendants(preds: tuple[tuple[int, ...], ...], start: int) -> set[int]:
    succ: dict[int, list[int]] = {}
    for i, ps in enumerate(preds):
        for p in ps:
            succ.setdefault(p, []).append(i)
    out, todo = {start}, [start]
    while todo:
        for j in succ.get(todo.pop(), []):
            if j not in out:
                out.add(j)
                todo.append(j)
    return out


def generate(tp: int, pp: int, dp: int, m_n: int, k_tp: int, steps: int,
             hang: Hang | None = None, with_step: bool = False
             ) -> tuple[dict[str, np.ndarray], Grid, PipelineSpec]:
    grid = grid_of(megatron_topology(tp, pp, dp, microbatches=m_n))
    spec = PipelineSpec(pp=pp, microbatches=m_n, tp_ops_per_pass=k_tp)
    d = np.zeros((pp, 2, m_n))
    d[:, 0], d[:, 1] = F_NS, B_NS
    dag = build_1f1b_dag(d)
    cp = critical_path(dag)
    period = int(cp.makespan) + 50 * MS
    rows: list[tuple[int, str, int, str, int, int, int, int, int]] = []
    pp_of, tp_of, dp_of = grid.comm_of("pp"), grid.comm_of("tp"), grid.comm_of("dp")
    rg = grid.replica_grid()
    for k in range(steps):
        base = k * period
        for dd in range(dp):
            hung = hang is not None and hang.step == k and hang.replica == dd
            blocked = _descendants(dag.preds, dag.node(hang.stage, hang.kind, hang.mb)) \
                if hung and hang is not None else set()
            for s in range(pp):
                order = stage_order(pp, m_n, s)
                plan = pp_plan(pp, m_n, s)
                for t in range(tp):
                    r = int(rg[dd, s, t])
                    j = 0
                    prev_end = base
                    stopped = False
                    for p, (kind, m) in enumerate(order):
                        ki = 0 if kind == "F" else 1
                        i = dag.node(s, ki, m)
                        is_hung = hang is not None and hung and i == dag.node(
                            hang.stage, hang.kind, hang.mb)
                        if i in blocked and not is_hung:
                            stopped = True
                            break
                        est, eft = base + int(cp.est[i]), base + int(cp.eft[i])
                        if j < len(plan) and plan[j][0] == "Recv":
                            rows.append((r, str(pp_of[r]), k * len(plan) + j, "Recv",
                                         prev_end, prev_end, est, k, -1))
                            j += 1
                        n_calls = k_tp
                        if is_hung and hang is not None:
                            n_calls = hang.calls_done
                        for c in range(n_calls):
                            tc = est + (c + 1) * (eft - est) // max(k_tp, 1)
                            rows.append((r, str(tp_of[r]), (k * len(order) + p) * k_tp + c,
                                         "AllReduce", tc, tc, tc + 1000, k, -1))
                        if is_hung and hang is not None:
                            if hang.tp_rank >= 0 and t != hang.tp_rank and n_calls < k_tp:
                                tc = est + (n_calls + 1) * (eft - est) // max(k_tp, 1)
                                rows.append((r, str(tp_of[r]), (k * len(order) + p) * k_tp
                                             + n_calls, "AllReduce", tc, tc, 0, k, -1))
                            stopped = True
                            break
                        if j < len(plan) and plan[j][0] == "Send":
                            rows.append((r, str(pp_of[r]), k * len(plan) + j, "Send",
                                         eft, eft, eft + MS, k, -1))
                            j += 1
                        prev_end = eft
                    if not stopped and dp > 1:
                        end = 0 if hang is not None and hang.step == k else base + period - MS
                        rows.append((r, str(dp_of[r]), k, "AllReduce", prev_end, prev_end, end,
                                     k, -1))
    names = ("rank", "comm_id", "op_seq", "op", "t_enqueue", "t_start", "t_end", "step", "peer")
    cols = {n: np.asarray([row[i] for row in rows],
                          dtype=object if n in ("comm_id", "op") else np.int64)
            for i, n in enumerate(names)}
    if not with_step:
        cols["step"] = np.full(len(rows), -1, dtype=np.int64)
    return cols, grid, spec
