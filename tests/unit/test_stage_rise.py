"""diagnosis.triggers.stage_rise: a rank's own stage rising, read from every rank's stored stage
records — the trigger for a slowdown the job's step time absorbs."""

from __future__ import annotations

import numpy as np

from diagnosis.triggers.stage_rise import STAGES, StageRise, StageRiseConfig
from diagnosis.triggers.watch import JobWatch
from ingest.records import JobTopology
from ingest.units import SECOND

MS = SECOND // 1000


def stage_rows(steps: range, world: int, slow: dict[int, tuple[str, float, int]] | None = None,
               seed: int = 0) -> dict[str, np.ndarray]:
    """Stage records of `world` ranks over `steps`: every stage ~10 ms with 5 % noise; `slow`
    maps a rank to (stage, factor, from step)."""
    rng = np.random.default_rng(seed)
    n = len(steps) * world
    step = np.repeat(np.asarray(steps, dtype=np.int64), world)
    rank = np.tile(np.arange(world, dtype=np.int64), len(steps))
    cols: dict[str, np.ndarray] = {"rank": rank, "step": step,
                                   "t_start": step * 60 * MS}
    for s in STAGES:
        v = 10 * MS * (1 + 0.05 * rng.standard_normal(n))
        for r, (stage, f, since) in (slow or {}).items():
            if stage == s:
                v = np.where((rank == r) & (step >= since), v * f, v)
        cols[s] = v.astype(np.int64)
    return cols


def test_a_rank_whose_stage_doubled_fires_once_with_its_onset() -> None:
    sr = StageRise(8)
    assert sr.observe(stage_rows(range(0, 40), 8)) == []  # fault-free: nothing
    fired = []
    for s in range(40, 60):  # rank 5's optimizer 6x from step 44, a step per batch
        fired += sr.observe(stage_rows(range(s, s + 1), 8, {5: ("optim_step", 6.0, 44)}, s))
    assert [(r, st, onset) for r, st, onset, _ in fired] == [(5, "optim_step", 44)]
    assert fired[0][3] > 4


def test_noise_and_a_small_rise_do_not_fire() -> None:
    sr = StageRise(4)
    assert sr.observe(stage_rows(range(0, 60), 4, {1: ("model_backward", 1.6, 30)})) == []
    # a stage that is ~0 and rises by less than 3 % of the step: no trigger either
    rows = stage_rows(range(60, 80), 4)
    rows["callbacks"] = np.where(rows["rank"] == 2, int(MS), 0)
    assert StageRise(4).observe(rows) == []


def test_late_and_hostile_records_change_nothing() -> None:
    sr = StageRise(4, StageRiseConfig())
    sr.observe(stage_rows(range(0, 40), 4))
    kept = sr.val.copy()
    late = stage_rows(range(5, 6), 4, {0: ("model_fwd_loss", 50.0, 0)})  # step 5 again, slow
    bad = stage_rows(range(40, 41), 4)
    bad["rank"] = np.asarray([-1, 4, 10**9, 2])  # out of range, except rank 2
    bad["step"] = np.asarray([40, 40, 40, -7])  # ... whose step is not one
    assert sr.observe(late) == [] and sr.observe(bad) == []
    assert np.array_equal(sr.val, kept)


def test_the_watch_fires_a_straggler_for_an_unsampled_rank() -> None:
    topo = JobTopology(job_id="j", world_size=8, ts=0, pp=4, tp=1, dp=2, microbatches=4,
                       hosts=[f"h{r // 2}" for r in range(8)])
    w = JobWatch(topo)
    rank = next(r for r in range(8) if r not in w.sample.ranks)
    got = []
    for s in range(0, 60):
        rows = stage_rows(range(s, s + 1), 8, {rank: ("optim_step", 6.0, 44)}, s)
        got += [t for t in w.observe(int(s * 60 * MS), stages=rows)
                if t.evidence.get("rule") == "rankwatch.stage_rise"]
    assert len(got) == 1 and got[0].kind == "straggler" and got[0].ranks == (rank,)
    assert got[0].evidence["onset_step"] == 44
