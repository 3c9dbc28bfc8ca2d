"""Hang trigger by heartbeat timeout (VenusTrace §3.3 "Locate hang issue", Alg. 1 lines 1-5;
MegaTrace §III-C "Detection via Timeout").

The analyzer resets a per-rank timer whenever the rank's tracer reports progress; when the timer
exceeds n × T_expected (n = 2 in MegaTrace's example) it flags a potential hang. T_expected is the
expected step (iteration) time, learned as in VenusTrace Alg. 2 lines 2-10: the second step
initializes it, later steps within ±α (5 %) update it (`diagnosis.expectation.Expectation`).

What counts as progress: a new op call or completion (an `ops` row's t_enqueue or t_end) — the
papers' NCCL API log. A heartbeat record (`beats`) by itself does *not* reset the timer: a host
agent keeps beating while the training process is stuck in a kernel, which is exactly the live
hang we want to see; only the newer op counter a beat may carry does (`beat_progress_trigger`,
the same timer read from the beats, which reach the trigger without the progress feed's lag).
Beats are tracked separately as liveness, so the trigger's evidence can tell a live hang
(beats continue, no progress) from a silent rank (no beats either: process or host gone) — the
distinction Mycroft Alg. 2 and the hang rules refine.

Thresholds and choices:
- timeout = max(n × T_expected, `min_timeout_ns`): the floor (1 s) keeps sub-second steps from
  tripping on record batching delay (records leave a host every ~100 ms);
- before T_expected exists (first two steps, or a fresh state) the timeout is `cold_timeout_ns`
  (5 min), so a hang during start-up is still reported, late rather than never;
- a rank that never progressed is not judged (it has not started);
- a re-baselined T_expected (see `Expectation`: `rebase_after` consecutive consistent steps
  outside ±α) is reported as a "regression" trigger — VenusTrace would otherwise keep comparing
  against a stale value forever;
- one trigger per hang episode: a rank re-arms when it progresses again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diagnosis.columns import Columns, ints
from diagnosis.expectation import Expectation
from diagnosis.triggers.base import Trigger
from ingest.units import SECOND

Array = np.ndarray


@dataclass(frozen=True)
class HeartbeatConfig:
    n: float = 2.0
    alpha: float = 0.05
    min_timeout_ns: int = SECOND
    cold_timeout_ns: int = 300 * SECOND
    rebase_after: int = 5


@dataclass
class HeartbeatState:
    """Per-rank timers and the job's expected step time."""

    job_id: str
    world: int
    config: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    expected: Expectation = field(init=False)
    last_progress_ns: Array = field(init=False)
    last_alive_ns: Array = field(init=False)
    hung: Array = field(init=False)
    last_step: int = -1

    def __post_init__(self) -> None:
        c = self.config
        self.expected = Expectation(alpha=c.alpha, rebase_after=c.rebase_after)
        self.last_progress_ns = np.zeros(self.world, dtype=np.int64)
        self.last_alive_ns = np.zeros(self.world, dtype=np.int64)
        self.hung = np.zeros(self.world, dtype=bool)

    @property
    def timeout_ns(self) -> int:
        if not bool(self.expected.ready):
            return self.config.cold_timeout_ns
        return max(int(self.config.n * float(self.expected.value)), self.config.min_timeout_ns)


def observe_steps(state: HeartbeatState, step: Array, duration_ns: Array,
                  now_ns: int) -> list[Trigger]:
    """Fold completed steps into T_expected, in step order; rows may repeat a step (one row per
    rank, e.g. from `stages`): a step's time is the max over its rows (the job waits for the
    slowest rank). Steps at or before the last one seen are ignored."""
    step = np.asarray(step, dtype=np.int64)
    dur = np.asarray(duration_ns, dtype=np.float64)
    new = step > state.last_step
    if not new.any():
        return []
    uniq, inv = np.unique(step[new], return_inverse=True)
    per_step = np.full(uniq.size, -np.inf)
    np.maximum.at(per_step, inv, dur[new])
    out: list[Trigger] = []
    for s, d in zip(uniq.tolist(), per_step.tolist(), strict=True):
        before = float(state.expected.value)
        _, rebased = state.expected.update(d)
        if bool(rebased):
            out.append(Trigger(state.job_id, now_ns, "regression", (), {
                "rule": "venustrace.expected_step", "step": int(s),
                "expected_before_ns": before, "expected_after_ns": float(state.expected.value),
                "alpha": state.config.alpha, "consecutive_steps": state.config.rebase_after,
            }))
    state.last_step = int(uniq[-1])
    return out


def heartbeat_trigger(state: HeartbeatState, progress: Columns, beats: Columns,
                      now_ns: int) -> list[Trigger]:
    """Update timers from `progress` (ops rows: rank, t_enqueue, t_end) and `beats` (rank, ts),
    then report ranks silent for longer than the timeout at `now_ns` (first time per episode)."""
    if progress:
        rank = ints(progress, "rank")
        ts = np.maximum(ints(progress, "t_enqueue", 0), ints(progress, "t_end", 0))
        ok = (rank >= 0) & (rank < state.world) & (ts <= now_ns)
        np.maximum.at(state.last_progress_ns, rank[ok], ts[ok])
    if beats:
        rank = ints(beats, "rank")
        ts = ints(beats, "ts")
        ok = (rank >= 0) & (rank < state.world) & (ts <= now_ns)
        np.maximum.at(state.last_alive_ns, rank[ok], ts[ok])
    state.last_alive_ns = np.maximum(state.last_alive_ns, state.last_progress_ns)

    fired, state.hung = _timer(state, now_ns, state.last_progress_ns, state.last_alive_ns,
                               state.hung, {})
    return fired


