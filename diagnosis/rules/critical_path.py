"""Critical path on the per-step 1F1B DAG and slowdown localization (VenusTrace §3.3, Alg. 2,
App. A Alg. 3; MegaTrace §III-C "Locate slowdown issue", Fig. 6 — VenusTrace's Fig. 7).

DAG of one pipeline replica for one step (`build_1f1b_dag`): a node per pass F/B of microbatch m
on stage s, weighted by its duration, and one DP-AllReduce node per stage at the end. Edges: the
stage's own 1F1B order (pipeline_ops.stage_order), F(s−1, m) → F(s, m), B(s+1, m) → B(s, m),
F(P−1, m) → B(P−1, m), and B(s, last) → AR(s). Bubbles are not nodes: they are the slack.

`critical_path` is Alg. 3: earliest start EST_i = max over predecessors of EFT_j (the paper's
line 3 reads max(EST_j, EFT_j), which equals max EFT_j since EFT ≥ EST), EFT = EST + t; latest
finish of sinks = makespan, LST_i = min over successors of LST_j − t_i; slack = LST − EST; nodes
with zero slack (up to 1e-9 of the makespan) are critical, and one zero-slack chain from a source
to the last sink is returned as `path` — its length equals the makespan.

`analyze_slowdown` follows Alg. 2's manager thread:
1. restrict to the slowest PP group (replica): the largest Σ of its node durations (Alg. 2 line
   18; MegaTrace: the straggler replica dictates the step through DP synchronization);
2. a TP group works as a whole, so a node's duration is the max over its TP ranks; an AR node's
   duration is the smallest time any DP member spent in the AllReduce (the last arriver's time
   is the transfer itself; the others' include waiting for the slow replica — waiting is not
   the AllReduce's cost);
3. flag critical nodes slower than expected by β (T_v > (1 + β)·T_expected, β = 50 %); the
   expectation is learned per (stage, pass, microbatch) from the median over replicas each step
   with `diagnosis.expectation.Expectation` (from the second step on, within α) — the median
   keeps one slow replica from teaching the expectation its slowness;
4. drill down (Alg. 2 line 26, "the slowest call" in the TP group): TP ranks synchronize in
   every TP collective, so their pass times are nearly equal and the slow rank shows up as the
   one that waits *least* inside the pass's TP collectives (`tp_wait`, one host's clock). It is
   the culprit when its peers' median wait exceeds its own by at least half the node's excess
   over expectation; without `tp_wait`, the rank with the longest pass time is the culprit when
   it exceeds its peers' median by β. Otherwise the whole TP group is reported (label
   "tp_group_uniform": host- or stage-wide). A flagged AR node reports the DP group with
   component nic_rdma (label "dp_group"), for the flow rules to narrow down.
Slowed nodes off the critical path are listed as "absorbed" (Fig. 7's S1, S2, S4).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from diagnosis.expectation import Expectation
from diagnosis.groups import Grid
from diagnosis.rules.base import Finding
from diagnosis.rules.pipeline_ops import stage_order

Array = np.ndarray


@dataclass(frozen=True)
class Dag:
    """Nodes 0..P·2·M−1 are passes, id = (s·2 + kind)·M + m (kind 0 = F, 1 = B); then P AR."""

    pp: int
    microbatches: int
    duration: Array  # float64 [n_nodes]
    preds: tuple[tuple[int, ...], ...]

    @property
    def n(self) -> int:
        return int(self.duration.size)

    def node(self, s: int, kind: int, m: int) -> int:
        return int((s * 2 + kind) * self.microbatches + m)

    def label(self, i: int) -> str:
        """"fwd mb=3 pp=1" for passes, "dp_allreduce pp=2" for the AR node of stage 2."""
        npass = self.pp * 2 * self.microbatches
        if i >= npass:
            return f"dp_allreduce pp={i - npass}"
        s, rest = divmod(i, 2 * self.microbatches)
        kind, m = divmod(rest, self.microbatches)
        return f"{'fwd' if kind == 0 else 'bwd'} mb={m} pp={s}"


def build_1f1b_dag(durations: Array, allreduce: Array | None = None) -> Dag:
    """DAG of one replica's step from pass durations [P, 2, M] and optional AR durations [P]."""
    d = np.asarray(durations, dtype=np.float64)
    pp, _, m_n = (int(x) for x in d.shape)
    ar = np.zeros(pp) if allreduce is None else np.asarray(allreduce, dtype=np.float64)
    preds: list[set[int]] = [set() for _ in range(pp * 2 * m_n + pp)]

    def nid(s: int, k: int, m: int) -> int:
        return (s * 2 + k) * m_n + m

    for s in range(pp):
        order = [nid(s, 0 if k == "F" else 1, m) for k, m in stage_order(pp, m_n, s)]
        for a, b in pairwise(order):
            preds[b].add(a)
        preds[pp * 2 * m_n + s].add(order[-1])
        for m in range(m_n):
            if s > 0:
                preds[nid(s, 0, m)].add(nid(s - 1, 0, m))
            if s < pp - 1:
                preds[nid(s, 1, m)].add(nid(s + 1, 1, m))
            else:
                preds[nid(s, 1, m)].add(nid(s, 0, m))
    dur = np.concatenate([d.reshape(-1), ar])
    return Dag(pp, m_n, dur, tuple(tuple(sorted(p)) for p in preds))


