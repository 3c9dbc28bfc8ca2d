"""ARGUS L1 (§6.1, Appendix B): when did the step time jitter or regress.

Input: one 1-D step-time series (any positive unit, oldest first) and optionally the matching
timestamps (int ns, the producer's clock) so findings carry an onset time; the function never
reads a clock. Everything is vectorized over the series (prefix sums, a strided window view);
loops run only over the handful of merged intervals.

Jitter, two phases (Appendix B):
1. gating: a window of `window` points slides one point at a time; a window whose max/min ratio
   exceeds `ratio` is a candidate; overlapping or touching candidates merge into intervals;
2. effective width: baseline b = median of the points outside the interval (the whole series
   if the interval covers it); inside, the longest run of consecutive points with x ≥ exceed·b is
   the effective jitter, its first point the onset and its length the width. This undoes the
   sliding window's smearing of a narrow spike to ≥ `window` points. Intervals with no such run
   (a dip, not a spike) are dropped.
Regression: every split t with ≥ `min_segment` points on each side is scored by μR/μL; a split is
valid when μR/μL ≥ `min_ratio` and both relative standard deviations (ddof = 1) are ≤ `max_rsd`;
the valid split with the largest ratio wins, its first right-hand point is the onset.

Thresholds are ours (Appendix B gives none): window 10, ratio 1.3, exceed 1.15, min_ratio 1.1,
max_rsd 0.05, min_segment 5 — typical synchronous steps vary by 1–2 %, so 30 % swings inside ten
steps, and a 10 % shift between two internally steady segments, are well outside noise.
Improvements over the paper: (1) a single spike inflates a segment's RSD past any sensible limit
and hides a real regression behind it, so the change-point scan runs on a running median of
`despike` = 5 points (steps survive a median filter exactly; spikes of ≤ 2 points vanish; set 0
for the paper's raw scan); (2) `classify`/`findings` run the jitter pass on the series divided
by its segment medians when a regression was found, so a clean step change is reported once (as
a regression) instead of also as a jitter interval straddling the change point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view
from scipy.ndimage import median_filter

from diagnosis.rules.base import Finding


@dataclass(frozen=True)
class L1Params:
    window: int = 10
    ratio: float = 1.3
    exceed: float = 1.15
    min_ratio: float = 1.1
    max_rsd: float = 0.05
    min_segment: int = 5
    despike: int = 5


@dataclass(frozen=True)
class Jitter:
    """One merged candidate interval [start, end] (inclusive) and its effective spike."""

    start: int
    end: int
    onset: int
    width: int
    baseline: float
    magnitude: float  # peak of the effective run over the baseline
    window_ratio: float  # largest max/min among the interval's windows


@dataclass(frozen=True)
class Regression:
    """The most significant single change point; `onset` is the first point after it."""

    onset: int
    ratio: float  # μR/μL
    mean_left: float
    mean_right: float
    rsd_left: float
    rsd_right: float


def _series(step_times: npt.ArrayLike) -> np.ndarray:
    x = np.asarray(step_times, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"step_times must be 1-D, got shape {x.shape}")
    if x.size and not (np.all(np.isfinite(x)) and x.min() > 0):
        raise ValueError("step_times must be finite and > 0")
    return x


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start indices and lengths of the runs of True in a 1-D mask."""
    edges = np.diff(np.r_[0, mask.astype(np.int8), 0])
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


def detect_jitter(step_times: npt.ArrayLike, params: L1Params = L1Params()) -> list[Jitter]:
    """Ratio-gated jitter intervals with their effective width (Appendix B)."""
    x = _series(step_times)
    n = x.size
    if n < 2:
        return []
    w = min(params.window, n)
    windows = sliding_window_view(x, w)  # (n - w + 1, w) view, window i covers [i, i+w-1]
    hi, lo = windows.max(axis=1), windows.min(axis=1)
    ratio = hi / lo
    flagged = np.flatnonzero(ratio > params.ratio)
    if flagged.size == 0:
        return []
    cover = np.bincount(flagged, minlength=n + w) - np.bincount(flagged + w, minlength=n + w)
    starts, lengths = _runs(np.cumsum(cover)[:n] > 0)
    found = []
    for a, m in zip(starts.tolist(), lengths.tolist(), strict=True):
        b = a + m - 1
        outside = np.r_[x[:a], x[b + 1 :]]
        base = float(np.median(outside if outside.size else x))
        r_starts, r_len = _runs(x[a : b + 1] >= params.exceed * base)
        if r_len.size == 0:
            continue
        k = int(np.argmax(r_len))
        onset, width = a + int(r_starts[k]), int(r_len[k])
        in_window = (flagged >= a - w + 1) & (flagged <= b)
        found.append(
            Jitter(
                start=a,
                end=b,
                onset=onset,
                width=width,
                baseline=base,
                magnitude=float(x[onset : onset + width].max() / base),
                window_ratio=float(ratio[flagged[in_window]].max()),
            )
        )
    return found


