"""ARGUS L3 (§6.2, eq. 2–4): which ranks run one kernel with a deviating duration distribution.

Input: the kernel summaries of one (kernel, stream) across ranks, i.e. rows of `streams.kde`
output: `rank` (owner of each cluster row), `count`, `p50`, `p99`, all 1-D of equal length.

1. CDF reconstruction (eq. 2): each cluster c is a log-normal with μ_c = ln p50_c and
   σ_c = (ln p99_c − ln p50_c)/z₀.₉₉, z₀.₉₉ = Φ⁻¹(0.99) = 2.3263 (the paper rounds to 2.326);
   a rank's CDF is the count-weighted mixture. A cluster with p99 = p50 would have σ = 0 (a step);
   σ is floored at `sigma_floor` (0.001, i.e. 0.1 % spread) so the mixture stays continuous.
2. W1 (eq. 3) = ∫|F_a − F_b| dx by the trapezoid rule on one log-uniform grid shared by all ranks
   (so the matrix is an exact metric up to rounding: symmetric, zero diagonal, triangle
   inequality), spanning every cluster's μ ± `tail_sigmas`·σ.
3. Deviation score = mean W1 from the rank to all others; IQR fence Q3 + α(Q3 − Q1) (eq. 4),
   α = 1.5 (Tukey's value; the paper leaves α open).

Improvements over the paper:
- the scores come from `mean_w1` in O(G·R log R) — at each grid point the sum of |F_a − F_b|
  over b follows from the sorted CDF values and prefix sums — instead of the O(G·R²) matrix, so a
  kernel can be compared across thousands of ranks; `w1_matrix` (chunked) remains for display;
- when most ranks are identical the IQR collapses to zero and any rank above Q3 by a rounding
  error would pass the fence; a rank must also exceed the median score by `min_rel_gap` (2 %) of
  the kernel's typical duration (the count-weighted mean p50), keeping the flag in units an
  operator cares about.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.special import ndtr

from diagnosis.rules.base import Finding

Z99 = 2.3263478740408408


@dataclass(frozen=True)
class L3Params:
    alpha: float = 1.5
    grid_points: int = 512
    tail_sigmas: float = 6.0
    sigma_floor: float = 1e-3
    min_rel_gap: float = 0.02
    chunk_cells: int = 1 << 22


@dataclass(frozen=True)
class L3Result:
    ranks: np.ndarray  # (R,) distinct ranks, ascending
    scores: np.ndarray  # (R,) mean W1 to the other ranks, in duration units
    q1: float
    q3: float
    fence: float
    outliers: tuple[int, ...]  # ranks above the fence (and the minimum gap)
    typical: float  # count-weighted mean p50


def _clusters(
    count: npt.ArrayLike, p50: npt.ArrayLike, p99: npt.ArrayLike, sigma_floor: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = np.asarray(count, dtype=np.float64)
    lo = np.asarray(p50, dtype=np.float64)
    hi = np.asarray(p99, dtype=np.float64)
    if not (w.shape == lo.shape == hi.shape) or w.ndim != 1:
        raise ValueError("count, p50 and p99 must be 1-D arrays of one length")
    if np.any(lo <= 0) or np.any(hi < lo) or np.any(w <= 0):
        raise ValueError("need count > 0 and 0 < p50 <= p99")
    mu = np.log(lo)
    sigma = np.maximum((np.log(hi) - mu) / Z99, sigma_floor)
    return w, mu, sigma


def log_grid(p50: npt.ArrayLike, p99: npt.ArrayLike, params: L3Params = L3Params()) -> np.ndarray:
    """The shared log-uniform integration grid covering every cluster's μ ± k·σ."""
    _, mu, sigma = _clusters(np.ones(np.size(p50)), p50, p99, params.sigma_floor)
    lo = float((mu - params.tail_sigmas * sigma).min())
    hi = float((mu + params.tail_sigmas * sigma).max())
    return np.exp(np.linspace(lo, hi, params.grid_points))


def reconstruct_cdf(
    owner: npt.ArrayLike,
    count: npt.ArrayLike,
    p50: npt.ArrayLike,
    p99: npt.ArrayLike,
    grid: np.ndarray,
    n_owners: int,
    sigma_floor: float = 1e-3,
) -> np.ndarray:
    """Eq. 2 for every owner at once: (n_owners, G) mixture CDFs on `grid`."""
    w, mu, sigma = _clusters(count, p50, p99, sigma_floor)
    own = np.asarray(owner, dtype=np.int64)
    total = np.bincount(own, weights=w, minlength=n_owners)
    comp = ndtr((np.log(grid)[None, :] - mu[:, None]) / sigma[:, None])  # (C, G)
    cdf = np.zeros((n_owners, grid.size))
    np.add.at(cdf, own, comp * (w / total[own])[:, None])
    return cdf


