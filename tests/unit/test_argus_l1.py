"""ARGUS L1 jitter and change-point detection (diagnosis/rules/argus_l1.py)."""

from __future__ import annotations

import numpy as np
import pytest

from diagnosis.rules import argus_l1 as l1


def _steady(n: int = 200, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(4.0, 0.02, n)  # ~4 s steps, 0.5 % noise


def test_stable_series_has_no_findings() -> None:
    x = _steady()
    assert l1.detect_jitter(x) == []
    assert l1.detect_regression(x) is None
    assert l1.classify(x) == "stable"


def test_narrow_spike_is_smeared_by_the_window_and_recovered_by_effective_width() -> None:
    x = _steady()
    x[60] = 9.0  # a one-step spike over twice the expected step (ARGUS Fig. 1)
    x[130:134] = 6.5  # a four-step burst
    found = l1.detect_jitter(x)
    assert [(j.onset, j.width) for j in found] == [(60, 1), (130, 4)]
    first = found[0]
    assert first.end - first.start + 1 >= l1.L1Params().window  # phase 1 smears ...
    assert first.magnitude == pytest.approx(9.0 / first.baseline)  # ... phase 2 recovers
    assert l1.classify(x) == "jitter"


def test_step_regression_found_at_its_onset() -> None:
    x = _steady()
    x[150:] *= 1.5
    reg = l1.detect_regression(x)
    assert reg is not None and reg.onset == 150
    assert reg.ratio == pytest.approx(1.5, rel=0.01)
    assert reg.rsd_left < 0.01 and reg.rsd_right < 0.01
    assert l1.classify(x) == "regression"  # not also "jitter" at the change point


def test_regression_with_a_spike_is_both_and_findings_carry_onset_time() -> None:
    x = _steady()
    x[100:] *= 1.25
    x[40] = 12.0
    ts = 1_000_000_000 * np.arange(x.size, dtype=np.int64) + 7
    assert l1.classify(x) == "both"
    out = {f.kind: f for f in l1.findings(x, ts)}
    assert out["regression"].onset_ns == ts[100]
    assert out["jitter"].onset_ns == ts[40]
    assert out["jitter"].evidence["width"] == 1
    paper_exact = l1.L1Params(despike=0)  # the raw scan: the spike's RSD hides the regression
    assert l1.detect_regression(x, paper_exact) is None


def test_noisy_segments_are_not_a_regression() -> None:
    rng = np.random.default_rng(3)
    x = np.r_[rng.normal(4.0, 0.6, 100), rng.normal(5.0, 0.6, 100)]  # RSD ≈ 0.13 > 0.05
    assert l1.detect_regression(x) is None


def test_short_and_invalid_series() -> None:
    assert l1.detect_jitter([1.0]) == []
    assert l1.detect_regression([1.0, 2.0, 3.0]) is None
    assert l1.detect_jitter([1.0, 3.0])[0].onset == 1
    with pytest.raises(ValueError, match="> 0"):
        l1.detect_jitter([1.0, 0.0])
