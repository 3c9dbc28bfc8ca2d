"""VenusTrace critical path on the 1F1B DAG (App. A, Alg. 2) with a Fig. 7-style example."""

from __future__ import annotations

from typing import cast

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from diagnosis.expectation import Expectation
from diagnosis.groups import grid_of
from diagnosis.rules.critical_path import (
    analyze_slowdown,
    build_1f1b_dag,
    critical_path,
    update_expected,
)
from tests.unit.topo_fixtures import megatron_topology

F, B = 0, 1


def uniform(pp: int = 4, m: int = 4, f: float = 1.0, b: float = 2.0) -> np.ndarray:
    d = np.zeros((pp, 2, m))
    d[:, F, :], d[:, B, :] = f, b
    return d


def test_uniform_1f1b_makespan_and_bubbles():
    dag = build_1f1b_dag(uniform())
    cp = critical_path(dag)
    # (P − 1)·(F + B) of fill/drain plus M·(F + B) on the last stage: 3·3 + 4·3 = 21
    assert cp.makespan == 21.0
    labels = [dag.label(i) for i in cp.path]
    assert labels[0] == "fwd mb=0 pp=0" and labels[-1] == "bwd mb=3 pp=0"
    assert cp.slack[dag.node(0, F, 2)] == 4.0  # warm-up forward waits in a bubble


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.data())
def test_critical_path_length_equals_makespan(pp, m, data):
    d = data.draw(arrays(np.float64, (pp, 2, m), elements=st.floats(0.1, 10.0)))
    ar = data.draw(arrays(np.float64, (pp,), elements=st.floats(0.0, 5.0)))
    dag = build_1f1b_dag(d, ar)
    cp = critical_path(dag)
    assert np.isclose(sum(dag.duration[i] for i in cp.path), cp.makespan)
    assert np.all(cp.slack >= -1e-9 * cp.makespan)
    assert np.isclose(cp.eft.max(), cp.makespan)
    for a, b in zip(cp.path, cp.path[1:], strict=False):  # a chain of DAG edges
        assert a in dag.preds[b]


def fig7_step(slow: dict[tuple[int, int, int, int], float], dp: int = 2) -> np.ndarray:
    """[D, P, T, 2, M] durations: replica 1 gets `slow[(s, kind, m, t)]` multipliers."""
    d = np.broadcast_to(uniform()[None, :, None], (dp, 4, 2, 2, 4)).copy()
    for (s, k, m, t), x in slow.items():
        d[1, s, t, k, m] *= x
    return d


def test_fig7_only_critical_slow_nodes_are_reported_and_drilled_down():
    grid = grid_of(megatron_topology(2, 4, 2))  # TP=2 PP=4 as in Fig. 7
    exp = Expectation(shape=(4, 2, 4))
    for _ in range(3):
        update_expected(exp, fig7_step({}))
    slow = {
        (0, F, 2, 0): 2.0, (0, F, 2, 1): 2.0,  # S1: warm-up forward, inside a bubble
        (1, F, 1, 0): 2.0, (1, F, 1, 1): 2.0,  # S2: bubble
        (1, F, 0, 0): 2.0, (1, F, 0, 1): 2.0,  # S3: on the path, both TP ranks
        (0, B, 0, 1): 2.0,  # S4: bubble
        (3, B, 2, 1): 2.0,  # S5: on the path, TP rank 1 only
        (1, B, 3, 0): 2.0,  # S6: on the path, TP rank 0 only
    }
    found = analyze_slowdown(fig7_step(slow), exp, grid, step=7)
    by_stage = {f.stage: f for f in found}
    assert set(by_stage) == {"fwd mb=0 pp=1", "bwd mb=2 pp=3", "bwd mb=3 pp=1"}
    absorbed = set(cast(list[str], found[0].evidence["absorbed"]))
    assert {"fwd mb=2 pp=0", "fwd mb=1 pp=1", "bwd mb=0 pp=0"} <= absorbed
    s5 = by_stage["bwd mb=2 pp=3"]
    assert s5.culprit_ranks == (grid.rank_at(1, 3, 1),) and s5.component == "gpu_compute"
    s3 = by_stage["fwd mb=0 pp=1"]
    assert s3.culprit_ranks == tuple(sorted([grid.rank_at(1, 1, 0), grid.rank_at(1, 1, 1)]))
    assert "tp_group_uniform" in s3.labels
    assert all(f.evidence["replica"] == 1 for f in found)


def test_slow_dp_allreduce_on_the_path():
    grid = grid_of(megatron_topology(1, 2, 2))
    d = np.broadcast_to(uniform(2, 2)[None, :, None], (2, 2, 1, 2, 2)).copy()
    exp, exp_ar = Expectation(shape=(2, 2, 2)), Expectation(shape=(2,))
    for _ in range(3):
        update_expected(exp, d)
        exp_ar.update(np.array([1.0, 1.0]))
    ar = np.ones((2, 2, 1))
    ar[:, 0, :] = 5.0  # stage 0's AllReduce transfer itself is slow on every member
    found = analyze_slowdown(d, exp, grid, allreduce=ar, expected_ar=exp_ar)
    assert [(f.stage, f.component) for f in found] == [("dp_allreduce", "nic_rdma")]


def test_drill_down_by_tp_wait_when_tp_ranks_share_pass_time():
    """TP ranks synchronize, so pass times match; the slow rank is the one that waits least."""
    grid = grid_of(megatron_topology(2, 4, 2))
    exp = Expectation(shape=(4, 2, 4))
    for _ in range(3):
        update_expected(exp, fig7_step({}))
    step = fig7_step({(1, F, 0, 0): 2.0, (1, F, 0, 1): 2.0})  # both TP ranks see the long pass
    wait = np.full_like(step, 0.1)
    wait[1, 1, 1, F, 0] = 0.1  # rank t=1 computed slowly: it never waited
    wait[1, 1, 0, F, 0] = 1.1  # rank t=0 waited ~1.0 for it inside the TP collectives
    found = analyze_slowdown(step, exp, grid, tp_wait=wait)
    assert [(f.stage, f.culprit_ranks) for f in found] == [("fwd mb=0 pp=1",
                                                             (grid.rank_at(1, 1, 1),))]
