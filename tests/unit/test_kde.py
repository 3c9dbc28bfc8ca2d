"""ARGUS §5.2 kernel summaries (streams/kde.py)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import gaussian_kde

from streams import kde

Method = Literal["binned", "exact"]
METHODS: list[Method] = ["binned", "exact"]
Z99 = 2.3263478740408408


def _mixture(medians: list[float], sigma: float, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([np.exp(rng.normal(np.log(m), sigma, n)) for m in medians])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("medians", [[2e4], [2e4, 2e5], [1e4, 1e5, 1e6]])
def test_well_separated_modes_give_one_cluster_each(method: Method, medians: list[float]) -> None:
    sigma = 0.1
    d = _mixture(medians, sigma, 2000, seed=len(medians))
    out = kde.summarize(np.full(d.size, 7), d, kde.KdeParams(method=method))
    assert out.n_rows == len(medians)
    np.testing.assert_array_equal(out.key, 7)
    np.testing.assert_array_equal(out.cluster, np.arange(len(medians)))
    np.testing.assert_array_equal(out.count, 2000)
    np.testing.assert_allclose(out.p50, medians, rtol=0.02)
    np.testing.assert_allclose(out.p99, np.array(medians) * np.exp(Z99 * sigma), rtol=0.05)


def test_density_matches_scipy_gaussian_kde_with_the_same_bandwidth() -> None:
    d = _mixture([3e4, 2e5], 0.15, 400, seed=3)
    x = np.log(d)
    keys = np.zeros(d.size, np.int64)
    exact = kde.density(keys, d, kde.KdeParams(method="exact"))
    binned = kde.density(keys, d, kde.KdeParams(method="binned"))
    h = 1.06 * x.std(ddof=1) * x.size**-0.2
    assert exact.bandwidth[0] == pytest.approx(h)
    grid = exact.lo[0] + exact.step[0] * np.arange(exact.density.shape[1])
    reference = gaussian_kde(x, bw_method=h / x.std(ddof=1))(grid)
    np.testing.assert_allclose(exact.density[0], reference, rtol=1e-9, atol=1e-12)
    assert np.abs(binned.density[0] - reference).max() < 0.01 * reference.max()

    def minima(f: np.ndarray) -> np.ndarray:
        return np.flatnonzero((f[1:-1] < f[:-2]) & (f[1:-1] <= f[2:])) + 1

    np.testing.assert_array_equal(minima(exact.density[0]), minima(reference))
    deepest = minima(reference)[np.argmin(reference[minima(reference)])]
    assert abs(int(minima(binned.density[0])[0]) - int(deepest)) <= 2


@pytest.mark.parametrize("method", METHODS)
def test_single_sample_and_zero_variance(method: Method) -> None:
    params = kde.KdeParams(method=method)
    one = kde.summarize([5], [1234.0], params)
    assert (one.count.tolist(), one.p50.tolist(), one.p99.tolist()) == ([1], [1234.0], [1234.0])
    flat = kde.summarize(np.zeros(500, np.int64), np.full(500, 800.0), params)
    assert (flat.count.tolist(), flat.p50.tolist(), flat.p99.tolist()) == ([500], [800.0], [800.0])
    empty = kde.summarize(np.zeros(0, np.int64), np.zeros(0), params)
    assert empty.n_rows == 0 and empty.n_events == 0


@pytest.mark.parametrize("method", METHODS)
def test_many_keys_at_once_equal_key_by_key(method: Method) -> None:
    rng = np.random.default_rng(11)
    keys, durations = [], []
    for key in rng.permutation(40) * 1000 + 3:
        modes = list(np.exp(rng.uniform(8, 14, rng.integers(1, 4))))
        d = _mixture(modes, 0.05, int(rng.integers(1, 300)), seed=int(key))
        keys.append(np.full(d.size, key))
        durations.append(d)
    params = kde.KdeParams(method=method, chunk_cells=1 << 12)  # forces many chunks
    together = kde.summarize(np.concatenate(keys), np.concatenate(durations), params)
    alone = [kde.summarize(k, d, params) for k, d in zip(keys, durations, strict=True)]
    alone.sort(key=lambda s: int(s.key[0]))
    for field in ("key", "cluster", "count", "p50", "p99"):
        expected = np.concatenate([getattr(s, field) for s in alone])
        np.testing.assert_array_equal(getattr(together, field), expected, err_msg=field)


def test_binned_and_exact_agree_on_clusters() -> None:
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 30, 20000)
    mode = rng.integers(0, 3, keys.size) % (keys % 3 + 1)
    d = np.exp(rng.normal(9 + 1.2 * mode + 0.1 * keys, 0.08))
    a = kde.summarize(keys, d, kde.KdeParams(method="binned"))
    b = kde.summarize(keys, d, kde.KdeParams(method="exact"))
    np.testing.assert_array_equal(a.count, b.count)
    np.testing.assert_array_equal(a.p99, b.p99)


def test_filters_merge_a_tiny_mode_and_close_modes() -> None:
    d = np.concatenate([_mixture([1e4], 0.05, 1000, 1), _mixture([1e6], 0.05, 3, 2)])
    assert kde.summarize(np.zeros(d.size, np.int64), d).n_rows == 1  # 3 < 1 % of 1003 → merged
    loose = kde.KdeParams(min_cluster_count=1, min_cluster_fraction=0.0)
    assert kde.summarize(np.zeros(d.size, np.int64), d, loose).n_rows == 2
    # Three modes 12 % apart: their two valleys are closer than the 25 % spacing filter, so only
    # the deeper one is kept; with no spacing filter both are.
    close = _mixture([1e4, 1.12e4, 1.2544e4], 0.01, 1000, 4)
    zero = np.zeros(close.size, np.int64)
    assert kde.summarize(zero, close).n_rows == 2
    assert kde.summarize(zero, close, kde.KdeParams(min_log_spacing=0.0)).n_rows == 3


def test_compression_ratio_uses_record_and_row_sizes() -> None:
    assert kde.RAW_EVENT_BYTES == 4 + 8 + 4 + 8 + 8
    out = kde.summarize(np.repeat(np.arange(10), 1000), _mixture([1e5], 0.1, 10000, 9))
    assert out.compression_ratio == pytest.approx(10000 * 32 / (out.n_rows * 52))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.sampled_from(METHODS))
def test_cluster_counts_are_invariant_to_sample_order(
    seed: int, n_modes: int, method: Method
) -> None:
    rng = np.random.default_rng(seed)
    medians = list(np.exp(rng.uniform(7, 15, n_modes)))
    d = _mixture(medians, float(rng.uniform(0.02, 0.4)), int(rng.integers(2, 400)), seed)
    keys = rng.integers(0, 3, d.size)
    params = kde.KdeParams(method=method)
    base = kde.summarize(keys, d, params)
    perm = rng.permutation(d.size)
    other = kde.summarize(keys[perm], d[perm], params)
    np.testing.assert_array_equal(base.count, other.count)
    np.testing.assert_array_equal(base.p50, other.p50)


@pytest.mark.parametrize("key_hi", [1 << 10, 1 << 40])
def test_integer_durations_sorted_packed_give_the_general_paths_summaries(key_hi: int) -> None:
    """Non-negative integer durations take the one-sort packed path (keys up to 2**10: it fits;
    up to 2**40 with durations of 2**30: it does not and falls back); the result is the float
    path's, which sorts by two argsorts."""
    rng = np.random.default_rng(5)
    keys = rng.integers(0, key_hi, 50)[rng.integers(0, 50, 20_000)]
    d = np.rint(_mixture([2e4, 3e5], 0.2, 10_000, seed=5)).astype(np.int64)
    d[:3] = [0, 1, 1 << 30]
    assert (kde._packed_sort(keys.astype(np.int64), d) is None) == (key_hi > 1 << 20)
    a = kde.summarize(keys, d)
    b = kde.summarize(keys, d.astype(np.float64))
    for f in ("key", "cluster", "count", "p50", "p99"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert kde._packed_sort(np.array([-1, 2]), np.array([5, 6])) is None  # negative key
    assert kde._packed_sort(np.array([1, 2]), np.array([-5, 6])) is None  # negative duration