@dataclass(frozen=True)
class CriticalPath:
    est: Array
    eft: Array
    lst: Array
    lft: Array
    slack: Array
    critical: Array  # bool per node
    path: tuple[int, ...]  # one zero-slack chain, source → sink
    makespan: float


def _topo(dag: Dag) -> tuple[list[int], list[list[int]]]:
    succ: list[list[int]] = [[] for _ in range(dag.n)]
    indeg = np.zeros(dag.n, dtype=np.int64)
    for i, ps in enumerate(dag.preds):
        indeg[i] = len(ps)
        for p in ps:
            succ[p].append(i)
    q = deque(int(i) for i in np.flatnonzero(indeg == 0))
    order: list[int] = []
    while q:
        i = q.popleft()
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                q.append(j)
    if len(order) != dag.n:
        raise ValueError("1F1B graph has a cycle")
    return order, succ


def critical_path(dag: Dag) -> CriticalPath:
    """Alg. 3 (App. A): forward and backward passes over a topological order."""
    order, succ = _topo(dag)
    t = np.nan_to_num(dag.duration, nan=0.0)
    est = np.zeros(dag.n)
    for i in order:
        if dag.preds[i]:
            est[i] = max(est[p] + t[p] for p in dag.preds[i])
    eft = est + t
    makespan = float(eft.max()) if dag.n else 0.0
    lft = np.full(dag.n, makespan)
    for i in reversed(order):
        if succ[i]:
            lft[i] = min(lft[j] - t[j] for j in succ[i])
    lst = lft - t
    slack = lst - est
    tol = 1e-9 * max(makespan, 1.0)
    critical = slack <= tol
    end = max((i for i in range(dag.n) if critical[i]), key=lambda i: eft[i], default=-1)
    path: list[int] = []
    while end >= 0:
        path.append(end)
        nxt = [p for p in dag.preds[end] if critical[p] and abs(eft[p] - est[end]) <= tol]
        end = max(nxt, key=lambda p: t[p]) if nxt else -1
    return CriticalPath(est, eft, lst, lft, slack, critical, tuple(reversed(path)), makespan)


def update_expected(expected: Expectation, durations: Array) -> None:
    """Fold one step into the per-node expectation: median over replicas of the TP-max duration.
    `durations` is [D, P, T, 2, M] (nan for unobserved); `expected.shape` must be (P, 2, M)."""
    group = np.nanmax(np.asarray(durations, dtype=np.float64), axis=2)
    with np.errstate(all="ignore"):
        expected.update(np.nanmedian(group, axis=0))


