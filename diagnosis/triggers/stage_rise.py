"""A rank's own stage rising: the trigger for a slowdown the job's step time does not show.

The step-time triggers (`watch.JobWatch`: ARGUS L1, VenusTrace's expected step) follow the job's
step time on the sampled ranks. A rank whose own stage got slower inside a pipeline bubble (a
stage-2 rank's optimizer 6× slower while its neighbours wait on other work anyway) leaves the
step time where it was: no step trigger fires, and until a sweep came (every `min_sweep_s` to
`sweep_s`) nothing looked — on the real catalog's 8-rank pipeline such a slowdown was named 25–29
steps after its onset, its evidence complete after 8.

This trigger reads every rank's stage records as they are stored (not only the sampled ranks':
a stage record per rank and step is already the cheapest record there is, and the rank that
slowed need not be sampled). Per (rank, stage) it compares the rank's newest `k` steps with the
median of the `base` steps before them; a stage whose newest steps' lower median (3 of 4 at
least that high) at least doubled (`ratio`) and rose by at least `min_share` of the job's step
time fires one "straggler" trigger (rule `rankwatch.stage_rise`) naming the rank. It only says
where and when to look: the slowdown analysis judges the rise against the rank's own noise and
its peers (`slow.context.judge`; an absorbed change must hold `2 × onset_steps` unless the rank's
CPU counters rule out the scheduler), and a trigger whose analysis finds nothing yet is tried
again as stage records are stored (`Analyst.retry_slow`).
One trigger per rank per episode: a rank fires again only once its newest `k + base` steps no
longer include the onset it was reported for.

State per job: [world, history, stages] float32 durations and [world, history] step numbers
(512 bytes a rank: 8 MiB at 16,384 ranks), indexed by step modulo `history` (a newer step
overwrites an older one; a late record of an older step does not). Vectorized over the ranks of
a batch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from diagnosis.columns import Columns, ints
from ingest.torch.events import STAGE_FIELDS

RULE = "rankwatch.stage_rise"
STAGES = STAGE_FIELDS  # the six stage durations of a stage record


@dataclass(frozen=True)
class StageRiseConfig:
    k: int = 4  # the newest steps (slow.SlowConfig.onset_steps)
    base: int = 12  # the steps before them: the rank's own level
    ratio: float = 2.0  # median rise factor (slow.SlowConfig.absorbed_ratio)
    min_share: float = 0.03  # and at least this share of the job's step time
    history: int = 16  # steps kept per rank (≥ k + base)


@dataclass
class StageRise:
    world: int
    config: StageRiseConfig = field(default_factory=StageRiseConfig)
    val: np.ndarray = field(init=False)
    step: np.ndarray = field(init=False)
    reported: np.ndarray = field(init=False)  # per rank: the onset step last reported

    def __post_init__(self) -> None:
        h = max(self.config.history, self.config.k + self.config.base)
        self.val = np.zeros((self.world, h, len(STAGES)), dtype=np.float32)  # 6 MiB at 16k ranks
        self.step = np.full((self.world, h), -1, dtype=np.int64)
        self.reported = np.full(self.world, -1, dtype=np.int64)

    def observe(self, stages: Columns) -> list[tuple[int, str, int, float]]:
        """Fold stored stage records in; (rank, stage, onset step, ratio) per rank whose stage
        rose (module docstring), at most one per rank."""
        rank, step = ints(stages, "rank", -1), ints(stages, "step", -1)
        ok = (rank >= 0) & (rank < self.world) & (step >= 0)
        if not ok.any():
            return []
        h = self.step.shape[1]
        rank, step = rank[ok], step[ok]
        vals = np.stack([ints(stages, c, 0)[ok] for c in STAGES], axis=1).astype(np.float32)
        slot = step % h
        # a newer step takes its slot; within the batch the newest row per slot is written last
        order = np.argsort(step, kind="stable")
        rank, step, slot, vals = rank[order], step[order], slot[order], vals[order]
        newer = step >= self.step[rank, slot]
        self.step[rank[newer], slot[newer]] = step[newer]
        self.val[rank[newer], slot[newer]] = vals[newer]
        return self._judge(np.unique(rank[newer]))

    def _judge(self, ranks: np.ndarray) -> list[tuple[int, str, int, float]]:
        cfg = self.config
        n = cfg.k + cfg.base
        if not ranks.size:
            return []
        st = self.step[ranks]  # [R, h]
        newest = np.argsort(-st, axis=1, kind="stable")[:, :n]  # slots, newest first
        steps = np.take_along_axis(st, newest, axis=1)
        full = (steps >= 0).all(axis=1)
        if not full.any():
            return []
        ranks, newest, steps = ranks[full], newest[full], steps[full]
        v = self.val[ranks[:, None], newest]  # [R, n, stages]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            # the newest k steps' lower median: most of them (3 of 4) must have risen
            now = np.sort(v[:, : cfg.k], axis=1)[:, (cfg.k - 1) // 2]  # [R, stages]
            before = np.median(v[:, cfg.k:], axis=1)
            step_ns = float(np.median(v[:, cfg.k:].sum(axis=2)))
        rise = now - before
        hit = (now >= cfg.ratio * before) & (rise >= cfg.min_share * step_ns) & (rise > 0)
        oldest = steps[:, -1]
        fresh = self.reported[ranks] < oldest  # the last report's onset left the compared steps
        out = []
        for i in np.flatnonzero(hit.any(axis=1) & fresh).tolist():  # per rank that rose
            s = int(np.argmax(np.where(hit[i], rise[i], -np.inf)))
            r = int(ranks[i])
            # the onset: the oldest of the newest k steps above the risen level's threshold
            above = np.flatnonzero(v[i, : cfg.k, s] >= cfg.ratio * before[i, s])
            onset = int(steps[i, above.max()]) if above.size else int(steps[i, cfg.k - 1])
            self.reported[r] = onset
            # a stage that was 0 (a rank without callbacks) has no ratio: shown as 1,000
            ratio = min(float(now[i, s] / before[i, s]), 1e3) if before[i, s] > 0 else 1e3
            out.append((r, STAGES[s], onset, ratio))
        return out
