"""Partial-graph halt point of a hang (VenusTrace §3.3) and the ops → 1F1B mapping."""

from __future__ import annotations

import numpy as np
import pytest

from diagnosis.rules.halt_point import halt_point, hung_step
from diagnosis.rules.pipeline_ops import durations, pass_times, pp_plan, stage_order
from tests.unit.pipeline_fixtures import B_NS, F_NS, Hang, generate

NOW = 10**13


def test_plan_shapes_match_megatron_1f1b():
    assert stage_order(4, 4, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                    ("F", 3), ("B", 3)]
    assert stage_order(4, 4, 0)[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert [len(pp_plan(4, 4, s)) for s in range(4)] == [8, 16, 16, 8]
    try:
        from ingest.sim.schedule import stage_order as sim_order
    except ImportError:  # the simulator is optional here
        return
    for pp, m in ((1, 3), (2, 4), (4, 8), (5, 3)):
        for s in range(pp):
            assert stage_order(pp, m, s) == sim_order(pp, m, s)


@pytest.mark.parametrize("with_step", [False, True])
def test_pass_times_recover_durations(with_step):
    ops, grid, spec = generate(2, 4, 1, 4, 2, steps=3, with_step=with_step)
    r = grid.rank_at(0, 2, 1)
    pt = pass_times(ops, spec, 2, r, str(grid.comm_of("pp")[r]), str(grid.comm_of("tp")[r]), 1)
    assert pt.complete.all()
    dur = durations(pt)
    # passes that start on a Recv or after another pass are timed exactly
    assert np.allclose(dur[1], B_NS, atol=2000) and np.allclose(dur[0], F_NS, atol=2000)


def test_compute_hang_names_node_and_the_tp_rank_that_stopped():
    h = Hang(step=2, replica=1, stage=1, kind=0, mb=2, tp_rank=1, calls_done=1)
    ops, grid, spec = generate(2, 4, 2, 4, 2, steps=3, hang=h)
    assert hung_step(ops, grid, spec) == 2
    found = halt_point(ops, grid, spec, NOW)
    assert [(f.stage, f.culprit_ranks, f.component) for f in found] == \
        [("fwd mb=2 pp=1", (grid.rank_at(1, 1, 1),), "gpu_compute")]
    assert "min_tp_calls" in found[0].labels
    assert found[0].evidence["waiting_replicas"] == [0]


def test_backward_hang_with_tp1_uses_pp_markers():
    h = Hang(step=1, replica=0, stage=2, kind=1, mb=1, tp_rank=0, calls_done=0)
    ops, grid, spec = generate(1, 4, 2, 4, 0, steps=2, hang=h)
    found = halt_point(ops, grid, spec, NOW)
    assert [(f.stage, f.culprit_ranks) for f in found] == [("bwd mb=1 pp=2",
                                                             (grid.rank_at(0, 2, 0),))]


def test_data_loading_when_first_stage_forward_never_computes():
    h = Hang(step=1, replica=0, stage=0, kind=0, mb=1, tp_rank=-1, calls_done=0)
    ops, grid, spec = generate(2, 2, 2, 4, 2, steps=2, hang=h)
    found = halt_point(ops, grid, spec, NOW)
    assert [(f.stage, f.component) for f in found] == [("data", "data_loader")]
    ops1, grid1, spec1 = generate(1, 2, 2, 4, 0, steps=2, hang=h)
    f1 = halt_point(ops1, grid1, spec1, NOW)
    assert f1[0].stage == "fwd mb=1 pp=0" and "data_or_fwd" in f1[0].labels


def test_everyone_waiting_in_dp_allreduce():
    ops, grid, spec = generate(2, 2, 2, 2, 1, steps=2)
    last = ops["step"] == -1
    dp_rows = np.isin(ops["comm_id"], grid.comms("dp")) & last & (ops["op_seq"] == 1)
    ops["t_end"] = np.where(dp_rows, 0, ops["t_end"])
    found = halt_point(ops, grid, spec, NOW)
    assert [(f.stage, f.culprit_ranks) for f in found] == [("dp_allreduce", ())]
    ok, _, _ = generate(2, 2, 2, 2, 1, steps=2)  # nothing of step 2 exists: between steps
    assert [(f.stage, f.culprit_ranks) for f in halt_point(ok, grid, spec, NOW)] == \
        [("between_steps", ())]
