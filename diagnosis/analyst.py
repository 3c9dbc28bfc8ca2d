"""The root-cause side of one process: triggers in, versioned diagnoses out (pure; no I/O).

`Analyst` owns the incident book and decides *when* the engine runs; the caller supplies the
job's window through `read(job_id, start_ns, now_ns) -> Window | None` (ClickHouse in the agent,
the simulator's records in the in-process evaluation) and the clock. Two clocks: `now_ns` (the
caller's, wall time in the worker) says when a diagnosis is published and paces re-checks and
sweeps; `event_clock(job, now_ns)` says up to which moment of the job's own time its records
are stored — the analysis reads and judges the window ending there (the worker passes the wall
clock capped at the job's progress watermark plus the feed's largest lateness). Judged at wall
time alone, a capture replayed later (or a feed behind by more than the window) would show
every rank silent and a rank whose rows are not stored yet as dead, and the incidents of a
finished job would drift to "process died".

- `on_trigger`: a trigger for a class with an open incident is absorbed (de-duplicated) — the
  periodic re-check keeps that incident current; otherwise the engine runs over the last
  `window_s` and a conclusion opens an incident.
- `tick` (call every second or so): every `recheck_s`, each open incident is re-analysed: a
  changed conclusion is published as "updated", nothing found `clear_after` times in a row as
  "resolved"; an incident kept on records that have not moved since (a job that ended) is not
  re-read. The first re-check comes `first_recheck_s` after the incident opens: a trigger
  fires seconds after the onset, when the raw tables may hold little of the fault yet (a dead
  rank's missing beats span one interval), so the first version is soon checked against more
  evidence. Every `_sweep_gap` (its last sweep's cost over `sweep_share`, between
  `min_sweep_s` and `sweep_s`), jobs without an open performance incident get one slowdown
  analysis (trigger kind "straggler", rule "rankwatch.sweep"): degradations the job's step time
  absorbs (a slower ring hidden in a pipeline bubble) never move the step-time triggers. Its
  recent steps reach back to the previous sweep (`_sweep_config`), so an onset between two
  sweeps is judged with its baseline before it. A job
  whose event clock has not moved since its last sweep (it ended) is not swept again: the same
  records would be judged the same, at a cost that grows with the job's ranks.
  A sweep reads the job's stage records first: the slowdown analysis needs them
  (`slow.analyze` returns nothing without), so a job traced without stages (NCCL plugin
  only, imported traces) gets the analysis from ops alone instead (`_ops_sweep`: ops_rca over
  ops and beats). Otherwise it reads only `SWEEP_KINDS`, the kinds the sweep's two
  rules look at — flows and beats, about a third of a job's op/flow/chunk rows, are not read —
  and only from the start of the steps the slowdown analysis judges (`_sweep_window`).
- a hang trigger whose analysis finds nothing (read when the stall was younger than the
  analysis's own `stuck_ns`, or before the waiters' rows were stored) stays pending: every
  tick for `pending_s` the hang analysis runs again at the advancing event clock until it
  concludes (then it opens the incident, under that trigger) or the time is up. A trigger
  fires once per episode, so without this a hang analysed a moment too early was never named.
- a performance trigger whose analysis finds nothing stays pending too, for `slow_pending_s`:
  it fires on the job's step time at the onset, when too few slow steps are stored for a
  change to stand out of the noise (`slow.context`: `onset_steps` of them, stored). Until a
  conclusion or the time is up, the sweep's analysis (`_slow_try`, a few steps of the job's
  calls rather than 90 s of every kind) runs again at the advancing slow clock
  (`_slow_clock`), each try no sooner than the last one's cost (read and analysis) over
  `pending_share` after it, and at least `retry_s` (a small job every quarter second; a large
  one's tries may take ten times a sweep's `sweep_share` of the clock, as a fault is
  suspected, for those few seconds): a slowdown is named once its evidence is stored, not at
  the next sweep. Where the caller reports stored stage records (`stored`: the worker's raw
  sink), a try is timed to them: made only once new ones are stored, then as soon as
  `evidence_retry_s` and its cost allow (`retry_slow`, which the worker calls as a pending
  job's stage batch is stored); another performance trigger of the job meanwhile is absorbed:
  its analysis would read the same steps, unpaced (the step triggers fire again every few
  steps while a slowdown lasts) — it restarts the `slow_pending_s` and becomes the pending
  one. A try's cost is the work it made (`spent`: the thread's CPU and its reads' time in
  the database), not the wall clock's nor the process's CPU. Pending hang
  triggers are paced on the tick by their cost too, but never wait more than `HANG_RETRY_S`.
- a slowdown analysis (trigger, tries, sweep) reads up to the job's slow clock: the moment
  every rank's stage records and calls are reported stored, or the event clock if later. The
  event clock follows the progress feed's watermark, which moves one closed one-second window
  at a time and stood up to a second behind the stored stage records.
- aftermath: a stall that ends (a hang incident resolved because progress resumed) leaves its
  trace in the step series — the stalled step is long, so ARGUS's jitter test and the sweep see
  it on the same ranks. For `aftermath_s` after such a hang resolved, a performance conclusion
  whose culprit ranks are among the hang's does not open a second incident for the same episode
  (a different culprit does, and so does the same one later) — nor does the recovered stall
  analysed again once it ended (a hang conclusion labelled "recovered" whose stall began before
  the incident resolved, however long after). Not kept across restarts.
- exits: every `min_sweep_s`, a job without an open hang incident has the beats stored since
  the last look read (`_exits`): a rank's exit beat (its process ended) has the job judged as
  of its end (`hang_rca.process_exit`) — a job whose ranks all stop within a beat leaves no
  silent rank for a hang trigger to fire on. A job every one of whose ranks exited with none
  waiting on another has ended: its ranks went quiet for the teardown (destroying the process
  groups, the interpreter's exit: ~2 s on a real 4-rank job) before their exit beats came, and
  the heartbeat timer took that for a hang on every job's end. Its triggers about moments up to
  its last exit are not analysed, a pending one is dropped (it was tried again for `pending_s`,
  a read and an analysis four times a second, while the next job ran), until a rank of the job
  id beats again after its end.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from diagnosis import engine, hang_rca, ops_rca, slow
from diagnosis.columns import Columns, ints
from diagnosis.conclusion import Conclusion
from diagnosis.incidents import IncidentBook, incident_class, incident_id
from diagnosis.model import Diagnosis
from diagnosis.slow.context import stage_total
from diagnosis.triggers.base import Trigger
from diagnosis.window import Window, announced_ops_stored, beats_current
from ingest.units import SECOND
from streams.reports import newest_call_ends

#: The raw kinds a sweep reads: what `slow.analyze` and `hang_rca.stuck_ranks` use
#: (tests/unit/test_analyst.py checks the conclusions equal those on every kind).
SWEEP_KINDS = ("stages", "ops", "chunks", "kernels", "kernel_summaries")
#: Full steps before the slowdown analysis's `recent` ones whose raw rows a sweep still reads:
#: room for the recovered stall's steps the analysis leaves out (`slow.reach_start`).
SWEEP_MARGIN_STEPS = 5
#: The most recent steps a sweep judges (`_sweep_config`): bounds its read at short steps.
MAX_RECENT = slow.MAX_RECENT
#: How far before the previous look for exit beats the next starts (`Analyst._exits`), s.
EXIT_MARGIN_S = 5.0
#: The longest gap between two tries of a pending hang trigger, however costly (`_retry_gap`).
HANG_RETRY_S = 1.0

log = logging.getLogger(__name__)


class Reader(Protocol):
    """A job's window `[start_ns, now_ns]`: every raw kind, or only `kinds`."""

    def __call__(self, job_id: str, start_ns: int, now_ns: int,
                 kinds: Collection[str] | None = None) -> Window | None: ...


