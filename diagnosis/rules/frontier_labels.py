"""StageFrontier evidence labels and routing over a window (§4 Table 2, Appendices B/C, §6.2).

`diagnose` runs `frontier` accounting on a (steps × ranks × stages) window and applies the
labeler. Labels (§4 Table 2, Appendix B/C, defaults of Table 13): always `frontier_accounting`;
`telemetry_limited` when one rank only (no cross-rank evidence), missing rank-steps (NaN rows,
charged as zero), closure residual share > 0.05 (Σ step_other / Σ totals; with `step_wall`,
Σ max(0, e)/Σ wall for the signed closure error e of Appendix A) or overlap error share
Σ max(0, −e)/Σ wall > 0.01; `role_aware_needed` when `roles` holds more than one role; both
suppress the strong labels. With A_s1 > γA = 0.4: `direct_exposure` if G_s1 ≥ γG = 0.1, else
`sync_wait_dependent` if the caller's model-fit indicator W_s1 is set, else `co_critical` (the
paper's safe default W = 0). `co_critical` is also emitted for share ties (A_s1 − A_s2 ≤ ηA =
0.05), gain ties among gains ≥ γG (ηG = 0.05), and leader switching: the unique leader rank at the
s1 boundary is "confident" when its margin over the runner-up is ≥ ηQ·F[t,S] (ηQ = 0.05, our
value; the paper names but does not publish it), and a switch rate > 0.5 over ≥ 50 % confident
steps downgrades. The ambiguity set `co_critical_stages` is C_A ∪ C_G (stages within ηA of the top
share, within ηG of the top gain ≥ γG) and, doing better than the paper's recipe on its own sharp
case r0 = (10, 0), r1 = (0, 10), C_M: stages whose per-stage-max share Σ_t max_r d / Σ_t F[t,S]
is within ηA of A_s1 — an independent path as long as the frontier's leading advance — which
yields the paper's {data, backward} there.

Culprit ranks: the ranks holding at least half of the largest blame (frontier time charged to a
rank, `frontier.blame`) at the top-1 stage. The paper reports the latest-rank tie set per step;
aggregating the charged time over the window is our choice, so a rank that leads on many steps
outranks one that led once. `routing_hit` scores a known injected stage the way §6.2 does
(top-1 match, top-2 routing, candidate hit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from diagnosis.rules.base import Component, Finding
from diagnosis.rules.frontier import (
    STAGES,
    Baseline,
    FrontierAccount,
    account,
    blame,
    candidate_set,
    direct_exposure,
    ranking,
    shares,
)

#: Component a leading stage points to; None where the broad stage cannot tell (§6.6).
STAGE_COMPONENT: dict[str, Component | None] = {
    "data_next_wait": "data_loader",
    "model_fwd_loss": None,
    "model_backward": None,
    "callbacks": "host_software",
    "optim_step": None,
    "step_other": "host_software",
}


@dataclass(frozen=True)
class FrontierThresholds:
    """Appendix C, Table 13 defaults; eta_q/switch_rate/eligible are ours (unpublished)."""

    tau_c: float = 0.80
    gamma_a: float = 0.4
    gamma_g: float = 0.1
    eta_a: float = 0.05
    eta_g: float = 0.05
    eta_q: float = 0.05
    switch_rate: float = 0.5
    eligible: float = 0.5
    closure_residual: float = 0.05
    overlap_error: float = 0.01
    tie_rtol: float = 1e-9


@dataclass(frozen=True)
class FrontierReport:
    """Window-level result of `diagnose`; stage indices refer to `stage_names`."""

    stage_names: tuple[str, ...]
    shares: np.ndarray  # (S,) A_s
    gains: np.ndarray  # (S,) G_s
    ranking: tuple[int, ...]  # stages by share, descending
    candidates: tuple[int, ...]  # routing set at tau_c
    co_critical_stages: tuple[int, ...]
    labels: tuple[str, ...]
    blame: np.ndarray  # (R, S) exposed time charged to each rank and stage
    culprit_ranks: tuple[int, ...]
    switch_rate: float
    reasons: tuple[str, ...] = ()
    evidence: dict[str, float] = field(default_factory=dict)

    @property
    def top1(self) -> str:
        return self.stage_names[self.ranking[0]]

    @property
    def top2(self) -> tuple[str, ...]:
        return tuple(self.stage_names[i] for i in self.ranking[:2])


def _switch_rate(acct: FrontierAccount, s1: int, eta_q: float, eligible: float) -> float:
    """Leader switches at boundary s1 between confident unique leaders (Appendix C)."""
    p = acct.prefix[:, :, s1].astype(np.float64)
    if p.shape[1] < 2:
        return 0.0
    top2 = -np.sort(-p, axis=1)[:, :2]
    confident = (top2[:, 0] - top2[:, 1]) >= eta_q * acct.exposed.astype(np.float64)
    confident &= acct.advance[:, s1] > 0
    leaders = p.argmax(axis=1)[confident]
    if leaders.size < 2 or confident.mean() < eligible:
        return 0.0
    return float(np.count_nonzero(np.diff(leaders)) / (leaders.size - 1))


def _telemetry(
    d: np.ndarray,
    missing: np.ndarray,
    stage_names: tuple[str, ...],
    step_wall: npt.ArrayLike | None,
    th: FrontierThresholds,
) -> tuple[list[str], float, float]:
    """Appendix A/C telemetry gates: reasons, closure residual share, overlap error share."""
    residual_share = overlap_share = 0.0
    if step_wall is not None:
        wall = np.asarray(step_wall, dtype=np.float64).reshape(d.shape[:2])
        error = wall - d[:, :, :-1].sum(axis=2)  # signed closure error e[t,r]
        denom = max(float(wall.sum()), 1e-300)
        residual_share = float(np.maximum(0.0, error).sum()) / denom
        overlap_share = float(np.maximum(0.0, -error).sum()) / denom
    elif stage_names[-1] == "step_other":
        residual_share = float(d[:, :, -1].sum()) / (float(d.sum()) or 1.0)
    reasons: list[str] = []
    if d.shape[1] < 2:
        reasons.append("single rank: no cross-rank evidence")
    if missing.any():
        reasons.append(f"{int(missing.sum())} missing rank-steps")
    if residual_share > th.closure_residual:
        reasons.append(f"closure residual share {residual_share:.3f} > {th.closure_residual}")
    if overlap_share > th.overlap_error:
        reasons.append(f"overlap error share {overlap_share:.3f} > {th.overlap_error}")
    return reasons, residual_share, overlap_share


def diagnose(
    durations: npt.ArrayLike,
    *,
    stage_names: tuple[str, ...] = STAGES,
    ranks: npt.ArrayLike | None = None,
    roles: npt.ArrayLike | None = None,
    step_wall: npt.ArrayLike | None = None,
    model_fit: npt.ArrayLike | None = None,
    baseline: Baseline = "cohort",
    thresholds: FrontierThresholds = FrontierThresholds(),
) -> FrontierReport:
    """Shares, gains, routing set and labels for one window of (N, R, S) stage durations.

    `ranks` names the R rows (default 0..R−1); `roles` gives each rank's parallel role;
    `step_wall` the (N, R) rank-local step wall time for the closure/overlap gates; `model_fit`
    the per-stage W_s indicator (default all 0). NaN rank-steps count as missing.
    """
    th = thresholds
    raw = np.asarray(durations)
    d = raw if raw.ndim == 3 else raw[None]
    missing = np.zeros(d.shape[:2], dtype=bool)
    if np.issubdtype(d.dtype, np.floating):
        missing = np.isnan(d).any(axis=2)
        d = np.where(missing[:, :, None], 0.0, d)
    if d.shape[2] != len(stage_names):
        raise ValueError(f"{d.shape[2]} stages given, {len(stage_names)} stage names")
    n_ranks = d.shape[1]
    role_arr = None if roles is None else np.asarray(roles)
    acct = account(d)
    share = shares(acct)
    gain = direct_exposure(d, baseline, role_arr)
    order = ranking(share)
    s1 = order[0]
    a1 = float(share[s1])
    a2 = float(share[order[1]]) if len(order) > 1 else 0.0
    fit = np.zeros(len(stage_names), bool) if model_fit is None else np.asarray(model_fit, bool)
    total = float(acct.exposed.sum())
    reasons, residual_share, overlap_share = _telemetry(d, missing, stage_names, step_wall, th)
    labels = ["frontier_accounting"]
    if reasons:
        labels.append("telemetry_limited")
    role_mixed = role_arr is not None and np.unique(role_arr).size > 1
    if role_mixed:
        labels.append("role_aware_needed")
        reasons.append("ranks have different parallel roles")
    strong_ok = not reasons and total > 0

    switch = _switch_rate(acct, s1, th.eta_q, th.eligible)
    gmax = float(gain.max())
    near_tie_a = len(order) > 1 and a1 - a2 <= th.eta_a and a1 > 0
    near_tie_g = gmax >= th.gamma_g and int(np.sum(gain >= gmax - th.eta_g)) > 1
    co_crit = near_tie_a or near_tie_g or switch > th.switch_rate
    if a1 > th.gamma_a and strong_ok:
        if gain[s1] >= th.gamma_g:
            labels.append("direct_exposure")
        elif fit[s1]:
            labels.append("sync_wait_dependent")
        else:
            co_crit = True
    ambiguity: tuple[int, ...] = ()
    if co_crit and total > 0:
        labels.append("co_critical")
        stage_max = d.max(axis=1).sum(axis=0) / total
        amb = (share >= a1 - th.eta_a) | (stage_max >= a1 - th.eta_a)
        if gmax >= th.gamma_g:
            amb |= gain >= gmax - th.eta_g
        ambiguity = tuple(i for i in order if amb[i])

    charged = blame(acct, th.tie_rtol)
    names = np.arange(n_ranks) if ranks is None else np.asarray(ranks)
    col = charged[:, s1]
    culprits = tuple(sorted(int(names[r]) for r in np.flatnonzero(col >= 0.5 * col.max())))
    p1 = acct.prefix[:, :, s1]
    evidence = {
        "exposed_total": total,
        "per_stage_max_total": float(d.max(axis=1).sum()),
        "per_stage_mean_total": float(d.mean(axis=1).sum()),
        "residual_share": residual_share,
        "overlap_share": overlap_share,
        "lag_top1": float((p1.max(axis=1) - np.median(p1, axis=1)).mean()),
    }
    return FrontierReport(
        stage_names=stage_names,
        shares=share,
        gains=gain,
        ranking=order,
        candidates=candidate_set(share, th.tau_c),
        co_critical_stages=ambiguity,
        labels=tuple(labels),
        blame=charged,
        culprit_ranks=culprits if total > 0 else (),
        switch_rate=switch,
        reasons=tuple(reasons),
        evidence=evidence,
    )


def routing_hit(report: FrontierReport, stage: str) -> tuple[bool, bool, bool]:
    """§6.2's scoring of an injected `stage`: (top-1 match, top-2 routing, candidate hit)."""
    i = report.stage_names.index(stage)
    return report.ranking[0] == i, i in report.ranking[:2], i in report.candidates


def findings(report: FrontierReport) -> list[Finding]:
    """One `Finding` naming the top-1 stage; score is its window share A_s1."""
    s1 = report.ranking[0]
    if report.shares[s1] <= 0:
        return []
    names = report.stage_names
    evidence: dict[str, object] = {
        "shares": dict(zip(names, report.shares.round(6).tolist(), strict=True)),
        "gains": dict(zip(names, report.gains.round(6).tolist(), strict=True)),
        "top2": list(report.top2),
        "candidates": [names[i] for i in report.candidates],
        "co_critical_stages": [names[i] for i in report.co_critical_stages],
        "switch_rate": report.switch_rate,
        "reasons": list(report.reasons),
        **report.evidence,
    }
    return [
        Finding(
            rule="stagefrontier",
            culprit_ranks=report.culprit_ranks,
            stage=names[s1],
            component=STAGE_COMPONENT.get(names[s1]),
            score=float(report.shares[s1]),
            labels=report.labels,
            kind="slowdown",
            evidence=evidence,
        )
    ]
