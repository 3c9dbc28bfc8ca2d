"""The simulator's beats carry each rank's position as the PyTorch tracer's do (step, stage,
stage_ts): a rank hung inside backward keeps beating `model.backward` at its hung step."""

from __future__ import annotations

import numpy as np

from ingest.batch import decode_batch
from ingest.records import Beat
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Positions, Simulation


def beats_of(sim: Simulation) -> dict[str, np.ndarray]:
    parts = [decode_batch(d).cols for _, k, d in sim.batches() if k == "beats"]
    return {c: np.concatenate([np.asarray(p[c]) for p in parts]) for c in parts[0]}


def test_a_hung_rank_beats_the_stage_it_is_inside() -> None:
    sim = Simulation(JobConfig(tp=1, pp=2, dp=2, steps=10, microbatches=4, hang_tail_s=4),
                     ["hang rank=3 stage=bwd mb=1 at=2s"])
    b = beats_of(sim)
    assert set(b) >= {"step", "stage", "stage_ts"} and set(b["stage"]) <= set(
        Beat.model_fields["stage"].annotation.__args__)  # type: ignore[union-attr]
    last = b["ts"] == b["ts"].max()
    hung = last & (b["rank"] == 3)
    assert set(b["stage"][hung]) == {"model.backward"}
    assert len(set(b["step"][hung])) == 1 and (b["stage_ts"][hung] < b["ts"][hung]).all()
    # every rank's position, once known, entered before the beat that carries it
    known = b["stage_ts"] > 0
    assert known.mean() > 0.9 and (b["stage_ts"][known] <= b["ts"][known] + 10**6).all()


def test_positions_take_the_last_transition_and_forget_only_what_no_beat_needs() -> None:
    p = Positions()
    step, stage, t = p.at(np.array([0, 1]), np.array([1.0, 2.0]))  # nothing observed yet
    assert step.tolist() == [-1, -1] and stage.tolist() == [0, 0] and np.isnan(t).all()
    p.rank = np.array([0, 0, 0, 1, 1])
    p.t = np.array([1.0, 2.0, 3.0, 1.5, 2.5])
    p.step = np.array([0, 0, 0, 0, 0])
    p.stage = np.array([1, 2, 3, 1, 5])
    step, stage, t = p.at(np.array([0, 0, 1, 1, 2]), np.array([2.5, 0.5, 2.5, 9.0, 2.0]))
    assert stage.tolist() == [2, 0, 5, 5, 0] and step.tolist() == [0, -1, 0, 0, -1]
    assert t[0] == 2.0 and np.isnan(t[1])
    p.forget_before(2.6)
    kept = sorted(zip(p.rank.tolist(), p.t.tolist(), strict=True))
    assert kept == [(0, 2.0), (0, 3.0), (1, 2.5)]
    assert p.at(np.array([0]), np.array([2.7]))[1].tolist() == [2]


def test_ranks_of_a_contended_host_wait_for_a_cpu_in_their_beats() -> None:
    """The beats carry each rank's scheduler counters as the host agent's do (cumulative ns
    runnable and waiting): under host CPU contention (factor f) the host's ranks wait
    (f − 1)/f of their CPU-side work from the onset on; other ranks, and every rank before
    it, never wait."""
    from diagnosis.slow.cpu import wait_shares

    cfg = JobConfig(tp=2, pp=2, dp=4, steps=40, ranks_per_host=4)
    sim = Simulation(cfg, ["cpu_contention host=1 factor=4 at=10s"])
    b = beats_of(sim)
    assert (b["sched_wait_ns"] >= 0).all() and (b["sched_run_ns"] >= 0).all()
    onset = cfg.epoch_ns + 10 * 10**9
    ranks, before, after = wait_shares(b, onset)
    host = np.isin(ranks, [4, 5, 6, 7])
    assert np.allclose(before[host], 0) and (after[host] > 0.02).all()
    assert np.allclose(after[~host], 0) and np.allclose(before[~host], 0)
