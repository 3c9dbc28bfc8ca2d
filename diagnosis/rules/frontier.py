"""StageFrontier: max-prefix frontier accounting of per-rank stage durations (§3, §4 eq. 4).

Input is the `stages` record (ingest/records.py) arranged as a (steps × ranks × stages) duration
array in the contract's six-stage order `STAGES`; a single step may be given as (ranks × stages).
Integer input (the contract's nanoseconds) is accounted in exact int64 arithmetic, so the
telescoping identity holds bit for bit; float input holds it to rounding.

Quantities (StageFrontier §3, eq. 1–3; §4, eq. 4); the labeler is `frontier_labels`:
- prefix  P[t,r,s] = Σ_{j≤s} d[t,r,j]; frontier F[t,s] = max_r P[t,r,s]; advance
  a[t,s] = F[t,s] − F[t,s−1] with F[t,0] = 0 (eq. 1). Theorem 1: Σ_s a[t,s] = F[t,S] = max_r of
  the rank totals.
- slack λ[t,r,s] = F[t,s−1] − P[t,r,s−1] ≥ 0 and the slack identity a[t,s] = max_r(d − λ) (eq. 3).
- window share A_s = Σ_t a[t,s] / Σ_t F[t,S] (eq. 2); ranking = stages by A_s, ties to the earlier
  stage; top-1/top-2 as in §6.2; routing candidates = shortest leading prefix whose cumulative
  share reaches τC = 0.80 (§4).
- direct-exposure gain G_s (eq. 4): replace stage s by the clipped baseline min(d, b̃) and recompute
  F[t,S]. Because only the rank totals change, F^(s←b)[t,S] = max_r(P[t,r,S] − (d − b)[t,r,s]),
  so all six gains cost one (N, R, S) pass. Baseline b̃ (the paper lists rank-window median,
  cohort median or a no-stall reference without fixing one): default "cohort" = the per-step
  median over ranks (over ranks of the same role when `roles` is given), because a rank that is
  slow on every step of the window is invisible to its own window median; "rank" and "min"
  (the lower of both) are available, or pass an array.
- blame: each advance a[t,s] is charged to the ranks attaining F[t,s] (Fig. 2), split evenly over
  ties (exact for integer input, within `tie_rtol`·F[t,S] for float); blame sums to Σ_t F[t,S].

Pure waiting (the property the tests check): a host-visible wait added to rank r at stage s is
"pure" when it fits inside r's slack at every later boundary, i.e. P[t,r,j] + δ < F[t,j] for all
j ≥ s; a rank cannot wait past the moment the frontier rank reaches what it waits for. Such a
wait changes no frontier value, no advance, no share and no blame (equality creates a tie and a
split share).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

STAGES: tuple[str, ...] = (
    "data_next_wait",
    "model_fwd_loss",
    "model_backward",
    "callbacks",
    "optim_step",
    "step_other",
)
#: Per-rank-stage baseline of eq. 4: a named rule or an array broadcastable to (N, R, S).
Baseline = Literal["cohort", "rank", "min"] | npt.NDArray[np.float64]


@dataclass(frozen=True)
class FrontierAccount:
    """Eq. 1–3 for N steps, R ranks, S stages; int64 for integer input, else float64."""

    prefix: np.ndarray  # (N, R, S) P[t,r,s]
    frontier: np.ndarray  # (N, S) F[t,s]
    advance: np.ndarray  # (N, S) a[t,s]
    slack: np.ndarray  # (N, R, S) λ[t,r,s]

    @property
    def exposed(self) -> np.ndarray:
        """F[t,S]: the exposed makespan of each step (the largest rank total)."""
        return self.frontier[:, -1]


def _as_steps(durations: npt.ArrayLike) -> np.ndarray:
    d = np.asarray(durations)
    if d.ndim == 2:
        d = d[None]
    if d.ndim != 3 or d.shape[1] == 0 or d.shape[2] == 0:
        raise ValueError(
            f"durations must be (ranks, stages) or (steps, ranks, stages), got {d.shape}"
        )
    d = d.astype(np.int64) if np.issubdtype(d.dtype, np.integer) else d.astype(np.float64)
    if np.any(d < 0):
        raise ValueError("durations must be non-negative")
    return d


def account(durations: npt.ArrayLike) -> FrontierAccount:
    """Prefixes, frontier, advances and slack (eq. 1 and 3), vectorized over steps."""
    d = _as_steps(durations)
    prefix = np.cumsum(d, axis=2)
    frontier = prefix.max(axis=1)
    zeros = np.zeros_like(frontier[:, :1])
    prev = np.concatenate([zeros, frontier[:, :-1]], axis=1)
    advance = frontier - prev
    prev_prefix = np.concatenate([np.zeros_like(prefix[:, :, :1]), prefix[:, :, :-1]], axis=2)
    slack = prev[:, None, :] - prev_prefix
    return FrontierAccount(prefix, frontier, advance, slack)


def shares(acct: FrontierAccount) -> np.ndarray:
    """Eq. 2: step-time-weighted window share of each stage (zeros if nothing was exposed)."""
    total = float(acct.exposed.sum())
    adv = acct.advance.sum(axis=0).astype(np.float64)
    return adv / total if total > 0 else np.zeros_like(adv)


def ranking(values: np.ndarray) -> tuple[int, ...]:
    """Stage indices by value, descending; ties go to the earlier (upstream) stage."""
    return tuple(int(i) for i in np.argsort(-np.asarray(values), kind="stable"))


def candidate_set(share: np.ndarray, tau_c: float = 0.80) -> tuple[int, ...]:
    """§4: the shortest leading-share prefix whose cumulative share reaches tau_c."""
    order = ranking(share)
    cum = np.cumsum(share[list(order)])
    k = int(np.searchsorted(cum, tau_c - 1e-12)) + 1
    return order[: min(k, len(order))]


def blame(acct: FrontierAccount, tie_rtol: float = 1e-9) -> np.ndarray:
    """Charge each advance to the rank(s) attaining the frontier (Fig. 2); returns (R, S).

    Ties are exact for integer input and within tie_rtol·F[t,S] for float input.
    """
    exact = np.issubdtype(acct.prefix.dtype, np.integer)
    tol = 0.0 if exact else tie_rtol * acct.exposed.astype(np.float64)[:, None, None]
    at_front = acct.prefix >= acct.frontier[:, None, :] - tol  # (N, R, S)
    ties = at_front.sum(axis=1, keepdims=True)
    share = at_front * (acct.advance[:, None, :] / ties)
    return np.asarray(share.sum(axis=0), dtype=np.float64)


def _cohort_median(d: np.ndarray, roles: np.ndarray | None) -> np.ndarray:
    if roles is None:
        return np.asarray(np.median(d, axis=1, keepdims=True))
    out = np.empty(d.shape, dtype=np.float64)
    for role in np.unique(roles):
        members = roles == role
        out[:, members] = np.median(d[:, members], axis=1, keepdims=True)
    return out


def direct_exposure(
    durations: npt.ArrayLike, baseline: Baseline = "cohort", roles: np.ndarray | None = None
) -> np.ndarray:
    """Eq. 4: clipped-baseline gain G_s ≥ 0 for every stage at once; returns (S,)."""
    d = _as_steps(durations).astype(np.float64)
    if isinstance(baseline, np.ndarray):
        ref = np.broadcast_to(baseline, d.shape)
    elif baseline == "cohort":
        ref = _cohort_median(d, roles)
    elif baseline == "rank":
        ref = np.median(d, axis=0, keepdims=True)
    elif baseline == "min":
        ref = np.minimum(_cohort_median(d, roles), np.median(d, axis=0, keepdims=True))
    else:
        raise ValueError(f"baseline must be 'cohort', 'rank', 'min' or an array, got {baseline!r}")
    removed = d - np.minimum(d, ref)  # (N, R, S) ≥ 0
    totals = d.sum(axis=2)  # (N, R)
    exposed = totals.max(axis=1)  # (N,)
    replaced = (totals[:, :, None] - removed).max(axis=1)  # (N, S)
    denom = float(exposed.sum())
    if denom <= 0:
        return np.zeros(d.shape[2])
    return np.asarray((exposed[:, None] - replaced).sum(axis=0) / denom, dtype=np.float64)