def detect_regression(
    step_times: npt.ArrayLike, params: L1Params = L1Params()
) -> Regression | None:
    """Full-scan single change point (Appendix B); None when no split is valid."""
    x = _series(step_times)
    if params.despike > 1 and x.size >= params.despike:
        x = median_filter(x, size=params.despike, mode="nearest")
    n, m = x.size, params.min_segment
    if n < 2 * m or m < 2:
        return None
    c = x - x.mean()  # centring keeps the prefix sums of squares well conditioned
    s1 = np.r_[0.0, np.cumsum(c)]
    s2 = np.r_[0.0, np.cumsum(c * c)]
    t = np.arange(m, n - m + 1)
    nl, nr = t.astype(np.float64), (n - t).astype(np.float64)
    ml, mr = s1[t] / nl, (s1[n] - s1[t]) / nr
    vl = np.maximum(s2[t] - nl * ml * ml, 0.0) / (nl - 1)
    vr = np.maximum(s2[n] - s2[t] - nr * mr * mr, 0.0) / (nr - 1)
    mean_l, mean_r = ml + x.mean(), mr + x.mean()
    rsd_l, rsd_r = np.sqrt(vl) / mean_l, np.sqrt(vr) / mean_r
    ratio = mean_r / mean_l
    valid = (ratio >= params.min_ratio) & (rsd_l <= params.max_rsd) & (rsd_r <= params.max_rsd)
    if not valid.any():
        return None
    k = int(np.argmax(np.where(valid, ratio, -np.inf)))
    return Regression(
        int(t[k]),
        float(ratio[k]),
        float(mean_l[k]),
        float(mean_r[k]),
        float(rsd_l[k]),
        float(rsd_r[k]),
    )


def _detrended(x: np.ndarray, reg: Regression | None) -> np.ndarray:
    if reg is None:
        return x
    left, right = x[: reg.onset], x[reg.onset :]
    return np.concatenate([left / np.median(left), right / np.median(right)])


def classify(
    step_times: npt.ArrayLike, params: L1Params = L1Params()
) -> Literal["stable", "jitter", "regression", "both"]:
    """ARGUS §6.1's four classes of a step-time series."""
    x = _series(step_times)
    reg = detect_regression(x, params)
    jit = bool(detect_jitter(_detrended(x, reg), params))
    return "both" if reg and jit else "regression" if reg else "jitter" if jit else "stable"


def findings(
    step_times: npt.ArrayLike,
    timestamps: npt.ArrayLike | None = None,
    params: L1Params = L1Params(),
) -> list[Finding]:
    """Jitter and regression findings; `timestamps` (ns) give `onset_ns`."""
    x = _series(step_times)
    ts = None if timestamps is None else np.asarray(timestamps, dtype=np.int64)
    if ts is not None and ts.shape != x.shape:
        raise ValueError(f"timestamps shape {ts.shape} != step_times shape {x.shape}")
    out: list[Finding] = []
    reg = detect_regression(x, params)
    if reg is not None:
        out.append(
            Finding(
                rule="argus.l1.regression",
                kind="regression",
                score=reg.ratio,
                onset_ns=None if ts is None else int(ts[reg.onset]),
                evidence={"onset_index": reg.onset, **_params(params), **reg.__dict__},
            )
        )
    for j in detect_jitter(_detrended(x, reg), params):
        out.append(
            Finding(
                rule="argus.l1.jitter",
                kind="jitter",
                score=j.magnitude,
                onset_ns=None if ts is None else int(ts[j.onset]),
                evidence={"onset_index": j.onset, **_params(params), **j.__dict__},
            )
        )
    return out


def _params(p: L1Params) -> dict[str, object]:
    return {f"param_{k}": v for k, v in p.__dict__.items()}
