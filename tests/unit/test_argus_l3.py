"""ARGUS L3 CDF reconstruction, W1 and IQR fence (diagnosis/rules/argus_l3.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnosis.rules import argus_l3 as l3


def _cdfs(
    p50: list[float], p99: list[float], owner: list[int], count: list[float]
) -> tuple[np.ndarray, np.ndarray]:
    grid = l3.log_grid(p50, p99, l3.L3Params(grid_points=4096))
    cdf = l3.reconstruct_cdf(owner, count, p50, p99, grid, max(owner) + 1)
    return cdf, grid


def test_reconstruction_puts_median_and_p99_where_the_summary_says() -> None:
    cdf, grid = _cdfs([1e5], [2e5], [0], [10])
    assert np.interp(0.5, cdf[0], grid) == pytest.approx(1e5, rel=1e-3)
    assert np.interp(0.99, cdf[0], grid) == pytest.approx(2e5, rel=1e-3)
    mix, g2 = _cdfs([1e4, 1e6], [1.2e4, 1.2e6], [0, 0], [300, 100])
    assert np.interp(1e5, g2, mix[0]) == pytest.approx(0.75, abs=1e-6)  # count weights


def test_w1_of_shifted_lognormals_matches_the_closed_form() -> None:
    sigma = 0.2
    p50 = [1e5, 2e5]
    p99 = [m * np.exp(l3.Z99 * sigma) for m in p50]
    cdf, grid = _cdfs(p50, p99, [0, 1], [1, 1])
    expected = (2e5 - 1e5) * np.exp(sigma**2 / 2)  # one stochastically dominates: |E a − E b|
    assert l3.w1_matrix(cdf, grid)[0, 1] == pytest.approx(expected, rel=1e-4)


def test_mean_w1_equals_matrix_row_means() -> None:
    rng = np.random.default_rng(0)
    owner = np.repeat(np.arange(40), 2)
    p50 = rng.uniform(1e4, 1e6, owner.size)
    p99 = p50 * rng.uniform(1.0, 3.0, owner.size)
    count = rng.integers(1, 100, owner.size).astype(float)
    grid = l3.log_grid(p50, p99)
    cdf = l3.reconstruct_cdf(owner, count, p50, p99, grid, 40)
    matrix = l3.w1_matrix(cdf, grid, chunk_cells=5000)
    np.testing.assert_allclose(l3.mean_w1(cdf, grid), matrix.sum(axis=1) / 39, rtol=1e-9)


def test_case2_block_structure_between_edp_groups() -> None:
    # ARGUS Case 2 (Fig. 11): ranks 0, 8 in one EDP group, 7, 15 in a degraded one.
    ranks = [0, 8, 7, 15]
    p50 = [1.00e6, 1.01e6, 1.40e6, 1.41e6]
    p99 = [1.2 * p for p in p50]
    grid = l3.log_grid(p50, p99)
    cdf = l3.reconstruct_cdf(np.arange(4), np.ones(4), p50, p99, grid, 4)
    m = l3.w1_matrix(cdf, grid)
    intra = max(m[0, 1], m[2, 3])
    inter = min(m[0, 2], m[0, 3], m[1, 2], m[1, 3])
    assert inter > 20 * intra
    assert ranks[int(np.argmax(m[0]))] in (7, 15)


def test_iqr_fence_flags_the_degraded_rank_only() -> None:
    rng = np.random.default_rng(1)
    rank = np.repeat(np.arange(32), 2)
    p50 = np.tile([1e5, 4e5], 32) * rng.normal(1.0, 0.005, 64)
    p99 = p50 * 1.3
    p50[[26, 27]] *= 1.4  # rank 13's kernel runs 40 % slower in both modes
    p99[[26, 27]] *= 1.4
    result = l3.detect(rank, np.tile([300.0, 100.0], 32), p50, p99)
    assert result.outliers == (13,)
    q1, q3, fence = l3.iqr_fence(result.scores)
    assert fence == pytest.approx(q3 + 1.5 * (q3 - q1))
    [finding] = l3.findings("ampere_gemm", result)
    assert finding.culprit_ranks == (13,) and finding.stage == "ampere_gemm"


def test_identical_ranks_flag_nothing_even_with_zero_iqr() -> None:
    rank = np.arange(16)
    p50 = np.full(16, 1e5)
    p50[3] *= 1.0001  # a rounding-level difference must not pass a collapsed fence
    assert l3.detect(rank, np.ones(16), p50, p50 * 1.2).outliers == ()


cluster = st.tuples(
    st.floats(1e3, 1e7), st.floats(1.0, 5.0), st.floats(1.0, 1000.0)
)  # p50, p99/p50, count


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(cluster, min_size=1, max_size=3), min_size=3, max_size=6))
def test_w1_is_a_metric(ranks: list[list[tuple[float, float, float]]]) -> None:
    owner = np.array([r for r, cl in enumerate(ranks) for _ in cl])
    flat = [c for cl in ranks for c in cl]
    p50 = np.array([c[0] for c in flat])
    p99 = p50 * np.array([c[1] for c in flat])
    count = np.array([c[2] for c in flat])
    grid = l3.log_grid(p50, p99)
    m = l3.w1_matrix(l3.reconstruct_cdf(owner, count, p50, p99, grid, len(ranks)), grid)
    scale = float(p99.max())
    np.testing.assert_array_equal(m, m.T)
    np.testing.assert_allclose(np.diag(m), 0.0, atol=1e-9 * scale)
    assert (m >= 0).all()
    triangle = m[:, None, :] - (m[:, :, None] + m[None, :, :])  # d(a,c) − d(a,b) − d(b,c)
    assert triangle.max() <= 1e-9 * scale
