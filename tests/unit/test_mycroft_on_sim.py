"""The hang rules against the simulator's records (ingest/sim): the ops → 1F1B mapping of
pipeline_ops.py must match what the simulator emits, and the rules must name its ground truth."""

from __future__ import annotations

import numpy as np
import pytest

from diagnosis.expectation import Expectation
from diagnosis.groups import grid_of
from diagnosis.rules.critical_path import analyze_slowdown, update_expected
from diagnosis.rules.halt_point import halt_point
from diagnosis.rules.mycroft_hang import analyze_hang
from diagnosis.rules.pipeline_ops import PipelineSpec, durations, pass_times

sim = pytest.importorskip("ingest.sim.simulation")
config = pytest.importorskip("ingest.sim.config")


def run(fault: str, steps: int = 6):
    cfg = config.JobConfig(tp=2, pp=4, dp=2, steps=steps)
    data = sim.collect(sim.Simulation(cfg, [fault]).batches())
    grid = grid_of(data["jobs"]["topology"][0])
    spec = PipelineSpec(pp=cfg.pp, microbatches=cfg.microbatches,
                        tp_ops_per_pass=cfg.tp_collectives)
    return cfg, data, grid, spec


@pytest.mark.parametrize(("fault", "stage", "rank", "component", "alg2_stage"), [
    ("hang rank=13 stage=bwd mb=3 at=2s", "bwd mb=3 pp=3", 13, "gpu_compute", "tp AllReduce"),
    ("hang rank=2 stage=fwd mb=5 at=2s", "fwd mb=5 pp=0", 2, "gpu_compute", "tp AllReduce"),
    ("hang rank=0 stage=data at=2s", "data", 0, "data_loader", None),
    ("death rank=6 at=2s", None, 6, "host_software", "process"),
])
def test_hang_stage_and_rank(fault, stage, rank, component, alg2_stage):
    _, data, grid, spec = run(fault)
    ops = data["ops"]
    now = int(max(ops["t_enqueue"].max(), data["beats"]["ts"].max()))
    halt = halt_point(ops, grid, spec, now)
    assert [f.culprit_ranks for f in halt] == [(rank,)]
    if stage is not None:
        assert halt[0].stage == stage
    alg2 = analyze_hang(ops, grid, now, chunks=data.get("chunks"), beats=data.get("beats"))
    assert [f.culprit_ranks for f in alg2] == [(rank,)]
    chosen = alg2[0] if alg2_stage == "process" else halt[0]
    assert chosen.component == component
    if alg2_stage is not None:
        assert alg2[0].stage == alg2_stage


def test_gpu_slowdown_on_the_critical_path_names_the_rank():
    cfg, data, grid, spec = run("gpu_slow rank=13 factor=2.0 at=4s", steps=10)
    ops = data["ops"]
    rg = grid.replica_grid()
    pp_of, tp_of = grid.comm_of("pp"), grid.comm_of("tp")
    exp = Expectation(shape=(cfg.pp, 2, cfg.microbatches))
    blamed = []
    for step in range(cfg.steps):
        d = np.full((cfg.dp, cfg.pp, cfg.tp, 2, cfg.microbatches), np.nan)
        w = np.full_like(d, np.nan)
        for r in range(grid.world):
            dd, s, t = int(grid.dp_index[r]), int(grid.stage[r]), int(grid.tp_index[r])
            pt = pass_times(ops, spec, s, int(rg[dd, s, t]), str(pp_of[r]), str(tp_of[r]), step)
            d[dd, s, t], w[dd, s, t] = durations(pt), pt.tp_wait
        if step >= 7:
            blamed += [f.culprit_ranks for f in analyze_slowdown(d, exp, grid, tp_wait=w)]
        update_expected(exp, d)
    assert blamed and all(b == (13,) for b in blamed)
