"""ARGUS L2 (§6.1, Appendix B eq. 5, Table 3): dispersion of per-rank phase times per group.

For one event (a semantic phase such as a stage of the `stages` record) and every group G of the
parallel dimension its route names, with x̄_r the rank's mean duration over the window:
μ_G = mean, σ_G = sample std (ddof = 1), CV = σ_G/μ_G graded balanced (< 0.02), mild
(0.02 ≤ CV < 0.05) or severe (≥ 0.05), and z_r = (x̄_r − μ_G)/σ_G (eq. 5). All groups of one event
are computed together on a padded (groups × members) array.

Stragglers. The paper flags z_r above "the threshold" without a value. Two weaknesses are fixed:
- with ddof = 1 the largest attainable z in a group of m is (m−1)/√m (2.47 for m = 8, 0.71 for
  m = 2), so a fixed z = 3 can never fire in small groups; the z threshold used is
  min(`z_threshold`, `z_attainable`·(m−1)/√m);
- two stragglers in one small group inflate σ_G and hide each other; a rank is also flagged when
  its robust z, (x̄_r − median)/(1.4826·MAD), is ≥ `robust_z` (3.5, Iglewicz–Hoaglin), with the MAD
  floored at `mad_floor`·median so identical peers do not make every tiny difference infinite.
Either way a group must be at least mildly imbalanced (CV ≥ 0.02) before any rank is flagged.

Routing table (Table 3, extended to rankwatch's six stages). Each event names the group it is
compared in, its class and the component a straggler points to. Compute events are compared in
the group whose members do identical work (DP group; EP group for MoE experts) and a slow rank
is a GPU-compute suspect (Table 6). Communication events need the paper's extra "self or peer"
check, which it leaves undescribed; we use the arrival-skew reading of its Case 5: in a
synchronizing collective every member finishes together, so the member that arrives last waits
least. A low outlier (z ≤ −threshold) on a communication event is therefore the late arriver and
the culprit (component unknown at L2; next check: its compute events), and high outliers are
reported as waiters, not culprits. A rank that is a straggler on every routed compute and host
event of the window points to its host CPU (Table 6, "CPU contention"): component host_software.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from diagnosis.rules.base import Component, Finding
from ingest.records import CommKind

EventClass = Literal["compute", "comm", "host", "data", "mixed"]
LEVELS = ("balanced", "mild", "severe")


@dataclass(frozen=True)
class Route:
    group: CommKind
    event_class: EventClass
    component: Component | None
    next_check: str


_L3 = "argus.l3 on the rank's compute kernels"
_L5 = "CPU call stacks of the rank (ARGUS L5)"
_COMM = "compute events of the late rank; argus.l3 on communication kernels"
ROUTES: dict[str, Route] = {
    # ARGUS Table 3
    "self_attention": Route("dp", "compute", "gpu_compute", _L3),
    "gated_mla_self_attention": Route("dp", "compute", "gpu_compute", _L3),
    "moe_layer": Route("ep", "compute", "gpu_compute", _L3 + "; expert load balance"),
    "moe_experts": Route("ep", "compute", "gpu_compute", _L3 + "; expert load balance"),
    "dp-allreduce": Route("dp", "comm", None, _COMM),
    "dp-reduce-scatter": Route("dp", "comm", None, _COMM),
    "ep-alltoall": Route("ep", "comm", None, _COMM),
    # the stages record (StageFrontier's six stages); backward carries DDP's exposed comm waits
    "data_next_wait": Route("dp", "data", "data_loader", _L5),
    "model_fwd_loss": Route("dp", "compute", "gpu_compute", _L3),
    "model_backward": Route("dp", "mixed", "gpu_compute", _L3 + "; stagefrontier for waits"),
    "callbacks": Route("dp", "host", "host_software", _L5),
    "optim_step": Route("dp", "compute", "gpu_compute", _L3),
    "step_other": Route("dp", "host", "host_software", _L5),
}


@dataclass(frozen=True)
class L2Params:
    cv_mild: float = 0.02
    cv_severe: float = 0.05
    z_threshold: float = 3.0
    z_attainable: float = 0.8
    robust_z: float = 3.5
    mad_floor: float = 0.01


@dataclass(frozen=True)
class GroupStats:
    """Eq. 5 per group; padded member slots hold rank −1 and NaN z."""

    members: np.ndarray  # (G, M) int64
    mean: np.ndarray  # (G,)
    std: np.ndarray  # (G,)
    cv: np.ndarray  # (G,)
    level: np.ndarray  # (G,) index into LEVELS
    z: np.ndarray  # (G, M)
    robust_z: np.ndarray  # (G, M)
    z_limit: np.ndarray  # (G,) z threshold actually used


def _pad(groups: Sequence[npt.ArrayLike] | np.ndarray) -> np.ndarray:
    if isinstance(groups, np.ndarray) and groups.ndim == 2:
        return groups.astype(np.int64)
    rows = [np.asarray(g, dtype=np.int64).ravel() for g in groups]
    out = np.full((len(rows), max((r.size for r in rows), default=0)), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : r.size] = r
    return out


def group_dispersion(
    values: npt.ArrayLike,
    groups: Sequence[npt.ArrayLike] | np.ndarray,
    params: L2Params = L2Params(),
) -> GroupStats:
    """CV and z-scores of `values` (per rank, (R,) or (steps, R) averaged) within each group."""
    v = np.asarray(values, dtype=np.float64)
    xbar = np.nanmean(v, axis=0) if v.ndim == 2 else v
    members = _pad(groups)
    ok = members >= 0
    x = np.where(ok, xbar[np.where(ok, members, 0)], np.nan)
    m = ok.sum(axis=1).astype(np.float64)
    mean = np.nansum(x, axis=1) / np.maximum(m, 1)
    dev = x - mean[:, None]
    std = np.sqrt(np.nansum(dev * dev, axis=1) / np.maximum(m - 1, 1))
    cv = np.divide(std, mean, out=np.zeros_like(std), where=mean > 0)
    level = (cv >= params.cv_mild).astype(np.int64) + (cv >= params.cv_severe)
    z = np.divide(dev, std[:, None], out=np.zeros_like(dev), where=std[:, None] > 0)
    med = np.nanmedian(np.where(ok, x, np.nan), axis=1) if x.size else np.zeros(len(m))
    mad = np.nanmedian(np.abs(x - med[:, None]), axis=1) if x.size else np.zeros(len(m))
    scale = 1.4826 * np.maximum(mad, params.mad_floor * np.abs(med))
    rz = np.divide(x - med[:, None], scale[:, None], out=np.zeros_like(x), where=scale[:, None] > 0)
    z_limit = np.minimum(
        params.z_threshold, params.z_attainable * (m - 1) / np.sqrt(np.maximum(m, 1))
    )
    return GroupStats(
        members, mean, std, cv, level, np.where(ok, z, np.nan), np.where(ok, rz, np.nan), z_limit
    )


def outliers(stats: GroupStats, params: L2Params = L2Params(), high: bool = True) -> np.ndarray:
    """(G, M) mask of high (or low) outliers in groups that are at least mildly imbalanced."""
    sign = 1.0 if high else -1.0
    z = np.nan_to_num(sign * stats.z, nan=-np.inf)
    rz = np.nan_to_num(sign * stats.robust_z, nan=-np.inf)
    flagged = (z >= stats.z_limit[:, None]) | (rz >= params.robust_z)
    return np.asarray(flagged & (stats.level >= 1)[:, None] & (stats.members >= 0))


def findings(
    events: Mapping[str, npt.ArrayLike],
    groups: Mapping[str, Sequence[npt.ArrayLike] | np.ndarray],
    routes: Mapping[str, Route] = ROUTES,
    params: L2Params = L2Params(),
) -> list[Finding]:
    """One finding per (event, group) with culprits; events without a route or group are skipped.

    `events[name]` is per-rank durations indexed by rank id, (R,) or (steps, R);
    `groups[kind]` lists each group's member ranks. Score is the group's CV.
    """
    out: list[Finding] = []
    slow_on: dict[int, set[str]] = {}
    routed: set[str] = set()
    for name, values in events.items():
        route = routes.get(name)
        if route is None or route.group not in groups:
            continue
        stats = group_dispersion(values, groups[route.group], params)
        late = route.event_class == "comm"
        culprit = outliers(stats, params, high=not late)
        if route.event_class in ("compute", "host", "data", "mixed"):
            routed.add(name)
            for r in stats.members[culprit].tolist():
                slow_on.setdefault(r, set()).add(name)
        for g in np.flatnonzero(culprit.any(axis=1)).tolist():
            ranks = tuple(sorted(stats.members[g][culprit[g]].tolist()))
            waiters = (
                stats.members[g][outliers(stats, params, high=True)[g]].tolist() if late else []
            )
            out.append(
                Finding(
                    rule="argus.l2",
                    culprit_ranks=ranks,
                    stage=name,
                    component=route.component,
                    score=float(stats.cv[g]),
                    labels=(LEVELS[int(stats.level[g])], "late_arrival" if late else "straggler"),
                    kind="slowdown",
                    evidence={
                        "group_kind": route.group,
                        "group_index": g,
                        "group_mean": float(stats.mean[g]),
                        "cv": float(stats.cv[g]),
                        "z": {r: float(stats.z[g][stats.members[g] == r][0]) for r in ranks},
                        "z_limit": float(stats.z_limit[g]),
                        "waiters": sorted(waiters),
                        "next_check": route.next_check,
                    },
                )
            )
    return _host_contention(out, slow_on, routed)


def _host_contention(
    out: list[Finding], slow_on: dict[int, set[str]], routed: set[str]
) -> list[Finding]:
    """Ranks slow on every routed non-comm event (≥ 3 of them) point to host CPU contention."""
    if len(routed) < 3:
        return out
    everywhere = tuple(sorted(r for r, names in slow_on.items() if names >= routed))
    if not everywhere:
        return out
    out.append(
        Finding(
            rule="argus.l2",
            culprit_ranks=everywhere,
            stage=None,
            component="host_software",
            score=1.0,
            labels=("all_phases_slow",),
            kind="slowdown",
            evidence={"events": sorted(routed), "next_check": _L5},
        )
    )
    return out