@dataclass(frozen=True)
class AnalystConfig:
    window_s: float = 90.0
    recheck_s: float = 4.0
    sweep_s: float = 10.0  # the longest gap between two sweeps of a job (`_sweep_gap`)
    min_sweep_s: float = 2.0  # the shortest
    sweep_share: float = 0.05  # a job's sweeps take at most this share of the wall clock
    aftermath_s: float = 20.0
    first_recheck_s: float = 1.0
    pending_s: float = 30.0
    #: the longest a hang trigger waits for its window to be complete (`Analyst._unsettled`):
    #: longer than a partition's failover after a broker is lost (the controller fences a
    #: broker after its 9 s session timeout; clients then find the new leader)
    settle_s: float = 15.0
    #: the job's beats count as stored up to a moment when its newest beat is at most this
    #: much older (agents beat every second)
    beat_gap_s: float = 3.0
    #: how long a performance trigger that found nothing is analysed again (`tick`)
    slow_pending_s: float = 6.0
    #: the shortest gap between two tries of a pending trigger (`_retry_gap`): the
    #: diagnosis timer's tick
    retry_s: float = 0.25
    #: a pending trigger's tries take at most this share of the wall clock (`_retry_gap`):
    #: more than a sweep's, as a fault is suspected — but only for `slow_pending_s`. Half a
    #: core of the stack's machine while a job is suspect: the next try comes sooner after
    #: the evidence is stored (docs/performance.md, "Half a core for a suspect job's tries")
    pending_share: float = 0.5
    #: the shortest gap between two tries of a pending performance trigger of a job whose
    #: stored stage records are reported (`stored`): tried as new ones are stored, not on
    #: the tick — and not tried while none are
    evidence_retry_s: float = 0.05