def analyze_slowdown(durations: Array, expected: Expectation, grid: Grid, *,
                     allreduce: Array | None = None, expected_ar: Expectation | None = None,
                     tp_wait: Array | None = None, beta: float = 0.5,
                     step: int = -1) -> list[Finding]:
    """Alg. 2 manager thread for one step. durations [D, P, T, 2, M] ns per rank and pass (nan
    where unknown); allreduce [D, P, T] ns per rank in the DP AllReduce; tp_wait [D, P, T, 2, M]
    ns each rank spent inside the pass's TP collectives; see module docstring."""
    dur = np.asarray(durations, dtype=np.float64)
    group = np.nanmax(np.where(np.isnan(dur), -np.inf, dur), axis=2)
    group = np.where(np.isfinite(group), group, np.nan)
    d_star = int(np.argmax(np.nansum(group, axis=(1, 2, 3))))
    ar_group = None
    if allreduce is not None:
        ar = np.asarray(allreduce, dtype=np.float64)
        ar_group = np.nanmax(np.nanmin(ar, axis=0), axis=1)  # [P]: transfer time per stage
    dag = build_1f1b_dag(group[d_star], ar_group)
    cp = critical_path(dag)
    npass = dag.pp * 2 * dag.microbatches
    exp = np.concatenate([expected.value.reshape(-1), np.full(dag.pp, np.nan) if expected_ar is
                          None else np.asarray(expected_ar.value, dtype=np.float64).reshape(-1)])
    with np.errstate(invalid="ignore"):
        slow = dag.duration > (1 + beta) * exp
    flagged = [i for i in cp.path if slow[i]]
    absorbed = [dag.label(i) for i in np.flatnonzero(slow & ~cp.critical).tolist()]
    out: list[Finding] = []
    for i in flagged:
        ev: dict[str, object] = {
            "replica": d_star, "node": dag.label(i), "duration_ns": float(dag.duration[i]),
            "expected_ns": float(exp[i]), "beta": beta, "makespan_ns": cp.makespan,
            "critical_path": [dag.label(j) for j in cp.path][:64], "absorbed": absorbed[:32],
            "step": step,
        }
        score = float(dag.duration[i] / exp[i] - 1)
        if i >= npass:
            s = i - npass
            ranks = tuple(sorted(int(r) for r in np.flatnonzero(grid.stage == s)))
            out.append(Finding(rule="venustrace.critical_path", culprit_ranks=ranks,
                               stage="dp_allreduce", component="nic_rdma", score=score,
                               labels=("critical_path", "dp_group"), kind="slowdown", evidence=ev))
            continue
        s, rest = divmod(i, 2 * dag.microbatches)
        k, m = divmod(rest, dag.microbatches)
        per_rank = dur[d_star, s, :, k, m]
        ranks_tp = [grid.rank_at(d_star, s, t) for t in range(per_rank.size)]
        if tp_wait is not None and per_rank.size > 1:
            # TP ranks wait for each other, so their pass times match; the slow one waits least
            w = np.asarray(tp_wait, dtype=np.float64)[d_star, s, :, k, m]
            t_star = int(np.nanargmin(w))
            excess = float(dag.duration[i] - exp[i])
            single = bool(np.nanmedian(np.delete(w, t_star)) - w[t_star] >= 0.5 * excess)
            ev["tp_wait_ns"] = [None if np.isnan(x) else float(x) for x in w]
        else:
            t_star = int(np.nanargmax(per_rank))
            others = np.delete(per_rank, t_star)
            single = others.size == 0 or bool(
                per_rank[t_star] > (1 + beta) * np.nanmedian(others))
        ev["tp_durations_ns"] = [None if np.isnan(x) else float(x) for x in per_rank]
        out.append(Finding(
            rule="venustrace.critical_path", kind="slowdown", stage=dag.label(i),
            culprit_ranks=(ranks_tp[t_star],) if single else tuple(sorted(ranks_tp)),
            component="gpu_compute", score=score,
            labels=("critical_path",) if single else ("critical_path", "tp_group_uniform"),
            evidence=ev,
        ))
    return sorted(out, key=lambda f: -f.score)
