"""Expected durations learned online: VenusTrace Alg. 2 lines 2-10 / MegaTrace §III-C.

The papers keep one expected time per quantity (a step, a pipeline node): the first iteration is
skipped as warm-up, the second iteration's value initializes the expectation, and from the third
on a sample within ±α of the expectation is folded in (α = 5 % in both papers); a sample further
away leaves it unchanged. VenusTrace's Alg. 2 replaces the expectation by the accepted sample,
its text and MegaTrace keep a running mean; we keep a running mean over the last `window`
accepted samples (an incremental mean whose weight is capped at 1/window), which is less noisy
than replacement and still follows slow drift.

Where the papers are weak: a legitimate, lasting change of more than α (a new sequence length, a
permanently slower node that operators accepted) would never be learned, so a timeout of
n × expected would fire forever, or never. We re-baseline when `rebase_after` consecutive
samples all fall outside the band but agree with each other within it (of their own mean); the
caller learns of it through the returned `rebased` mask (heartbeat.py reports it as a
"regression").

Where the papers are weak on real jobs: ±α is a width fixed for clean clusters, and one sample
sets the start. On real training the step time scatters more than 5 % from step to step (CPU
hosts, shared cores: 10-15 % is common) and the second step is often still warming up. On a
real 8-rank job whose second step took 99 ms against 78 ms from then on (steps 67-107 ms),
hardly a sample fell within ±5 % of 99 and no five in a row agreed within ±5 %: the expectation
stayed at 99-101 ms for the whole job, and a backward slowdown that took the steps to 85-105 ms
never passed (1 + β) × expected — the step-level straggler test stayed silent and the slowdown
waited for another trigger. So the band is the larger of ±α and `spread_z` robust standard
deviations of the element's recent samples (`window` of them, every sample since the
initializing one, accepted or not; 1.4826 × the median absolute deviation over the median,
from `min_spread` samples on): where the series is as clean as the papers' clusters the band is
their ±α; where it scatters more, a wrong start is corrected by the samples that fall inside the
wider band, and a lasting change is still a run outside it. `spread_z = 0` is the papers'
fixed band.

Everything is vectorized: `value` may be a scalar-shaped array or any shape (e.g. one expectation
per (stage, pass, microbatch)); nan samples leave their element untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Array = np.ndarray


@dataclass
class Expectation:
    """Running expectation of one or many durations (ns, float64)."""

    shape: tuple[int, ...] = ()
    alpha: float = 0.05
    first_sample: int = 2  # 1-based index of the sample that initializes (VenusTrace: i = 2)
    window: int = 20
    rebase_after: int = 5
    spread_z: float = 2.0  # band: max(α, spread_z × the recent samples' robust relative σ)
    min_spread: int = 5  # recent samples needed before their spread widens the band
    value: Array = field(init=False)
    seen: Array = field(init=False)
    weight: Array = field(init=False)
    run: Array = field(init=False)  # consecutive samples outside ±alpha
    run_sum: Array = field(init=False)
    run_min: Array = field(init=False)
    run_max: Array = field(init=False)
    recent: Array = field(init=False)  # shape + (window,): samples since the initializing one
    filled: Array = field(init=False)  # samples written to `recent` (its next slot, mod window)

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha={self.alpha} must be in (0, 1)")
        if self.first_sample < 1 or self.window < 1 or self.rebase_after < 2:
            raise ValueError("first_sample, window must be >= 1 and rebase_after >= 2")
        self.value = np.full(self.shape, np.nan)
        self.seen = np.zeros(self.shape, dtype=np.int64)
        self.weight = np.zeros(self.shape, dtype=np.int64)
        self.run = np.zeros(self.shape, dtype=np.int64)
        self.run_sum = np.zeros(self.shape)
        self.run_min = np.full(self.shape, np.inf)
        self.run_max = np.full(self.shape, -np.inf)
        self.recent = np.full((*self.shape, self.window), np.nan)
        self.filled = np.zeros(self.shape, dtype=np.int64)

    @property
    def ready(self) -> Array:
        """Mask of elements that have an expectation."""
        return np.asarray(~np.isnan(self.value))

    def band(self) -> Array:
        """The acceptance band's half-width as a fraction of the expectation (module docstring):
        max(α, `spread_z` × 1.4826 × MAD / median of the recent samples)."""
        rel = np.full(self.shape, float(self.alpha))
        if self.spread_z <= 0:
            return rel
        enough = self.filled >= self.min_spread
        if not enough.any():
            return rel
        with np.errstate(all="ignore"):
            r = np.where(enough[..., None], self.recent, 1.0)  # no all-nan slices
            med = np.nanmedian(r, axis=-1)
            mad = np.nanmedian(np.abs(r - med[..., None]), axis=-1)
            spread = np.where(enough & (med > 0), self.spread_z * 1.4826 * mad / med, 0.0)
        return np.asarray(np.fmax(rel, np.nan_to_num(spread, nan=0.0)))

    def update(self, sample: Array | float) -> tuple[Array, Array]:
        """Fold one sample per element in; returns (within the band, rebased) boolean masks."""
        x = np.broadcast_to(np.asarray(sample, dtype=np.float64), self.shape)
        have = ~np.isnan(x)
        self.seen = self.seen + have
        init = have & (self.seen == self.first_sample)
        self.value = np.where(init, x, self.value)
        self.weight = np.where(init, 1, self.weight)
        later = have & (self.seen > self.first_sample) & self.ready
        band = self.band()
        with np.errstate(invalid="ignore"):
            within = later & (np.abs(x - self.value) < band * self.value)
        w = np.minimum(self.weight + 1, self.window)
        self.value = np.where(within, self.value + (x - self.value) / w, self.value)
        self.weight = np.where(within, w, self.weight)
        out = later & ~within
        self.run = np.where(out, self.run + 1, np.where(within, 0, self.run))
        self.run_sum = np.where(out, self.run_sum + x, np.where(within, 0.0, self.run_sum))
        self.run_min = np.where(out, np.fmin(self.run_min, x),
                                np.where(within, np.inf, self.run_min))
        self.run_max = np.where(out, np.fmax(self.run_max, x),
                                np.where(within, -np.inf, self.run_max))
        mean = self.run_sum / np.maximum(self.run, 1)
        consistent = (self.run_max - self.run_min) < 2 * band * mean
        rebased = out & (self.run >= self.rebase_after) & consistent
        self.value = np.where(rebased, mean, self.value)
        self.weight = np.where(rebased, self.run, self.weight)
        self.run = np.where(rebased, 0, self.run)
        self.run_sum = np.where(rebased, 0.0, self.run_sum)
        self.run_min = np.where(rebased, np.inf, self.run_min)
        self.run_max = np.where(rebased, -np.inf, self.run_max)
        keep = have & (self.seen >= self.first_sample)
        if keep.any():
            slot = self.filled % self.window
            idx = np.indices(self.shape)
            sel = (*(i[keep] for i in idx), slot[keep])
            self.recent[sel] = x[keep]
            self.filled = self.filled + keep
        return np.asarray(within | init), np.asarray(rebased)
