"""StageFrontier frontier accounting (diagnosis/rules/frontier.py) against the paper's figures."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from diagnosis.rules import frontier as sf
from diagnosis.rules import frontier_labels as fl

THREE = ("data", "fwd", "bwd")


def test_figure1_displaced_wait_is_charged_once_to_data() -> None:
    # StageFrontier Fig. 1: r0 = (6.0, 1.0, 1.2), r1 = (1.0, 1.0, 6.2), r2 = (1.1, 1.0, 6.0).
    d = np.array([[6.0, 1.0, 1.2], [1.0, 1.0, 6.2], [1.1, 1.0, 6.0]])
    acct = sf.account(d)
    np.testing.assert_allclose(acct.advance[0], [6.0, 1.0, 1.2])
    assert acct.exposed[0] == pytest.approx(8.2)
    report = fl.diagnose(d, stage_names=THREE)
    assert report.evidence["per_stage_max_total"] == pytest.approx(13.2)
    assert report.top1 == "data"
    assert report.culprit_ranks == (0,)
    # High share, zero clipped gain (the waiters' backward keeps F[S]): without a model-fit
    # indicator the labeler must not claim a cause; with it, the sync-wait reading is allowed.
    np.testing.assert_allclose(report.gains, 0.0)
    assert "co_critical" in report.labels
    assert "direct_exposure" not in report.labels
    fit = fl.diagnose(d, stage_names=THREE, model_fit=[1, 0, 0])
    assert "sync_wait_dependent" in fit.labels


def test_figure2_each_boundary_charged_to_a_different_rank() -> None:
    # A matrix consistent with Fig. 2: frontier 4.0 (r0), 6.0 (r1), 8.5 (r2).
    d = np.array([[4.0, 0.5, 1.0], [2.0, 4.0, 2.0], [1.0, 1.5, 6.0]])
    acct = sf.account(d)
    np.testing.assert_allclose(acct.frontier[0], [4.0, 6.0, 8.5])
    np.testing.assert_allclose(acct.advance[0], [4.0, 2.0, 2.5])
    np.testing.assert_allclose(sf.blame(acct), np.diag([4.0, 2.0, 2.5]))


def test_section4_sharp_case_reports_the_ambiguity_set() -> None:
    report = fl.diagnose(np.array([[10, 0], [0, 10]]), stage_names=("data", "bwd"))
    np.testing.assert_array_equal(sf.account(np.array([[10, 0], [0, 10]])).advance[0], [10, 0])
    assert "co_critical" in report.labels
    assert [report.stage_names[i] for i in report.co_critical_stages] == ["data", "bwd"]


def _window(n_steps: int = 20, n_ranks: int = 8, seed: int = 0) -> np.ndarray:
    """Homogeneous DDP-like steps in ns: data, fwd, bwd, callbacks, optim, other."""
    rng = np.random.default_rng(seed)
    base = np.array([5e6, 60e6, 120e6, 2e6, 15e6, 1e6])
    noise = rng.normal(1.0, 0.01, (n_steps, n_ranks, 6))
    return np.rint(base * noise).astype(np.int64)


def test_hidden_rank_data_delay_routes_to_data_and_the_rank() -> None:
    d = _window()
    d[:, 3, 0] += 120_000_000  # rank 3's data stage is 120 ms late ...
    d[:, np.arange(8) != 3, 2] += 120_000_000  # ... and the others wait for it in backward
    report = fl.diagnose(d)
    assert report.top1 == "data_next_wait"
    assert "data_next_wait" in report.top2
    assert 0 in report.candidates
    assert fl.routing_hit(report, "data_next_wait") == (True, True, True)
    assert fl.routing_hit(report, "callbacks") == (False, False, False)
    assert report.culprit_ranks == (3,)
    assert "telemetry_limited" not in report.labels
    [finding] = fl.findings(report)
    assert finding.stage == "data_next_wait" and finding.component == "data_loader"


def test_unwaited_extra_work_is_direct_exposure() -> None:
    d = _window()
    d[:, 5, 4] += 300_000_000  # rank 5's optimizer step is slow; nobody waits within the step
    report = fl.diagnose(d)
    assert report.top1 == "optim_step"
    assert "direct_exposure" in report.labels
    assert report.culprit_ranks == (5,)
    assert report.gains[4] > 0.4


def test_telemetry_and_role_downgrades() -> None:
    d = _window().astype(np.float64)
    assert "telemetry_limited" in fl.diagnose(d[:, :1]).labels
    holed = d.copy()
    holed[3, 2, :] = np.nan
    assert "telemetry_limited" in fl.diagnose(holed).labels
    open_residual = d.copy()
    open_residual[:, :, 5] += 50e6
    assert "telemetry_limited" in fl.diagnose(open_residual).labels
    wall = d[:, :, :5].sum(axis=2) - 10e6  # spans overlap the measured wall time
    assert "telemetry_limited" in fl.diagnose(d, step_wall=wall).labels
    roles = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    report = fl.diagnose(d, roles=roles)
    assert "role_aware_needed" in report.labels
    assert "direct_exposure" not in report.labels


def test_candidate_set_and_ranking() -> None:
    share = np.array([0.43, 0.10, 0.40, 0.02, 0.05, 0.0])
    assert sf.candidate_set(share, 0.8) == (0, 2)
    assert sf.candidate_set(share, 0.9) == (0, 2, 1)
    assert sf.ranking(np.array([0.3, 0.3, 0.4])) == (2, 0, 1)


def test_many_steps_equal_step_by_step() -> None:
    d = _window(n_steps=7)
    acct = sf.account(d)
    for t in range(d.shape[0]):
        one = sf.account(d[t])
        np.testing.assert_array_equal(one.frontier[0], acct.frontier[t])
        np.testing.assert_array_equal(one.slack[0], acct.slack[t])


steps = hnp.arrays(
    np.int64,
    st.tuples(st.integers(1, 5), st.integers(1, 6), st.integers(1, 6)),
    elements=st.integers(0, 10**12),
)


@settings(max_examples=200, deadline=None)
@given(steps)
def test_telescoping_and_slack_identities_hold_exactly(d: np.ndarray) -> None:
    acct = sf.account(d)
    assert acct.advance.dtype == np.int64
    np.testing.assert_array_equal(acct.advance.sum(axis=1), acct.exposed)  # Theorem 1
    np.testing.assert_array_equal(acct.exposed, d.sum(axis=2).max(axis=1))
    assert (acct.advance >= 0).all() and (acct.slack >= 0).all()
    np.testing.assert_array_equal((d - acct.slack).max(axis=1), acct.advance)  # eq. 3
    np.testing.assert_allclose(sf.blame(acct).sum(), acct.exposed.sum(), rtol=1e-12)


@settings(max_examples=200, deadline=None)
@given(steps)
def test_per_stage_max_and_mean_bounds(d: np.ndarray) -> None:
    # Propositions 1 and 2.
    n_ranks, n_stages = d.shape[1], d.shape[2]
    exposed = sf.account(d).exposed
    stage_max = d.max(axis=1).sum(axis=1)
    stage_mean = d.mean(axis=1).sum(axis=1)
    assert (exposed <= stage_max).all()
    assert (stage_max <= min(n_ranks, n_stages) * exposed).all()
    assert (stage_mean <= exposed * (1 + 1e-12)).all()
    assert (exposed <= n_ranks * stage_mean * (1 + 1e-12)).all()


@settings(max_examples=300, deadline=None)
@given(steps, st.data())
def test_pure_waiting_never_moves_blame_to_the_waiter(d: np.ndarray, data: st.DataObject) -> None:
    """A wait that fits in the victim's slack at every later boundary changes nothing."""
    _, n_ranks, n_stages = d.shape
    r = data.draw(st.integers(0, n_ranks - 1))
    s = data.draw(st.integers(0, n_stages - 1))
    acct = sf.account(d)
    room = (acct.frontier[:, None, s:] - acct.prefix[:, :, s:])[:, r, :].min(axis=1)  # (N,)
    frac = data.draw(st.floats(0.0, 1.0))
    delta = np.floor(frac * np.maximum(room - 1, 0)).astype(np.int64)  # strictly inside slack
    waited = d.copy()
    waited[:, r, s] += delta
    after = sf.account(waited)
    np.testing.assert_array_equal(after.frontier, acct.frontier)
    np.testing.assert_array_equal(after.advance, acct.advance)
    np.testing.assert_array_equal(sf.blame(after), sf.blame(acct))
    assert sf.ranking(sf.shares(after)) == sf.ranking(sf.shares(acct))
