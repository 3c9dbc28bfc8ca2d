"""ARGUS L2 group dispersion and routing (diagnosis/rules/argus_l2.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from diagnosis.rules import argus_l2 as l2


def test_cv_levels_and_z_follow_equation_5() -> None:
    values = np.array([10.0, 10.1, 9.9, 10.0, 10.0, 12.0, 10.0, 10.0])
    groups = [np.array([0, 1, 2]), np.array([3, 4, 5, 6, 7])]
    stats = l2.group_dispersion(values, groups)
    for g, members in enumerate(groups):
        x = values[members]
        assert stats.mean[g] == pytest.approx(x.mean())
        assert stats.std[g] == pytest.approx(x.std(ddof=1))
        np.testing.assert_allclose(stats.z[g][: x.size], (x - x.mean()) / x.std(ddof=1))
    assert np.isnan(stats.z[0][3:]).all()
    assert [l2.LEVELS[i] for i in stats.level] == ["balanced", "severe"]


def test_z_threshold_adapts_to_what_small_groups_can_reach() -> None:
    values = np.array([1.0] * 7 + [1.5])
    stats = l2.group_dispersion(values, [np.arange(8)])
    assert stats.z[0, 7] == pytest.approx(7 / np.sqrt(8))  # the largest z possible for m = 8
    assert l2.outliers(stats)[0].tolist() == [False] * 7 + [True]


def test_two_stragglers_in_a_small_group_are_both_found() -> None:
    values = np.array([1.0, 1.01, 0.99, 1.0, 1.0, 1.0, 1.6, 1.6])
    stats = l2.group_dispersion(values, [np.arange(8)])
    assert np.flatnonzero(l2.outliers(stats)[0]).tolist() == [6, 7]


def test_balanced_group_flags_nobody() -> None:
    values = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.001])  # huge z, CV ≪ 0.02
    assert not l2.outliers(l2.group_dispersion(values, [np.arange(8)])).any()


Groups = dict[str, Sequence[np.ndarray] | np.ndarray]


def _job(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], Groups]:
    n_ranks = 16  # TP = 2, DP = 8: DP groups are the even and the odd ranks
    base = {"model_fwd_loss": 100.0, "model_backward": 200.0, "optim_step": 20.0}
    events = {k: rng.normal(v, v * 0.002, (10, n_ranks)) for k, v in base.items()}
    events["dp-allreduce"] = rng.normal(50.0, 0.1, (10, n_ranks))
    groups: Groups = {
        "dp": [np.arange(0, 16, 2), np.arange(1, 16, 2)],
        "tp": np.arange(16).reshape(8, 2),
    }
    return events, groups


def test_compute_straggler_routes_to_gpu_compute_in_its_dp_group() -> None:
    events, groups = _job(np.random.default_rng(0))
    events["model_fwd_loss"][:, 5] *= 1.8  # ARGUS Case 1: compute-only phase on one rank
    events["dp-allreduce"][:, 5] -= 30.0  # ... arrives last, so waits least (Case 5)
    out = l2.findings(events, groups)
    by_stage = {f.stage: f for f in out}
    fwd = by_stage["model_fwd_loss"]
    assert fwd.culprit_ranks == (5,) and fwd.component == "gpu_compute"
    assert fwd.evidence["group_kind"] == "dp" and fwd.evidence["group_index"] == 1
    comm = by_stage["dp-allreduce"]
    assert comm.culprit_ranks == (5,) and "late_arrival" in comm.labels
    assert comm.component is None
    assert set(by_stage) == {"model_fwd_loss", "dp-allreduce"}


def test_rank_slow_on_every_phase_points_to_host_cpu() -> None:
    events, groups = _job(np.random.default_rng(1))
    for name in ("model_fwd_loss", "model_backward", "optim_step"):
        events[name][:, 4] *= 1.3
    out = l2.findings(events, groups)
    host = [f for f in out if f.component == "host_software"]
    assert len(host) == 1 and host[0].culprit_ranks == (4,)
    assert "all_phases_slow" in host[0].labels


def test_unrouted_events_and_missing_groups_are_skipped() -> None:
    events, groups = _job(np.random.default_rng(2))
    events["model_fwd_loss"][:, 5] *= 2
    assert l2.findings({"unknown_event": events["model_fwd_loss"]}, groups) == []
    assert l2.findings(events, {"tp": groups["tp"]}) == []
    assert l2.ROUTES["moe_experts"].group == "ep" and l2.ROUTES["self_attention"].group == "dp"