@dataclass
class Analyst:
    read: Reader
    config: AnalystConfig = field(default_factory=AnalystConfig)
    book: IncidentBook = field(default_factory=IncidentBook)
    jobs: set[str] = field(default_factory=set)
    last_check: dict[str, int] = field(default_factory=dict)
    last_sweep: dict[str, int] = field(default_factory=dict)
    sweep_cost: dict[str, float] = field(default_factory=dict)  # job -> its last sweep, s
    #: job -> the event clock its last sweep judged: a job whose clock stands still (it ended,
    #: or its feed stopped) is not swept again over the same records
    swept_at: dict[str, int] = field(default_factory=dict)
    #: job -> the moment its last re-check read up to, when that re-check kept every open
    #: incident: the same records give the same verdict, so a job whose clock stands still is
    #: not re-checked again (`_recheck`)
    kept_at: dict[str, int] = field(default_factory=dict)
    triggers: dict[tuple[str, str], Trigger] = field(default_factory=dict)
    resolved_hangs: dict[str, tuple[frozenset[int], int]] = field(default_factory=dict)
    #: (job, incident class) -> the moment of the job's time its open incident's newest version
    #: was read up to: its re-checks read no earlier (`_recheck`)
    read_to: dict[tuple[str, str], int] = field(default_factory=dict)
    analysis_ms: list[float] = field(default_factory=list)
    event_clock: Callable[[str, int], int] = field(default=lambda _job, now: now)
    #: seconds of work the calling thread has spent, ever: its own CPU time, and where the
    #: caller's reads run elsewhere (the worker's database thread) their time there. The
    #: difference over a try or a sweep is its cost, which paces the next (`_retry_gap`,
    #: `_sweep_gap`). The process's CPU time counted the ingest threads' inserts during a
    #: try as the try's: live, tries of 25–120 ms of their own were billed 200–570 ms, and
    #: the next waited 0.8–2.3 s, 10–30 steps of an 80 ms job, with its evidence stored
    spent: Callable[[], float] = field(default=time.thread_time)
    #: job -> (hang or failure trigger whose analysis found nothing yet, wall ns it arrived,
    #: wall ns its next try is due)
    pending: dict[str, tuple[Trigger, int, int]] = field(default_factory=dict)
    #: job -> (performance trigger whose analysis found nothing yet, wall ns it arrived, wall
    #: ns its next try is due)
    pending_slow: dict[str, tuple[Trigger, int, int]] = field(default_factory=dict)
    #: job -> the newest exit beat (a rank's process ended) judged, and (wall ns, event
    #: clock) of the last look for one (`_exits`)
    exits_judged: dict[str, int] = field(default_factory=dict)
    exit_checks: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: job -> the wall ns its event clock was first seen at the value of its last look
    exit_clock_since: dict[str, int] = field(default_factory=dict)
    #: job -> its newest exit beat, for a job that ended: every rank's process gone, none
    #: of them left waiting on another (`_exits`). Its triggers about moments before then
    #: are not analysed and its pending ones are dropped, until a rank beats again after it
    ended: dict[str, int] = field(default_factory=dict)
    #: job -> stage batches reported stored (`stored`), and the count at its pending
    #: performance trigger's last try: a try without new stage records is not made
    stages_stored: dict[str, int] = field(default_factory=dict)
    slow_tried_at: dict[str, int] = field(default_factory=dict)
    #: (job, "stages" | "ops") -> rank -> the newest moment of its records of that kind
    #: reported stored (`stored`): up to where a slowdown analysis may read (`_slow_clock`)
    stored_to: dict[tuple[str, str], dict[int, int]] = field(default_factory=dict)
    #: job -> the raw kinds reported stored for it (`seen`), and the `SWEEP_KINDS` a sweep's
    #: read found none of while none had been reported: the sweeps and tries stop reading
    #: those (`_sweep_window`) until a batch of them is (a job traced without kernel events
    #: or chunk counters — every CPU job, a GPU job without the NCCL plugin — paid a query a
    #: kind and try for nothing: ~15 of a try's ~80 ms on an idle 2-core machine)
    kinds_seen: dict[str, set[str]] = field(default_factory=dict)
    kinds_absent: dict[str, set[str]] = field(default_factory=dict)

    def seen(self, job_id: str, kind: str) -> None:
        """A batch of the job's `kind` records is stored, by this worker or another one."""
        kinds = self.kinds_seen.setdefault(job_id, set())
        if kind not in kinds:
            kinds.add(kind)
            self.kinds_absent.pop(job_id, None)

    def stored(self, job_id: str, kind: str, ranks: np.ndarray, ends: np.ndarray) -> None:
        """A batch of the job's `kind` records is stored (the worker's raw sink), `ends[i]`
        the newest moment of rank `ranks[i]`'s records in it (`newest_per_rank`). Stage
        records: the evidence a pending performance trigger waits for may be complete
        (`_retry_slow`)."""
        if kind == "stages":
            self.stages_stored[job_id] = self.stages_stored.get(job_id, 0) + 1
        seen = self.stored_to.setdefault((job_id, kind), {})
        for r, e in zip(ranks.tolist(), ends.tolist(), strict=True):
            if e > seen.get(r, 0):
                seen[r] = e

    def _slow_clock(self, job: str, now_ns: int) -> int:
        """The moment a slowdown analysis reads up to: the job's event clock, or, if later, the
        moment up to which every rank's stage records and calls are reported stored (the
        earliest rank's newest; never past the wall clock). The event clock follows the
        progress feed, whose watermark moves a closed one-second window at a time: live, it
        stood up to a second behind the stored stage records, and the tries of a pending
        slowdown read the same steps again and again (a slow step is judged once its records
        are stored: `slow.context.full_steps` keeps only steps every rank has finished)."""
        at = self.event_clock(job, now_ns)
        st = self.stored_to.get((job, "stages"))
        if not st:
            return at
        ops = self.stored_to.get((job, "ops"))
        hi = min(st.values()) if not ops else min(min(st.values()), min(ops.values()))
        return max(at, min(now_ns, hi))

    def _window(self, job_id: str, at_ns: int,
                kinds: Collection[str] | None = None) -> Window | None:
        return self.read(job_id, at_ns - int(self.config.window_s * SECOND), at_ns, kinds)

    def _sweep_config(self, stages: Window, since_ns: int | None) -> slow.SlowConfig:
        """The slowdown analysis's settings for a sweep: its `recent` steps reach back to the
        previous sweep (`slow.reach_back`, at most `MAX_RECENT`), so an onset between two
        sweeps is inside the judged steps with its baseline before it — with 130 ms steps a
        10 s sweep interval is 77 steps, past the default 20 recent ones."""
        return slow.reach_back(slow.SlowConfig(), stages.get("stages"), since_ns)

    def _sweep_window(self, job_id: str, at_ns: int, since_ns: int | None = None
                      ) -> tuple[Window | None, slow.SlowConfig]:
        """The sweep's window: its stage records, and if there are any the other `SWEEP_KINDS`
        from the start of the steps the slowdown analysis looks at (`slow.reach_start`,
        `SWEEP_MARGIN_STEPS` before its recent ones; calls in flight are read from further
        back, as always): the 25 steps of a job with 1.7 s steps span about 43 s of the 90 s
        window. None without a topology; the stage window, empty, for a job without stage
        records. With the analysis's settings for it (`_sweep_config`, from `since_ns`: the
        previous sweep's event clock)."""
        stages = self._window(job_id, at_ns, ("stages",))
        if stages is None or not stages.get("stages"):
            # None, or a job without stage records (`tick`: `_ops_sweep`)
            return stages, slow.SlowConfig()
        config = self._sweep_config(stages, since_ns)
        start = at_ns - int(self.config.window_s * SECOND)
        lo = slow.reach_start(stages.tables["stages"], SWEEP_MARGIN_STEPS, config)
        absent = self.kinds_absent.get(job_id, set())
        kinds = [k for k in SWEEP_KINDS if k != "stages" and k not in absent]
        rest = self.read(job_id, max(start, lo if lo is not None else start), at_ns, kinds)
        if rest is None:
            return None, config
        seen = self.kinds_seen.get(job_id, set())
        if "kernels" in seen:  # the job's kernel summaries are made from its kernel events
            seen = seen | {"kernel_summaries"}
        none = {k for k in kinds if not rest.get(k) and k not in seen}
        if none:
            self.kinds_absent[job_id] = absent | none
        # the window's start stays the 90 s one: the operator SQL of a diagnosis starts there
        return Window(rest.topo, {**rest.tables, "stages": stages.tables["stages"]},
                      stages.start_ns, rest.now_ns), config

    def _run(self, fn: Callable[[Window, int], Conclusion | None], w: Window,
             now_ns: int) -> tuple[Conclusion | None, float]:
        t0 = time.perf_counter()
        c = fn(w, now_ns)
        ms = (time.perf_counter() - t0) * 1e3
        self.analysis_ms.append(ms)
        return c, ms

    def on_trigger(self, t: Trigger, now_ns: int) -> list[Diagnosis]:
        self.jobs.add(t.job_id)
        if t.ts <= self.ended.get(t.job_id, -1):
            return []  # the silence of a job that ended, not a hang (`_exits`)
        cls = "hang" if t.kind in ("hang", "failure") else "performance"
        if self.book.is_open(t.job_id, cls) or self.book.is_open(t.job_id, "hang"):
            return []
        if cls == "performance" and t.job_id in self.pending_slow and \
                t.job_id in self.stages_stored:
            # the pending trigger's tries, timed to the stored evidence and paced by their
            # cost, read the same steps: an analysis now would spend a whole read on them.
            # The new trigger is news that the job is still off: the tries go on for
            # `slow_pending_s` from it, under its name (a rank's stage rise 0.3 s after its
            # onset was absorbed by a step trigger that had fired 3.7 s before, on noise,
            # and whose tries ran out 2.3 s later; by the next trigger's analysis the change
            # was too old for the default window, and a sweep named it 76 steps in)
            _, _, due = self.pending_slow[t.job_id]
            self.pending_slow[t.job_id] = (t, now_ns, due)
            log.debug("%s trigger %s (ranks %s) absorbed by the pending one", t.kind, t.job_id,
                      list(t.ranks)[:8])
            return []
        at = self._trigger_clock(t, now_ns, now_ns) if cls == "hang" else \
            self._slow_clock(t.job_id, now_ns)
        w = self._window(t.job_id, at)
        if w is None:
            return []
        if self._unsettled(t, w, at, now_ns, now_ns):
            self.pending.setdefault(t.job_id, (t, now_ns, now_ns + self._retry_gap(0, hang=True)))
            return []
        c, ms = self._run(self._diagnosing(t), w, at)
        log.debug("%s trigger %s (ranks %s) analysed at %d (%.0f ms behind): %s (%.0f ms)",
                  t.kind, t.job_id, list(t.ranks)[:8], at, (now_ns - at) / 1e6,
                  None if c is None else (c.kind, c.ranks[:8], c.stage), ms)
        if c is None:
            if cls == "hang":
                self.pending.setdefault(
                    t.job_id, (t, now_ns, now_ns + self._retry_gap(ms, hang=True)))
            elif t.job_id not in self.pending_slow:
                stored = self.stages_stored.get(t.job_id)
                floor = None if stored is None else self.config.evidence_retry_s
                self.pending_slow[t.job_id] = (t, now_ns,
                                               now_ns + self._retry_gap(ms, floor_s=floor))
                if stored is not None:
                    self.slow_tried_at[t.job_id] = stored
            return []
        (self.pending if cls == "hang" else self.pending_slow).pop(t.job_id, None)
        return self._publish(c, w, t, now_ns, ms)

    def _retry_gap(self, ms: float, hang: bool = False, floor_s: float | None = None) -> int:
        """ns until the next try of a pending trigger whose last try took `ms`: its cost over
        `pending_share`, at least `retry_s` (a slowdown is named a step or two after its
        evidence is stored, not at a whole second's tick: the step trigger fires after two
        slow steps, the analysis needs `onset_steps` of them stored, and at the sweeps' 5 %
        a 0.1 s try on a busy 2-core host waited 2 s — 20 steps of a 100 ms job — for the
        next). A hang waits at most `HANG_RETRY_S` however costly its analysis: a job is
        stalled, and every rank waits."""
        floor = self.config.retry_s if floor_s is None else floor_s
        gap = max(floor, ms / 1e3 / self.config.pending_share)
        return int((min(gap, HANG_RETRY_S) if hang else gap) * SECOND)

    def _retry_slow(self, job: str, now_ns: int) -> list[Diagnosis]:
        """Re-run the analysis of a performance trigger that found nothing (module
        docstring): the sweep's (`_slow_try`), which reads a few steps of the job's calls,
        not 90 s of every kind — a try's cost sets the gap to the next. A job whose stored
        stage records are reported (`stored`) is tried only once new ones are, and then as
        soon as `evidence_retry_s` and the cost allow."""
        t, since, due = self.pending_slow[job]
        if self.book.is_open(job, "performance") or self.book.is_open(job, "hang") or \
                now_ns - since > self.config.slow_pending_s * SECOND:
            del self.pending_slow[job]
            self.slow_tried_at.pop(job, None)
            return []
        stored = self.stages_stored.get(job)
        if now_ns < due or (stored is not None and stored == self.slow_tried_at.get(job)):
            return []
        # the try's cost is its own work (`spent`), not its wall time: a try that waits for
        # a core the training processes hold, or for the database thread behind an insert,
        # costs the worker nothing, and paced by its wall time the evidence waited for the next
        t0, w0 = self.spent(), time.perf_counter()
        at = self._slow_clock(job, now_ns)
        tried = self._slow_try(job, at)
        if tried is None:  # no stage records: the trigger's own analysis, over every kind
            w = self._window(job, at)
            c, ms = (None, 0.0) if w is None else \
                self._run(self._diagnosing(t), w, at)
        else:
            c, w, ms = tried
        cost = (self.spent() - t0) * 1e3  # the read included: most of a try
        log.debug("slowdown try %s at %d (%.0f ms behind), %s stage batches stored: %s "
                  "(cost %.0f ms, analysis %.0f ms, wall %.0f ms)", job, at, (now_ns - at) / 1e6,
                  stored, None if c is None else (c.kind, c.ranks[:8], c.stage), cost, ms,
                  (time.perf_counter() - w0) * 1e3)
        if c is None or w is None:
            floor = None if stored is None else self.config.evidence_retry_s
            self.pending_slow[job] = (t, since, now_ns + self._retry_gap(cost, floor_s=floor))
            if stored is not None:
                self.slow_tried_at[job] = stored
            return []
        del self.pending_slow[job]
        self.slow_tried_at.pop(job, None)
        return self._publish(c, w, t, now_ns, ms)

    def retry_slow(self, now_ns: int) -> list[Diagnosis]:
        """Each pending performance trigger tried again if due (`_retry_slow`): the tick's,
        and the worker's as a job's stage records are stored."""
        out: list[Diagnosis] = []
        for job in sorted(self.pending_slow):
            out += self._retry_slow(job, now_ns)
        return out

    def _slow_try(self, job: str, at: int, since_ns: int | None = None
                  ) -> tuple[Conclusion | None, Window | None, float] | None:
        """The slowdown analysis of a sweep and of a pending performance trigger's tries, at
        `at`: over the job's stage records and the other `SWEEP_KINDS` from where the analysis
        looks (`_sweep_window`; `since_ns`: the previous sweep's clock), nothing while a rank is
        stuck in a call (a stall in progress is the hang analysis's: a slowdown read off the
        stalled step would open a second, wrong incident), the job's beats read only for a
        culprit the steps' own scheduler counters cannot judge (the read has none; its culprit
        may be starved of CPU: slow.cpu). (conclusion, window, analysis ms); None for a job
        without stage records."""
        w, cfg = self._sweep_window(job, at, since_ns)
        if w is not None and not w.get("stages"):
            return None
        if w is None or hang_rca.stuck_ranks(w, at).size:
            return None, w, 0.0
        read: list[Columns] = []
        start = w.start_ns

        def beats() -> Columns | None:
            b = self.read(job, start, at, ("beats",))
            cols = None if b is None else b.get("beats")
            if cols:
                read.append(cols)
            return cols

        c, ms = self._run(functools.partial(slow.analyze, config=cfg, beats=beats), w, at)
        if read:
            w = Window(w.topo, {**w.tables, "beats": read[0]}, w.start_ns, w.now_ns)
        return c, w, ms

    def _trigger_clock(self, t: Trigger, since_ns: int, now_ns: int) -> int:
        """The moment a trigger's analysis reads up to: the job's event clock, or for a trigger
        judged on the stored beats' own time (`evidence["clock"] == "beats"`: the heartbeat
        timer read from the beats' op counters) that time, advanced by the wall time since
        the trigger came (`since_ns`), if later — the beats are stored when it fires, while the
        event clock follows the progress feed, which trails them by its windows' lateness."""
        at = self.event_clock(t.job_id, now_ns)
        if t.evidence.get("clock") == "beats":
            at = max(at, min(now_ns, int(t.ts) + max(now_ns - since_ns, 0)))
        return at

    def _unsettled(self, t: Trigger, w: Window, at: int, since_ns: int, now_ns: int) -> bool:
        """A hang or failure trigger is analysed once its window is complete up to the moment
        it reads (`at`), or after `settle_s` of waiting, as it is. Complete: every op the
        ranks' beats announce is stored (`window.announced_ops_stored`), and the beats
        themselves are stored up to about `at` on every host (`window.beats_current`: the
        backlog of a partition without a leader arrives as a prefix of each host's batches, one
        host ahead of another; a host that went as a whole waits `settle_s`). Beats and ops travel
        on different topics: read at a beat's time, the window may hold a rank's beat before
        its newest calls, and that rank would look as if it never made them (a simulated data
        stall was named as four waiting ranks this way). When a broker is lost, the
        partition holding a job's ops (or beats) has no leader for seconds while the
        progress feed, which takes that silence for the ranks', moves on; the backlog then
        arrives in pieces, and a recovered stall analysed on part of it was named on the
        ranks whose rows were missing. Waiting costs nothing in the common case: a trigger
        from the progress feed reads a moment whose rows have long been stored."""
        if t.kind not in ("hang", "failure"):
            return False
        if now_ns - since_ns >= self.config.settle_s * SECOND:
            return False
        beats = w.get("beats")
        return not (announced_ops_stored(w.get("ops"), beats, at)
                    and beats_current(beats, at, int(self.config.beat_gap_s * SECOND),
                                      w.grid.hosts))

    def _retry_pending(self, job: str, now_ns: int) -> list[Diagnosis]:
        """Re-run the analysis of a hang trigger that found nothing (module docstring)."""
        t, since, due = self.pending[job]
        if self.book.is_open(job, "hang") or now_ns - since > self.config.pending_s * SECOND:
            del self.pending[job]
            return []
        if now_ns < due:
            return []
        t0 = self.spent()
        at = self._trigger_clock(t, since, now_ns)
        w = self._window(job, at)
        c, ms = None, 0.0
        if w is not None and not self._unsettled(t, w, at, since, now_ns):
            c, ms = self._run(self._diagnosing(t), w, at)
        if c is None or w is None:
            cost = (self.spent() - t0) * 1e3  # the read included: most of a try
            self.pending[job] = (t, since, now_ns + self._retry_gap(cost, hang=True))
            return []
        del self.pending[job]
        return self._publish(c, w, t, now_ns, ms)

    def _aftermath(self, job_id: str, c: Conclusion, now_ns: int) -> bool:
        """A new performance incident that is the trace of a stall just resolved (docstring),
        or a new hang incident that is that stall again: the recovered stall analysed after it
        ended (`hang_rca.analyze_past_stall`, label "recovered") on the same ranks."""
        hang = self.resolved_hangs.get(job_id)
        if hang is None:
            return False
        ranks, at = hang
        same = bool(c.ranks) and set(c.ranks) <= ranks
        if incident_class(c.kind) == "hang":
            if "recovered" not in c.labels or self.book.is_open(job_id, "hang"):
                return False
            if c.onset_ns is not None:
                # a stall that began before the incident about it resolved is that incident's,
                # however late it is analysed again (a sweep or the job's end, long after)
                return same and c.onset_ns <= at
        elif self.book.is_open(job_id, "performance"):
            return False
        return same and now_ns - at <= self.config.aftermath_s * SECOND

    def _publish(self, c: Conclusion, w: Window, t: Trigger, now_ns: int,
                 ms: float) -> list[Diagnosis]:
        if self._aftermath(t.job_id, c, now_ns):
            return []
        cls = incident_class(c.kind)
        self.triggers.setdefault((t.job_id, cls), t)
        iid = incident_id(t.job_id, cls, now_ns)
        d = engine.to_diagnosis(c, w, self.triggers[(t.job_id, cls)], incident_id=iid, version=1,
                                status="open", detected_ns=now_ns, analysis_ms=ms)
        out = self.book.conclude(d)
        if out is not None and out.status != "resolved":
            key = (t.job_id, cls)
            self.read_to[key] = max(self.read_to.get(key, 0), w.now_ns)
        if out is not None and out.status == "open":
            early = self.config.recheck_s - self.config.first_recheck_s
            self.last_check[t.job_id] = now_ns - int(early * SECOND)
        if out is not None and out.status == "resolved":
            self.triggers.pop((t.job_id, cls), None)
            self.read_to.pop((t.job_id, cls), None)
        return [out] if out is not None else []

    def busy(self) -> bool:
        """Whether `tick` has anything to do: a job to watch, or a trigger pending."""
        return bool(self.jobs or self.pending or self.pending_slow)

    def tick(self, now_ns: int) -> list[Diagnosis]:
        out: list[Diagnosis] = []
        for job in sorted(self.pending):
            out += self._retry_pending(job, now_ns)
        out += self.retry_slow(now_ns)
        for job in sorted(self.jobs):
            if not self.book.is_open(job, "hang"):
                ended = self._exits(job, now_ns)
                if ended:
                    out += ended
                    continue
            due = now_ns - self.last_check.get(job, 0) >= self.config.recheck_s * SECOND
            open_cls = [cls for cls in ("hang", "performance") if self.book.is_open(job, cls)]
            if open_cls and due:
                self.last_check[job] = now_ns
                out += self._recheck(job, open_cls, now_ns)
            elif not self.book.is_open(job, "performance") and not self.book.is_open(job, "hang") \
                    and now_ns - self.last_sweep.get(job, 0) >= self._sweep_gap(job) * SECOND:
                self.last_sweep[job] = now_ns
                t0 = self.spent()
                at = self._slow_clock(job, now_ns)
                prev = self.swept_at.get(job)
                if prev == at:
                    continue
                self.swept_at[job] = at
                t = Trigger(job, at, "straggler", (), {"rule": "rankwatch.sweep"})
                tried = self._slow_try(job, at, prev)
                if tried is None:  # no stage records: the analysis from ops alone
                    out += self._ops_sweep(job, at, now_ns)
                    continue
                c, w, ms = tried
                if c is not None and w is not None:
                    out += self._publish(c, w, t, now_ns, ms)
                self.sweep_cost[job] = self.spent() - t0
                log.debug("sweep %s at %d (%.0f ms behind): %s (cost %.0f ms)", job, at,
                          (now_ns - at) / 1e6,
                          None if c is None else (c.kind, c.ranks[:8], c.stage),
                          self.sweep_cost[job] * 1e3)
        return out

    def _exits(self, job: str, now_ns: int) -> list[Diagnosis]:
        """Every `min_sweep_s`, the beats stored since the last look: an exit beat (a rank's
        process ended) newer than those already judged has the job judged as of its end
        (`hang_rca.process_exit`); its diagnoses, or none. A job whose event clock has not
        moved is read again only while it stopped less than `EXIT_MARGIN_S` ago (below); the
        read starts `EXIT_MARGIN_S` before the last one ended
        (an exit row stored after a read up to its time is still seen), so it costs a few
        seconds of beats, whatever the job's length.

        A clock that stopped (no record moves it: every process of the job ended) is looked at
        again for `EXIT_MARGIN_S` of wall time, and its looks read the beats up to
        `EXIT_MARGIN_S` past it, the job judged as of its newest exit beat: the clock follows
        the progress feed, the last calls and beats, while the exit beats come after them (the
        agent sees a process gone at its next look) and move nothing. An 8-rank pipeline job
        whose rank 4 was killed and the others stopped 0.1 s later had its exit beats 0.06-0.23
        s past its clock, and its exit judged 11.5 s on, once the windows' idle close moved the
        clock. A clock that moves reads up to itself: records after it may still be missing
        (a capture replayed faster than real time)."""
        last = self.exit_checks.get(job)
        if last is not None and now_ns - last[0] < self.config.min_sweep_s * SECOND:
            return []
        at = self.event_clock(job, now_ns)
        stopped = last is not None and last[1] == at
        if not stopped:
            self.exit_clock_since[job] = now_ns
        elif now_ns - self.exit_clock_since.get(job, now_ns) >= EXIT_MARGIN_S * SECOND:
            return []
        self.exit_checks[job] = (now_ns, at)
        margin = int(EXIT_MARGIN_S * SECOND)
        lo = (last[1] if last is not None else at - int(self.config.window_s * SECOND)) - margin
        b = self.read(job, lo, at + margin if stopped else at, ("beats",))
        beats = b.get("beats") if b is not None else None
        if not beats or "exited" not in beats:
            return []
        ex = np.asarray(beats["exited"]) == 1
        ts = np.asarray(beats["ts"])
        if job in self.ended and (~ex & (ts > self.ended[job])).any():
            del self.ended[job]  # beats after its end: the job id runs again
        newest = int(ts[ex].max()) if ex.any() else 0
        if newest <= self.exits_judged.get(job, 0):
            return []
        self.exits_judged[job] = newest
        at = max(at, min(newest, now_ns))
        w = self._window(job, at)
        if w is None:
            return []
        c, ms = self._run(hang_rca.process_exit, w, at)
        if c is None:
            if _every_rank_exited(w, at):
                # a normal end (or one from outside): the silence before it is no hang, and
                # a trigger it fired would be tried again for `pending_s` for nothing
                self.ended[job] = newest
                self.pending.pop(job, None)
                self.pending_slow.pop(job, None)
            return []
        t = Trigger(job, at, "hang", c.ranks, {"rule": "rankwatch.process_exit"})
        return self._publish(c, w, t, now_ns, ms)

    def _sweep_gap(self, job: str) -> float:
        """Seconds between two sweeps of `job`: its last sweep's cost (`spent`) over `sweep_share`,
        within [`min_sweep_s`, `sweep_s`] — a small job is judged every couple of seconds (a
        slowdown named within steps, not after a 10 s sweep interval), a 1,024-rank job whose
        sweep costs most of a second every `sweep_s`."""
        cost = self.sweep_cost.get(job)
        if cost is None:
            return self.config.sweep_s
        return min(self.config.sweep_s,
                   max(self.config.min_sweep_s, cost / self.config.sweep_share))

    def _open_culprits(self, job: str) -> tuple[tuple[int, ...], str | None, int | None]:
        """(culprit ranks, stage, onset) of the job's open performance incident; ((), None,
        None) without one. The onset only for an incident judged against its culprit's own
        past (`slow.analyze`, `confirm_since_ns`)."""
        d = self.book.current(job, "performance")
        if d is None:
            return (), None, None
        since = d.onset_ns if slow.OWN_PAST in d.labels else None
        return tuple(d.culprit_ranks), d.stage, since

    def _confirming(self, job: str) -> Callable[[Window, int], Conclusion | None]:
        """The slowdown analysis of a re-check: the open incident's culprits stay suspects
        while their excess persists (`diagnosis.slow.context.judge`, confirm)."""
        ranks, stage, since = self._open_culprits(job)
        return lambda w, now: slow.analyze(w, now, confirm=ranks, confirm_stage=stage,
                                           confirm_since_ns=since)

    def _diagnosing(self, t: Trigger) -> Callable[[Window, int], Conclusion | None]:
        """A trigger's analysis (`engine.diagnose`), judged as the re-checks judge while a
        performance incident of its job is open: a hang trigger of a job whose performance
        incident is open (the silence after its end) falls back to the slowdown analysis, and
        without the open culprits an onset that lies before its judged steps is not seen — a
        rank starved of CPU for the whole window then showed as spikes of its optimizer, and
        the incident named "host cpu" for 10 s was turned into `jitter [1] optim` at the end
        of a real job."""
        ranks, stage, since = self._open_culprits(t.job_id)
        return lambda w, now: engine.diagnose(w, t, now, confirm=ranks, confirm_stage=stage,
                                              confirm_since_ns=since)

    def _ops_sweep(self, job: str, at: int, now_ns: int) -> list[Diagnosis]:
        """A sweep of a job without stage records (diagnosis/ops_rca.py)."""
        w = self.read(job, at - int(self.config.window_s * SECOND), at, ops_rca.KINDS)
        if w is None or not w.get("ops"):
            return []
        c, ms = self._run(ops_rca.analyze, w, at)
        if c is None:
            return []
        t = Trigger(job, at, "hang" if c.kind == "hang" else "straggler", (),
                    {"rule": "rankwatch.ops_sweep"})
        return self._publish(c, w, t, now_ns, ms)

    def _recheck(self, job: str, classes: list[str], now_ns: int) -> list[Diagnosis]:
        """Each open incident of `classes` analysed again, at the event clock — or, where that
        stands before the moment the incident was concluded at, at that moment: the event clock
        of a job that has ended stops at its progress watermark plus the feed's lateness, which
        can lie before the evidence that opened the incident (a killed rank's exit beat, read
        by a trigger on the beats' own clock). A re-check there finds nothing; a real job whose
        rank was killed had its incident resolved 5 s later, and opened again when the beats'
        silence fired another trigger."""
        at = max([self.event_clock(job, now_ns),
                  *(self.read_to.get((job, cls), 0) for cls in classes)])
        if self.kept_at.get(job) == at:
            # a job that ended (or whose feed stopped): its incidents were kept on these very
            # records. Re-reading its 90 s window every `recheck_s` cost every job seen since
            # — on the 2-core machine, ticks of 2-15 s by a catalog's 30th job, each holding
            # up the pending tries of the live ones
            return []
        self.kept_at.pop(job, None)
        w = self._window(job, at)
        if w is None:
            return []
        out: list[Diagnosis] = []
        kept = True
        for cls in classes:
            fn = hang_rca.analyze if cls == "hang" else self._confirming(job) if w.get("stages") \
                else ops_rca.slowdown  # a job without stage records: from ops alone
            c, ms = self._run(fn, w, at)
            if c is None or incident_class(c.kind) != cls:
                kept = False  # counted toward resolution: judged again until resolved
                r = self.book.clear(job, cls, now_ns)
                if r is not None:
                    self.triggers.pop((job, cls), None)
                    self.read_to.pop((job, cls), None)
                    if cls == "hang":
                        self.resolved_hangs[job] = (frozenset(r.culprit_ranks), now_ns)
                    out.append(r)
            else:
                t = self.triggers.get((job, cls)) or Trigger(job, at, "straggler", (),
                                                             {"rule": "rankwatch.recheck"})
                out += self._publish(c, w, t, now_ns, ms)
        if kept:
            self.kept_at[job] = at
        return out


def newest_per_rank(kind: str, cols: Columns) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, the newest moment of each one's records) in a batch of `kind` ("stages": a
    record's step end; "ops": a call's end, or its enqueue while it is in flight), for
    `Analyst.stored`."""
    if kind != "stages":
        return newest_call_ends(cols)
    rank = ints(cols, "rank")
    end = ints(cols, "t_start") + stage_total(cols)
    if not rank.size:
        return rank, end
    ranks, at = np.unique(rank, return_inverse=True)
    newest = np.zeros(ranks.size, dtype=np.int64)
    np.maximum.at(newest, at, end.astype(np.int64))
    return ranks, newest


def _every_rank_exited(w: Window, at_ns: int) -> bool:
    """Whether every rank of `w`'s job has an exit beat (its process ended) by `at_ns`."""
    beats = w.get("beats")
    if not beats or "exited" not in beats:
        return False
    rank = ints(beats, "rank")
    ex = (ints(beats, "exited", 0) == 1) & (ints(beats, "ts") <= at_ns) \
        & (rank >= 0) & (rank < w.grid.world)
    return np.unique(rank[ex]).size >= w.grid.world
