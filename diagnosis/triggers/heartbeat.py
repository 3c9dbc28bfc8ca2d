"""Hang trigger by heartbeat timeout (VenusTrace §3.3 "Locate hang issue", Alg. 1 lines 1-5;
MegaTrace §III-C "Detection via Timeout").

The analyzer resets a per-rank timer whenever the rank's tracer reports progress; when the timer
exceeds n × T_expected (n = 2 in MegaTrace's example) it flags a potential hang. T_expected is the
expected step (iteration) time, learned as in VenusTrace Alg. 2 lines 2-10: the second step
initializes it, later steps within ±α (5 %) update it (`diagnosis.expectation.Expectation`; the
band widened to the steps' own scatter where that is larger, as on real CPU jobs).

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
  outside its band) is reported as a "regression" trigger — VenusTrace would otherwise keep
  comparing against a stale value forever — when the steps got slower: a job that got faster
  (most often: its start-up steps were what set the expectation) is not a performance incident;
- one trigger per hang episode: a rank re-arms when it progresses again.

Silences seen after the fact (beyond the papers, which assume the tracer's log arrives as it is
written): the timer is judged at the newest time the feed has reached, so a silence that began
and ended between two looks is never seen live. That happens whenever records arrive faster than
they were made: a replayed capture, a backlog after a broker failover, a feed that closes many
windows at once after a pause — and then whether a stall was reported depended on how the
records happened to be sliced (the step times that arm the timer travel on another feed, and
could come before or after the silence's windows). So every fold also measures each rank's
silence that ended inside it — from its previous progress to the last moment the timer could
have looked before the next one (a row of the rank that showed none, such as a beat, or the
feed's previous look; never the next progress itself, which may lie up to a sampling interval
after the op) — and judges it as the live timer would have: against n × T_expected if T_expected
was known at the silence's start (in event time: the end of the step that armed it), else
against the cold timeout. A silence that cannot be judged yet (T_expected unknown, shorter than
the cold timeout) waits for it, at most `max_pending` of them (the longest kept, the rest
counted in `pending_dropped`). A silence reported live, or already reported after the fact by
the other reading of the timer (the beats' counters), is not reported again. The trigger says
so: `after_the_fact`, with the silence's bounds; its time is the moment the live timer would
have fired.
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
    max_pending: int = 256


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
    #: event time from which T_expected is known (the end of the step that armed it); 0: never
    ready_ns: int = 0
    #: per rank: silences that start before this were reported
    covered_ns: Array = field(init=False)
    #: the progress feed's newest look (the `now_ns` of the last `heartbeat_trigger`)
    look_ns: int = 0
    #: silences ended but not judged yet (T_expected unknown): rank, start, end
    pending: tuple[Array, Array, Array] = field(init=False)
    pending_dropped: int = 0

    def __post_init__(self) -> None:
        c = self.config
        self.expected = Expectation(alpha=c.alpha, rebase_after=c.rebase_after)
        self.last_progress_ns = np.zeros(self.world, dtype=np.int64)
        self.last_alive_ns = np.zeros(self.world, dtype=np.int64)
        self.hung = np.zeros(self.world, dtype=bool)
        self.covered_ns = np.zeros(self.world, dtype=np.int64)
        empty = np.zeros(0, dtype=np.int64)
        self.pending = (empty, empty, empty)

    @property
    def timeout_ns(self) -> int:
        if not bool(self.expected.ready):
            return self.config.cold_timeout_ns
        return max(int(self.config.n * float(self.expected.value)), self.config.min_timeout_ns)


def observe_steps(state: HeartbeatState, step: Array, duration_ns: Array,
                  now_ns: int, end_ns: Array | None = None) -> list[Trigger]:
    """Fold completed steps into T_expected, in step order; rows may repeat a step (one row per
    rank, e.g. from `stages`): a step's time is the max over its rows (the job waits for the
    slowest rank). Steps at or before the last one seen are ignored. `end_ns` (per row) dates
    the moment T_expected became known, for the silences judged after the fact (default:
    `now_ns`); silences waiting for it are judged here."""
    step = np.asarray(step, dtype=np.int64)
    dur = np.asarray(duration_ns, dtype=np.float64)
    end = np.full(step.size, now_ns, dtype=np.int64) if end_ns is None \
        else np.asarray(end_ns, dtype=np.int64)
    new = step > state.last_step
    if not new.any():
        return []
    uniq, inv = np.unique(step[new], return_inverse=True)
    per_step = np.full(uniq.size, -np.inf)
    np.maximum.at(per_step, inv, dur[new])
    step_end = np.zeros(uniq.size, dtype=np.int64)
    np.maximum.at(step_end, inv, end[new])
    out: list[Trigger] = []
    for s, d, e in zip(uniq.tolist(), per_step.tolist(), step_end.tolist(), strict=True):
        before = float(state.expected.value)
        _, rebased = state.expected.update(d)
        if not state.ready_ns and bool(state.expected.ready):
            state.ready_ns = max(int(e), 1)
        if bool(rebased) and float(state.expected.value) > before:
            out.append(Trigger(state.job_id, now_ns, "regression", (), {
                "rule": "venustrace.expected_step", "step": int(s),
                "expected_before_ns": before, "expected_after_ns": float(state.expected.value),
                "alpha": state.config.alpha, "consecutive_steps": state.config.rebase_after,
            }))
    state.last_step = int(uniq[-1])
    return out + _judge_silences(state, *state.pending, extra={})


def heartbeat_trigger(state: HeartbeatState, progress: Columns, beats: Columns,
                      now_ns: int) -> list[Trigger]:
    """Update timers from `progress` (ops rows: rank, t_enqueue, t_end) and `beats` (rank, ts),
    then report ranks silent for longer than the timeout at `now_ns` (first time per episode)."""
    fired: list[Trigger] = []
    if progress:
        rank = ints(progress, "rank")
        ts = np.maximum(ints(progress, "t_enqueue", 0), ints(progress, "t_end", 0))
        ok = (rank >= 0) & (rank < state.world) & (ts <= now_ns)
        lr, lt = rank[ok], ts[ok]
        if beats:
            br, bt = ints(beats, "rank"), ints(beats, "ts")
            keep = (br >= 0) & (br < state.world) & (bt <= now_ns)
            lr, lt = np.concatenate([lr, br[keep]]), np.concatenate([lt, bt[keep]])
        fired += _silences(state, state.last_progress_ns, rank[ok], ts[ok], lr, lt,
                           state.look_ns)
        np.maximum.at(state.last_progress_ns, rank[ok], ts[ok])
    state.look_ns = max(state.look_ns, now_ns)
    if beats:
        rank = ints(beats, "rank")
        ts = ints(beats, "ts")
        ok = (rank >= 0) & (rank < state.world) & (ts <= now_ns)
        np.maximum.at(state.last_alive_ns, rank[ok], ts[ok])
    state.last_alive_ns = np.maximum(state.last_alive_ns, state.last_progress_ns)

    live, state.hung = _timer(state, now_ns, state.last_progress_ns, state.last_alive_ns,
                              state.hung, {})
    return fired + live


def _silences(state: HeartbeatState, last_ns: Array, rank: Array, ts: Array,
              look_rank: Array, look_ts: Array, prev_look_ns: int,
              extra: dict[str, object] | None = None) -> list[Trigger]:
    """The silences that end in a fold of progress times (`rank`, `ts`) into per-rank
    `last_ns` (module docstring, "Silences seen after the fact"), judged now or kept.

    A silence is what the live timer could have seen: from a rank's previous progress to the
    latest moment it could have looked before the next one — the previous look of the whole
    feed (`prev_look_ns`) or a row of the rank that showed no progress (`look_rank`,
    `look_ts`: its beats, its other rows). Never the gap between two progress rows itself: the
    op behind the later one may have come any time after the previous look, and a gap between
    samples would overstate the silence by up to a sampling interval."""
    new = ts > last_ns[rank]
    if not new.any():
        return []
    r = np.concatenate([rank[new], look_rank])
    t = np.concatenate([ts[new], look_ts])
    event = np.zeros(r.size, dtype=bool)
    event[: int(new.sum())] = True
    order = np.lexsort((~event, t, r))  # at equal times, the progress before the look
    r, t, event = r[order], t[order], event[order]
    same = np.zeros(r.size, dtype=bool)
    same[1:] = r[1:] == r[:-1]
    idx = np.arange(r.size)
    # the rank's previous progress: its newest event before this row, else `last_ns`
    prev_ev = np.maximum.accumulate(np.where(event, idx, -1))
    prev_ev = np.concatenate([[-1], prev_ev[:-1]])
    own = (prev_ev >= 0) & (r[np.maximum(prev_ev, 0)] == r)
    since = np.where(own, t[np.maximum(prev_ev, 0)], last_ns[r])
    # the latest look before this progress: the rank's previous row, or the feed's last look
    look = np.where(same, np.concatenate([[0], t[:-1]]), 0)
    look = np.maximum(look, np.where(prev_look_ns < t, prev_look_ns, 0))
    quiet = event & (since > 0) & (look - since > state.config.min_timeout_ns)
    quiet &= since >= state.covered_ns[r]
    if not quiet.any():
        return []
    pr, ps, pe = state.pending
    return _judge_silences(state, np.concatenate([pr, r[quiet]]),
                           np.concatenate([ps, since[quiet]]),
                           np.concatenate([pe, look[quiet]]), extra=extra or {})


def _judge_silences(state: HeartbeatState, rank: Array, start: Array, end: Array,
                    extra: dict[str, object]) -> list[Trigger]:
    """Report the silences (rank, start, end) the live timer would have reported; keep those
    that need T_expected until it is known (the longest `max_pending`)."""
    c = state.config
    empty = np.zeros(0, dtype=np.int64)
    state.pending = (empty, empty, empty)
    if rank.size == 0:
        return []
    rank, start, end = (np.asarray(a, dtype=np.int64) for a in (rank, start, end))
    fresh = start >= state.covered_ns[rank]
    rank, start, end = rank[fresh], start[fresh], end[fresh]
    known = bool(state.expected.ready)
    armed = known & (start >= state.ready_ns)
    timeout = np.where(armed, state.timeout_ns, c.cold_timeout_ns)
    fire = end - start > timeout
    wait = ~fire & ~known
    if wait.any():
        keep = np.flatnonzero(wait)
        if keep.size > c.max_pending:
            state.pending_dropped += keep.size - c.max_pending
            keep = keep[np.argsort(start[keep] - end[keep], kind="stable")[: c.max_pending]]
        state.pending = (rank[keep], start[keep], end[keep])
    if not fire.any():
        return []
    r, s, e, to = rank[fire], start[fire], end[fire], timeout[fire]
    np.maximum.at(state.covered_ns, r, e)
    first = r[s <= s.min() + c.min_timeout_ns]
    return [Trigger(state.job_id, int((s + to).min()), "hang", tuple(sorted(set(r.tolist()))), {
        "rule": "venustrace.heartbeat", **extra, "after_the_fact": True,
        "timeout_ns": int(to.max()), "n": c.n,
        "expected_step_ns": float(state.expected.value) if known else None,
        "new_ranks": sorted(set(r.tolist()))[:64],
        "first_silent": sorted(set(first.tolist()))[:64],
        "live": sorted(set(r.tolist()))[:64], "silent_no_beats": [],
        "silences": [{"rank": int(a), "start_ns": int(b), "end_ns": int(d)}
                     for a, b, d in zip(r[:64], s[:64], e[:64], strict=True)],
        "last_progress_ns_min": int(s.min()),
    })]


def _timer(state: HeartbeatState, now_ns: int, progress_ns: Array, alive_ns: Array, hung: Array,
           extra: dict[str, object]) -> tuple[list[Trigger], Array]:
    """The heartbeat timeout at `now_ns` over per-rank last progress and last sign of life:
    (the trigger, if a rank went silent since the last look; the new `hung` mask)."""
    timeout = state.timeout_ns
    silent = (progress_ns > 0) & (now_ns - progress_ns > timeout)
    fire = silent & ~hung
    if not fire.any():
        return [], silent
    # this episode is reported: the other reading of the timer dates its start a little
    # differently (window ends, beat times), within the timeout's floor
    w = np.flatnonzero(fire)
    state.covered_ns[w] = np.maximum(state.covered_ns[w],
                                     progress_ns[w] + state.config.min_timeout_ns)
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
    extra: dict[str, object] = {"progress": "op counters in the host agents' beats",
                                "clock": "beats"}
    quiet: list[Trigger] = []
    rank, ts, seq = ints(beats, "rank"), ints(beats, "ts"), ints(beats, "last_op_seq")
    comm = np.asarray(beats.get("comm_id", np.full(rank.size, "", dtype=object)))
    exited = ints(beats, "exited", 0) if "exited" in beats else np.zeros(rank.size, np.int64)
    ok = (rank >= 0) & (rank < bp.world) & (seq >= 0) & (exited == 0) & (comm != "")
    clock_before = bp.clock_ns
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
        old_seq = flat[key].copy()
        moved = newest > flat[k]
        flat[k[moved]] = newest[moved]
        who = k[moved] // bp.seq.shape[1]
        # every beat that showed a newer count is progress (a batch may hold many beats)
        o = np.lexsort((t, key))
        ks, ss, ts_ = key[o], s[o], t[o]
        before = np.concatenate([[-1], ss[:-1]])
        before = np.where(np.concatenate([[False], ks[1:] == ks[:-1]]), before, old_seq[o])
        step = ss > before
        valid = (rank >= 0) & (rank < bp.world) & (exited == 0)
        quiet = _silences(state, bp.changed_ns, ks[step] // bp.seq.shape[1], ts_[step],
                          rank[valid], ts[valid], clock_before, extra)
        np.maximum.at(bp.changed_ns, who, first[moved])
    live, bp.hung = _timer(state, bp.clock_ns, bp.changed_ns, bp.beat_ns, bp.hung, extra)
    return quiet + live