def _timer(state: HeartbeatState, now_ns: int, progress_ns: Array, alive_ns: Array, hung: Array,
           extra: dict[str, object]) -> tuple[list[Trigger], Array]:
    """The heartbeat timeout at `now_ns` over per-rank last progress and last sign of life:
    (the trigger, if a rank went silent since the last look; the new `hung` mask)."""
    timeout = state.timeout_ns
    silent = (progress_ns > 0) & (now_ns - progress_ns > timeout)
    fire = silent & ~hung
    if not fire.any():
        return [], silent
    w = np.flatnonzero(silent)
    lp = progress_ns[w]
    alive = (now_ns - alive_ns[w]) <= timeout
    first = w[lp <= lp.min() + state.config.min_timeout_ns]
    return [Trigger(state.job_id, now_ns, "hang", tuple(int(r) for r in w), {
        "rule": "venustrace.heartbeat", **extra, "timeout_ns": timeout, "n": state.config.n,
        "expected_step_ns": None if not bool(state.expected.ready)
        else float(state.expected.value),
        "new_ranks": [int(r) for r in np.flatnonzero(fire)][:64],
        "first_silent": [int(r) for r in first][:64],
        "live": [int(r) for r in w[alive]][:64],
        "silent_no_beats": [int(r) for r in w[~alive]][:64],
        "last_progress_ns_min": int(lp.min()),
    })], silent


@dataclass
class BeatProgress:
    """Per-rank progress read from the host agents' beats: each beat carries, per (rank,
    communicator), the newest op sequence number the agent has drained from the rank's ring,
    stamped with the beat's own time. The timer of a rank resets at the first beat that shows
    a newer sequence number on any of its communicators.

    Why a second reading of the same heartbeat rule: the op records reach the trigger through
    the progress feed, whose windows close only once every source is past them (up to the
    feed's lateness, 2 s, after the window). A beat reaches it as soon as it is stored, and
    carries its own clock: the timer is judged in the beats' event time (`clock_ns`, the
    newest beat of the job), so a lagging beat stream delays the verdict and never fakes one.
    A progress observed at a beat is at most one beat interval later than the op itself: the
    silence this measures is never longer than the true one."""

    world: int
    comms: dict[str, int] = field(default_factory=dict)
    seq: Array = field(init=False)  # int64 [world, comms]: newest op_seq seen (-1: none)
    changed_ns: Array = field(init=False)  # int64 [world]: beat time of the newest progress
    beat_ns: Array = field(init=False)  # int64 [world]: the rank's newest beat
    hung: Array = field(init=False)
    clock_ns: int = 0

    def __post_init__(self) -> None:
        self.seq = np.full((self.world, 0), -1, dtype=np.int64)
        self.changed_ns = np.zeros(self.world, dtype=np.int64)
        self.beat_ns = np.zeros(self.world, dtype=np.int64)
        self.hung = np.zeros(self.world, dtype=bool)

    def _columns(self, comm: Array) -> Array:
        """The column of each row's communicator (new ones appended)."""
        uniq, inv = np.unique(comm.astype(str), return_inverse=True)
        for c in uniq.tolist():
            if c not in self.comms:
                self.comms[c] = len(self.comms)
        if len(self.comms) > self.seq.shape[1]:
            grown = np.full((self.world, len(self.comms)), -1, dtype=np.int64)
            grown[:, : self.seq.shape[1]] = self.seq
            self.seq = grown
        return np.asarray([self.comms[c] for c in uniq.tolist()], dtype=np.int64)[inv]


def beat_progress_trigger(state: HeartbeatState, bp: BeatProgress, beats: Columns
                          ) -> list[Trigger]:
    """Fold `beats` rows (rank, ts, comm_id, last_op_seq; a rank's last beat with `exited` 1
    says its process is gone and carries no progress) into `bp`, then report the ranks whose
    op counters have not moved for longer than the heartbeat timeout at the newest beat time
    (first time per episode; a rank re-arms when it progresses again)."""
    if not beats or "last_op_seq" not in beats:
        return []
    rank, ts, seq = ints(beats, "rank"), ints(beats, "ts"), ints(beats, "last_op_seq")
    comm = np.asarray(beats.get("comm_id", np.full(rank.size, "", dtype=object)))
    exited = ints(beats, "exited", 0) if "exited" in beats else np.zeros(rank.size, np.int64)
    ok = (rank >= 0) & (rank < bp.world) & (seq >= 0) & (exited == 0) & (comm != "")
    if ts.size:
        bp.clock_ns = max(bp.clock_ns, int(ts.max()))
        valid = (rank >= 0) & (rank < bp.world) & (exited == 0)
        np.maximum.at(bp.beat_ns, rank[valid], ts[valid])
    if ok.any():
        r, t, s = rank[ok], ts[ok], seq[ok]
        c = bp._columns(comm[ok])
        key = r * bp.seq.shape[1] + c
        # per (rank, comm): the newest sequence number in the batch, and the first beat that
        # showed it
        order = np.lexsort((t, -s, key))
        head = np.ones(order.size, dtype=bool)
        head[1:] = key[order][1:] != key[order][:-1]
        k, newest, first = key[order][head], s[order][head], t[order][head]
        flat = bp.seq.reshape(-1)
        moved = newest > flat[k]
        flat[k[moved]] = newest[moved]
        np.maximum.at(bp.changed_ns, k[moved] // bp.seq.shape[1], first[moved])
    fired, bp.hung = _timer(state, bp.clock_ns, bp.changed_ns, bp.beat_ns, bp.hung,
                            {"progress": "op counters in the host agents' beats",
                             "clock": "beats"})
    return fired