def _trapz_weights(grid: np.ndarray) -> np.ndarray:
    w = np.zeros(grid.size)
    dx = np.diff(grid) / 2
    w[:-1] += dx
    w[1:] += dx
    return w


def w1_matrix(cdf: np.ndarray, grid: np.ndarray, chunk_cells: int = 1 << 22) -> np.ndarray:
    """Eq. 3 for all pairs of rows of `cdf`, in row chunks bounded by `chunk_cells`."""
    r = cdf.shape[0]
    wts = _trapz_weights(grid)
    out = np.empty((r, r))
    step = max(1, chunk_cells // max(1, r * grid.size))
    for a in range(0, r, step):
        diff = np.abs(cdf[a : a + step, None, :] - cdf[None, :, :])
        out[a : a + step] = diff @ wts
    return (out + out.T) / 2  # identical up to rounding; make symmetry exact


def mean_w1(cdf: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Mean W1 from each row to all other rows, O(G·R log R) without the matrix."""
    r = cdf.shape[0]
    if r < 2:
        return np.zeros(r)
    order = np.argsort(cdf, axis=0, kind="stable")
    s = np.take_along_axis(cdf, order, axis=0)  # sorted per grid column
    before = np.cumsum(s, axis=0) - s  # sum of smaller values
    after = s.sum(axis=0, keepdims=True) - before - s
    i = np.arange(r)[:, None]
    sums_sorted = (i * s - before) + (after - (r - 1 - i) * s)
    sums = np.empty_like(sums_sorted)
    np.put_along_axis(sums, order, sums_sorted, axis=0)
    return np.asarray(sums @ _trapz_weights(grid) / (r - 1))


def iqr_fence(scores: np.ndarray, alpha: float = 1.5) -> tuple[float, float, float]:
    """Eq. 4: (Q1, Q3, Q3 + alpha·(Q3 − Q1))."""
    q1, q3 = (float(q) for q in np.percentile(scores, [25, 75]))
    return q1, q3, q3 + alpha * (q3 - q1)


def detect(
    rank: npt.ArrayLike,
    count: npt.ArrayLike,
    p50: npt.ArrayLike,
    p99: npt.ArrayLike,
    params: L3Params = L3Params(),
) -> L3Result:
    """Deviation scores and IQR outliers for one (kernel, stream) across ranks."""
    ranks, owner = np.unique(np.asarray(rank, dtype=np.int64), return_inverse=True)
    grid = log_grid(p50, p99, params)
    cdf = reconstruct_cdf(owner, count, p50, p99, grid, ranks.size, params.sigma_floor)
    scores = mean_w1(cdf, grid)
    w = np.asarray(count, dtype=np.float64)
    typical = float(np.dot(w, np.asarray(p50, dtype=np.float64)) / w.sum())
    if ranks.size < 4:  # quartiles of fewer than four scores say nothing
        return L3Result(ranks, scores, 0.0, 0.0, float("inf"), (), typical)
    q1, q3, fence = iqr_fence(scores, params.alpha)
    gap = scores - float(np.median(scores))
    flagged = (scores > fence) & (gap >= params.min_rel_gap * typical)
    return L3Result(ranks, scores, q1, q3, fence, tuple(ranks[flagged].tolist()), typical)


def findings(kernel: str, result: L3Result) -> list[Finding]:
    """One finding naming the outlier ranks of `kernel`; score = worst score / fence."""
    if not result.outliers:
        return []
    worst = float(result.scores.max())
    return [
        Finding(
            rule="argus.l3",
            culprit_ranks=result.outliers,
            stage=kernel,
            score=worst / result.fence if result.fence > 0 else float("inf"),
            kind="slowdown",
            evidence={
                "scores": {
                    int(r): float(s)
                    for r, s in zip(result.ranks, result.scores, strict=True)
                    if int(r) in result.outliers
                },
                "q1": result.q1,
                "q3": result.q3,
                "fence": result.fence,
                "typical_p50": result.typical,
            },
        )
    ]
