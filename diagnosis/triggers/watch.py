"""One job's always-on triggers over its sampled ranks (DESIGN.md "Diagnosis", stage 1).

`JobWatch` composes the trigger modules and owns their state for one job:
- sampling (`sampling.sample_ranks`): ≥ 1 rank per DP group, ≤ 10 per job; a sampled rank that
  goes silent (no op progress and no beat for the hang timeout) is treated as dead and replaced —
  the dead rank itself was already reported by the hang trigger;
- Mycroft Alg. 1 (`mycroft.mycroft_trigger`) on the sampled ranks' ops: failure and straggler.
  Δ is adapted to the job: max(3 × expected step time, 2 s) once the step time is known (the
  paper's 10 s otherwise) — a 10 s Δ alone would miss the ≤ 5 s detection target on 1 s steps;
- Mycroft's straggler test on the progress feed (`mycroft_progress.progress_straggler_trigger`,
  per sampled (rank, comm), over spans of ≥ 3 expected steps): what the real pipeline feeds;
- VenusTrace/MegaTrace heartbeat (`heartbeat.heartbeat_trigger`): no op call or completion for
  n × expected step time → hang; the expected time is learned from the sampled ranks' steps,
  each step once its time is final (a later step has arrived). The same timer is also read
  from the op counters in the host agents' beats as they are stored (`observe_beats`,
  `heartbeat.beat_progress_trigger`): the beats do not wait for the progress feed's windows;
- ARGUS L1 on the job's step-time series (max over sampled ranks per step): a regression
  (full-scan change point) whose onset is among the last `recent` steps, and jitter (ratio-gated,
  effective width) whose onset is the newest step; plus VenusTrace's expected-time test at the
  step level: `k` consecutive steps above (1 + β) × expected → straggler (fires 2 steps after a
  slowdown, before L1 has the 5 points it needs on each side). The run is counted over the
  step series itself (the newest steps, each once), not per call: the derived feed may deliver a
  step again (a preview, then its window's rows; a recomputed window; a redelivery after a
  restart) or several steps in one message, and neither may change the count. One trigger per
  run: a run is identified by its first step.
- a rank's own stage rising (`stage_rise.StageRise`, rule `rankwatch.stage_rise`), read from
  every rank's stored stage records: a slowdown the job's step time absorbs moves none of the
  above.

Inputs per call (all optional, any ranks — rows of unsampled ranks are ignored): `ops` rows
(rank, comm_id, op_seq, bytes, t_enqueue, t_start, t_end), `beats` rows (rank, ts), `progress`
rows (streams/progress.py: window_end, rank, comm_id, completed_ops, bytes_per_s) and `steps`
rows (rank, step, step_ns, t_end) — the `iterations` kind, or `stages` rows converted with
`steps_from_stages`. The clock is the explicit `now_ns`. De-duplication: each trigger module fires
once per episode; the caller keeps incidents (diagnosis.incidents).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diagnosis.columns import Columns, ints
from diagnosis.rules.argus_l1 import L1Params, detect_jitter, detect_regression
from diagnosis.triggers.base import Trigger
from diagnosis.triggers.heartbeat import (
    BeatProgress,
    HeartbeatConfig,
    HeartbeatState,
    beat_progress_trigger,
    heartbeat_trigger,
    observe_steps,
)
from diagnosis.triggers.mycroft import MycroftTriggerConfig, MycroftTriggerState, mycroft_trigger
from diagnosis.triggers.mycroft_progress import ProgressStragglerState, progress_straggler_trigger
from diagnosis.triggers.sampling import Sample, sample_ranks
from diagnosis.triggers.stage_rise import RULE as STAGE_RISE
from diagnosis.triggers.stage_rise import StageRise
from ingest.records import JobTopology
from ingest.units import SECOND

STAGE_COLUMNS = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks",
                 "optim_step", "step_other")


@dataclass(frozen=True)
class WatchConfig:
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    l1: L1Params = field(default_factory=L1Params)
    series: int = 60  # step-time points kept for L1
    recent: int = 3  # a regression onset among the last `recent` steps is new
    beta: float = 0.08  # step-level expected-time test
    k: int = 2
    delta_steps: float = 3.0
    min_delta_ns: int = 2 * SECOND


def steps_from_stages(stages: Columns) -> dict[str, np.ndarray]:
    """`stages` rows → step rows (rank, step, step_ns, t_end): the six durations sum to the step."""
    total = sum(ints(stages, c, 0) for c in STAGE_COLUMNS)
    total_arr = np.asarray(total, dtype=np.int64)
    return {"rank": ints(stages, "rank"), "step": ints(stages, "step"), "step_ns": total_arr,
            "t_end": ints(stages, "t_start") + total_arr}


@dataclass
class JobWatch:
    topo: JobTopology
    config: WatchConfig = field(default_factory=WatchConfig)
    sample: Sample = field(init=False)
    heartbeat: HeartbeatState = field(init=False)
    beat_progress: BeatProgress = field(init=False)
    mycroft: MycroftTriggerState = field(init=False)
    progress: ProgressStragglerState = field(init=False)
    stage_rise: StageRise = field(init=False)
    step_ns: dict[int, float] = field(default_factory=dict)  # step -> max over sampled ranks
    step_end: dict[int, int] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    reported_onset: int = -1
    reported_jitter: int = -1
    reported_slow: int = -1

    def __post_init__(self) -> None:
        self.sample = sample_ranks(self.topo)
        self.heartbeat = HeartbeatState(self.topo.job_id, self.topo.world_size,
                                        self.config.heartbeat)
        self.beat_progress = BeatProgress(self.topo.world_size)
        self.mycroft = MycroftTriggerState(self.topo.job_id, np.asarray(self.sample.ranks),
                                           MycroftTriggerConfig())
        self.progress = ProgressStragglerState(self.topo.job_id)
        self.stage_rise = StageRise(self.topo.world_size)

    @property
    def ranks(self) -> np.ndarray:
        return np.asarray(self.sample.ranks, dtype=np.int64)

    def expected_step_ns(self) -> float | None:
        e = self.heartbeat.expected
        return float(e.value) if bool(e.ready) else None

    def _mine(self, cols: Columns | None) -> Columns:
        if not cols or "rank" not in cols:
            return {}
        keep = np.isin(ints(cols, "rank"), self.ranks)
        return {k: np.asarray(v)[keep] for k, v in cols.items()}

    def observe(self, now_ns: int, *, ops: Columns | None = None, beats: Columns | None = None,
                steps: Columns | None = None, progress: Columns | None = None,
                stages: Columns | None = None) -> list[Trigger]:
        """Fold new rows in and evaluate every trigger at `now_ns`. `stages`: stored stage
        records of every rank (not only the sampled ones), for `stage_rise`."""
        out: list[Trigger] = []
        s = self._mine(steps)
        if s:
            out += self._steps(s, now_ns)
        if stages:
            out += self._stage_rise(stages, now_ns)
        exp = self.expected_step_ns()
        if exp is not None:
            delta = max(int(self.config.delta_steps * exp), self.config.min_delta_ns)
            if delta != self.mycroft.config.delta_ns:
                self.mycroft.config = MycroftTriggerConfig(delta_ns=delta)
        o, b = self._mine(ops), self._mine(beats)
        if not o:
            o = {k: np.zeros(0, dtype=np.int64) for k in ("rank", "bytes", "t_start", "t_end")}
        out += mycroft_trigger(self.mycroft, o, now_ns)
        p = self._mine(progress)
        if p:
            out += progress_straggler_trigger(self.progress, p, now_ns, step_ns=exp,
                                              delta_ns=self.mycroft.config.delta_ns)
        hb = heartbeat_trigger(self.heartbeat, o, b, now_ns)
        # the host agents' beats carry the ranks' op counters: the same timer, read sooner
        hb += beat_progress_trigger(self.heartbeat, self.beat_progress, b)
        out += hb
        for t in hb:
            self._resample([int(r) for r in t.evidence.get("silent_no_beats", [])  # type: ignore[attr-defined]
                            if int(r) in self.sample.ranks])
        return out

    def observe_beats(self, beats: Columns) -> list[Trigger]:
        """The host agents' beats as they are stored (rank, ts, comm_id, last_op_seq, exited):
        the heartbeat timer read from the op counters they carry, in the beats' own event time
        (`heartbeat.BeatProgress`)."""
        hb = beat_progress_trigger(self.heartbeat, self.beat_progress, self._mine(beats))
        for t in hb:
            self._resample([int(r) for r in t.evidence.get("silent_no_beats", [])  # type: ignore[attr-defined]
                            if int(r) in self.sample.ranks])
        return hb

    def _stage_rise(self, stages: Columns, now_ns: int) -> list[Trigger]:
        """One straggler trigger naming the ranks whose own stage rose (`stage_rise`)."""
        rose = self.stage_rise.observe(stages)
        if not rose:
            return []
        onset = min(o for _, _, o, _ in rose)
        return [Trigger(self.topo.job_id, now_ns, "straggler", tuple(sorted(r for r, *_ in rose)),
                        {"rule": STAGE_RISE, "onset_step": onset,
                         "stages": {str(r): st for r, st, _, _ in rose},
                         "ratio": max(x for *_, x in rose)})]

    def _resample(self, dead: list[int]) -> None:
        if not dead:
            return
        self.dead |= set(dead)
        self.sample = sample_ranks(self.topo, dead=self.dead)
        self.mycroft = self.mycroft.resample(np.asarray(self.sample.ranks))

    def _steps(self, s: Columns, now_ns: int) -> list[Trigger]:
        for st, d, e in zip(ints(s, "step").tolist(), ints(s, "step_ns").tolist(),
                            ints(s, "t_end").tolist(), strict=True):
            self.step_ns[st] = max(self.step_ns.get(st, 0.0), float(d))
            self.step_end[st] = max(self.step_end.get(st, 0), int(e))
        # a step's rows may come in parts (previews, rank by rank): T_expected learns a step's
        # time (the max over the sampled ranks) once a later step has been seen
        newest = max(self.step_ns, default=-1)
        done = np.asarray([k for k in sorted(self.step_ns)
                           if self.heartbeat.last_step < k < newest], dtype=np.int64)
        out = observe_steps(self.heartbeat, done,
                            np.asarray([self.step_ns[int(k)] for k in done]), now_ns,
                            np.asarray([self.step_end[int(k)] for k in done], dtype=np.int64))
        keys = sorted(self.step_ns)[-self.config.series:]
        for k in [k for k in self.step_ns if k < keys[0]]:
            self.step_ns.pop(k)
            self.step_end.pop(k, None)
        x = np.asarray([self.step_ns[k] for k in keys])
        if x.size == 0 or x.min() <= 0:
            return out
        out += self._l1(x, keys, now_ns)
        return out

    def _l1(self, x: np.ndarray, keys: list[int], now_ns: int) -> list[Trigger]:
        cfg = self.config
        out: list[Trigger] = []
        exp = self.expected_step_ns()
        if exp is not None:
            slow = x > (1 + cfg.beta) * exp
            run = int(np.argmin(slow[::-1])) if not slow.all() else int(slow.size)
            onset = keys[-run] if run else -1
            if run >= cfg.k and onset > self.reported_slow:
                self.reported_slow = onset
                out.append(Trigger(self.topo.job_id, now_ns, "straggler", self.sample.ranks, {
                    "rule": "venustrace.expected_step", "beta": cfg.beta, "k": cfg.k,
                    "expected_step_ns": exp, "last_step_ns": float(x[-1]),
                    "onset_step": onset, "onset_ns": self.step_end.get(onset - 1)}))
        reg = detect_regression(x, cfg.l1)
        if reg is not None and reg.onset >= x.size - cfg.recent - cfg.l1.min_segment:
            step = keys[reg.onset]
            if step > self.reported_onset + cfg.l1.min_segment:
                self.reported_onset = step
                out.append(Trigger(self.topo.job_id, now_ns, "regression", self.sample.ranks, {
                    "rule": "argus.l1.regression", "ratio": reg.ratio, "onset_step": step,
                    "onset_ns": self.step_end.get(step - 1), "mean_left": reg.mean_left,
                    "mean_right": reg.mean_right}))
        for j in detect_jitter(x, cfg.l1):
            step = keys[j.onset]
            if j.onset + j.width >= x.size and step > self.reported_jitter:
                self.reported_jitter = step
                out.append(Trigger(self.topo.job_id, now_ns, "jitter", self.sample.ranks, {
                    "rule": "argus.l1.jitter", "magnitude": j.magnitude, "onset_step": step,
                    "onset_ns": self.step_end.get(step - 1), "width": j.width}))
        return out
