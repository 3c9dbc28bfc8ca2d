"""Event-time windows per job: watermarks, which windows are due, late marks, and checkpoints.

Pure bookkeeping, no I/O (the derived runner, streams/derived.py, does the I/O); the wall clock
is injected (`clock`). Windows are aligned to multiples of their width in absolute ns
(`[k·W, (k+1)·W)`), so every worker and every restart cuts the same windows.

Contract:
- `observe(job, t_min, t_max, source=, kind=)` is called with the event-time range of every raw
  batch *after* it is durable in ClickHouse; `source` names the producer (the batch header's
  `producer`: a host agent, an importer, the simulator) and `kind` the raw kind.
- Watermark (a low watermark over live sources, in the spirit of Flink/Dataflow): a *source* is
  one (producer, raw kind) of a job. Each source keeps its largest event time and learns its own
  disorder: for every batch, how far its oldest event falls behind the largest event the source
  had sent before (the lateness that batch needed). Its allowed lateness is the largest disorder
  of its last `learn_batches` batches plus `margin_ns`, within [`min_lateness_ns`,
  `lateness_ns`]; until it has sent `warmup_batches` batches it is `lateness_ns`. A derived
  kind's watermark is the minimum over the *live* sources of its input kinds
  (`WindowSpec.inputs`; all kinds when empty) of (largest event − allowed lateness): a source
  that is behind holds the windows back, so its rows are not cut off. A source silent for more
  than `silent_ns` of wall clock is not live: a dead host, or a hung job that stops producing
  op records, cannot stall the windows (the heartbeat and snapshot sources keep them moving).
  With no live input source the windows' inputs are as complete as they will be waited for,
  and the live sources of other kinds only say how far event time got: the windows close up to
  the job's largest event − `min_lateness_ns` (a late heartbeat in them only makes a liveness
  reading older; a late input record is late data as always); with no live source at all,
  the job's largest event time minus `lateness_ns` (so too right after a restart, before any
  source is known), and once every source has been quiet for `idle_ns` of wall clock
  (counted from the restore for a job restored without any batch since) the job has stopped
  sending (it ended, or every host is gone): every window up to and including the one holding
  its largest event closes, so the last windows of a job — the partial window its final records
  fall in — are not left open. (A job that sends again after such a pause finds those windows
  closed: its records in them are late data, as below.) A window
  `[s, s+W)` is due once `s + W <= watermark`. The watermark never goes back (per job and
  derived kind).
- A derived kind's windows close in order: `next_start` is the first window not yet closed. A
  kind's windows exist once a batch of a raw kind it uses (`WindowSpec.inputs` and `reads`)
  was observed (`fed`), and start at the window holding that batch's oldest event. Until the
  kind's first window is closed, an earlier batch moves the start back: a worker that starts
  on a backlog reads its topics and partitions in no particular order, and the first batch of
  a kind it sees may come from late in the job. (A start fixed at the job's first event of
  any kind would close a kind's windows unread while it has no batch yet: on a backlog whose
  kernel records are read ahead of its ops, most of a job's progress windows would close
  before their ops arrive, and progress takes no late marks, so they would be lost.) The
  start is checkpointed as soon as it opens or moves (a `<kind>:open` row, restored as still
  movable), before the batch that set it is committed. A restored job's kinds resume at their
  checkpoints; a kind missing from the checkpoint starts no later than the earliest window
  any of them had left open (what the previous worker stored before it could checkpoint is
  unknown).
- A batch of a raw kind a derived kind uses, whose events fall before that kind's
  `next_start` once it is fixed, is late data; if the kind asked for late marks
  (`WindowSpec.late_marks`) it marks the closed windows it touches (extended by `reach_ns`
  forward: a late op changes the step it belongs to, which may end in the next window) for
  recomputation; marks further back than `max_late_windows` windows are dropped and counted.
  `observe` returns whether it added a mark, so the caller can make the mark durable before
  the batch's offsets are committed (streams/derived.py stores it with the checkpoint,
  `late_span`/`restore`).
- Gaps: a stretch of more than `gap_ns` of event time in which no record of a derived kind's
  inputs or reads was observed is not windowed. Each kind keeps the stretches its batches
  covered (`segments`: per batch the union of its records' [start, end], split where
  `gap_ns` holds none; stretches within `gap_ns` of each other merged; at most
  `max_segments`, the two closest merged beyond that). When the first window not closed lies
  past every stretch below it and before the next one, the windows up to that stretch (and no
  further than the watermark) are skipped: they hold no record, so closing them one by one
  would only emit rows of ranks that sent nothing. Without this a batch a year older than the
  rest of its job (the job's first batch, or one that moves a start back) would make the
  worker close ~31 M one-second windows; a job that pauses for a day would close 86,400 on
  resuming. An import publishes a trace of any length contiguously: its stretches merge and
  all its windows are closed. Skipped windows count in `skipped_windows` and set the job's
  `moved` flag (the runner stores the checkpoint).
- State per job is O(kinds + sources + late marks + segments): no events are held here, and
  nothing grows with the length of the run. `checkpoint()` / `restore()` carry it across
  restarts (the `stream_state` table); sources and segments are not checkpointed: after a
  restart sources start over, at `lateness_ns`, until they have sent `warmup_batches` again,
  and a restored kind's one stretch runs from its checkpoint to the job's largest event.
  `restore()` must come before the first `observe()` of a restarted worker (streams/derived.py,
  `restore_windows`): a batch observed first would open its job's windows at that batch, and a
  checkpoint taken then (a late mark's) would skip the windows the previous worker had not
  closed. See docs/architecture.md, "Derived streams".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ingest.units import SECOND as SEC

#: The `kind` of a checkpoint row that stores a derived kind's late marks (as a span).
LATE_SUFFIX = ":late"
#: The `kind` of a checkpoint row for a derived kind none of whose windows is closed yet: its
#: first window may still move back (`KindState.fixed` is False).
OPEN_SUFFIX = ":open"


def window_start(t_ns: int, width_ns: int) -> int:
    """Start of the aligned window holding `t_ns`."""
    return (t_ns // width_ns) * width_ns


def event_segments(start: np.ndarray, end: np.ndarray, gap_ns: int) -> list[tuple[int, int]]:
    """The stretches of event time a batch's records cover: the union of each record's
    [start, end] (an end before its start, e.g. 0 for not known, counts as the start), split
    where more than `gap_ns` holds none; oldest first, [] for no record. Numpy only: sorted
    only when the batch spans more than `gap_ns` (a live batch spans well under a second)."""
    if not len(start):
        return []
    start = np.asarray(start, np.int64)
    end = np.maximum(np.asarray(end, np.int64), start)
    lo, hi = int(start.min()), int(end.max())
    if hi - lo <= gap_ns:
        return [(lo, hi)]
    order = np.argsort(start, kind="stable")
    s = start[order]
    e = np.maximum.accumulate(end[order])
    cut = np.flatnonzero(s[1:] > e[:-1] + gap_ns) + 1
    los = s[np.concatenate(([0], cut))]
    his = e[np.concatenate((cut - 1, [len(s) - 1]))]
    return list(zip(los.tolist(), his.tolist(), strict=True))


@dataclass(frozen=True)
class WindowSpec:
    kind: str
    width_ns: int
    #: How far past its own time a late record can change a result (iterations: the longest step).
    reach_ns: int = 0
    late_marks: bool = False
    max_late_windows: int = 360
    #: Raw kinds whose sources bound this kind's watermark (empty: every kind).
    inputs: tuple[str, ...] = ()
    #: Other raw kinds the window's computation reads (progress: beats): a job with one of these
    #: or of `inputs` has windows worth reading (`Windows.fed`).
    reads: tuple[str, ...] = ()


@dataclass(frozen=True)
class WatermarkParams:
    """How sources learn their lateness (module docstring); `lateness_ns` is the upper bound."""

    lateness_ns: int = 2 * SEC
    min_lateness_ns: int = SEC // 4
    margin_ns: int = SEC // 4
    learn_batches: int = 64
    warmup_batches: int = 8
    silent_ns: int = 2 * SEC
    idle_ns: int = 10 * SEC
    #: A longer stretch of event time without a record of a kind's inputs is not windowed.
    gap_ns: int = 600 * SEC
    #: Stretches held per job and kind (`KindState.segments`).
    max_segments: int = 64


@dataclass
class Source:
    """One (producer, raw kind) of a job: its largest event time and learned disorder."""

    max_ns: int
    seen_wall_ns: int
    batches: int = 0
    disorder: deque[int] = field(default_factory=deque)

    def lateness(self, p: WatermarkParams) -> int:
        if self.batches < p.warmup_batches:
            return p.lateness_ns
        learned = max(self.disorder, default=0) + p.margin_ns
        return min(p.lateness_ns, max(p.min_lateness_ns, learned))


@dataclass
class KindState:
    next_start: int
    late: set[int] = field(default_factory=set)
    watermark: int = -1
    #: A window was closed, or the state restored: `next_start` no longer moves back.
    fixed: bool = False
    #: Stretches of event time its input batches covered, [lo, hi] oldest first, apart by more
    #: than `gap_ns` (module docstring, "Gaps"); those wholly closed are dropped but the newest.
    segments: list[list[int]] = field(default_factory=list)


@dataclass
class JobState:
    first_ns: int
    max_ns: int
    kinds: dict[str, KindState] = field(default_factory=dict)
    sources: dict[tuple[str, str], Source] = field(default_factory=dict)
    #: Wall clock of the restore that created this state (None: created by a batch).
    restored_wall_ns: int | None = None
    #: A gap was skipped since the last `moved()`: the checkpoint is out of date.
    moved: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """One row of `stream_state`: where a job's kind stands (for `<kind>:late` rows, the span of
    marked windows: `next_start` the first, `max_ns` the last; -1 for none)."""

    job_id: str
    kind: str
    next_start: int
    max_ns: int


class Windows:
    """Watermarks and due windows for every job the worker has seen; see the module docstring."""

    def __init__(self, specs: list[WindowSpec], lateness_ns: int,
                 params: WatermarkParams | None = None, *,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        if lateness_ns < 0:
            raise ValueError(f"lateness_ns={lateness_ns} must be >= 0")
        for s in specs:
            if s.width_ns <= 0:
                raise ValueError(f"{s.kind}: width_ns={s.width_ns} must be > 0")
        p = params or WatermarkParams()
        if p.gap_ns <= 0 or p.max_segments < 1:
            raise ValueError(f"gap_ns={p.gap_ns} must be > 0, max_segments={p.max_segments} >= 1")
        self.params = replace(p, lateness_ns=lateness_ns,
                              min_lateness_ns=min(p.min_lateness_ns, lateness_ns))
        self.specs = {s.kind: s for s in specs}
        self.lateness_ns = lateness_ns
        self.clock = clock
        self.jobs: dict[str, JobState] = {}
        self.dropped_late = 0
        #: Windows skipped over gaps without records, per derived kind (module docstring).
        self.skipped_windows: dict[str, int] = {}
        #: Whether `restore()` ran (streams/derived.py restores once, before the first batch).
        self.restored = False
        #: The `streams.ownership.Ownership.generation` the jobs held here were restored for
        #: (streams/derived.py, `restore_windows`: a new assignment hands jobs over).
        self.owner_generation = -1

    def observe(self, job: str, t_min: int, t_max: int, *, source: str = "",
                kind: str = "", segments: Sequence[tuple[int, int]] | None = None) -> bool:
        """A durable batch of `job` with event times in [t_min, t_max] (ns; 0 = unknown) from
        `source` (producer) of raw `kind`; `segments` the stretches its records cover
        (`event_segments`; default all of [t_min, t_max]). True when it changed what a restart
        must resume from: it marked closed windows as late, or opened a kind's windows or moved
        their start back (the caller stores `checkpoint(job)` before the batch's offsets are
        committed: a redelivery never brings a committed batch back)."""
        if t_max <= 0:
            return False
        t_min = t_min if t_min > 0 else t_max
        covered = segments or [(t_min, t_max)]
        st = self.jobs.get(job)
        if st is None:
            st = self.jobs[job] = JobState(t_min, t_max)
        st.first_ns = min(st.first_ns, t_min)
        st.max_ns = max(st.max_ns, t_max)
        self._learn(st, (source, kind), t_min, t_max)
        changed = False
        for k, spec in self.specs.items():
            if kind and spec.inputs and kind not in spec.inputs + spec.reads:
                continue  # e.g. a kernel batch changes no progress or iteration window
            ks = st.kinds.get(k)
            if ks is None:
                first = t_min if st.restored_wall_ns is None else min(t_min, st.first_ns)
                ks = st.kinds[k] = KindState(window_start(first, spec.width_ns))
                # a restored job's records from `first` on may be stored unseen: not a gap
                self._cover(ks, first, t_min)
                changed = True
            elif t_min < ks.next_start and not ks.fixed:
                ks.next_start = window_start(t_min, spec.width_ns)
                changed = True
            elif t_min < ks.next_start and spec.late_marks:
                changed |= self._mark_late(ks, spec, t_min, t_max)
            for lo, hi in covered:
                self._cover(ks, lo, hi)
        return changed

    def _cover(self, ks: KindState, lo: int, hi: int) -> None:
        """Add [lo, hi] to the kind's stretches, merging those within `gap_ns` of it."""
        gap, segs = self.params.gap_ns, ks.segments
        if segs and segs[-1][0] - gap <= hi and lo <= segs[-1][1] + gap and (
                len(segs) == 1 or segs[-2][1] + gap < lo):  # the usual case: the newest grows
            segs[-1][0], segs[-1][1] = min(segs[-1][0], lo), max(segs[-1][1], hi)
            return
        keep = []
        for s in segs:
            if s[1] + gap < lo or hi + gap < s[0]:
                keep.append(s)
            else:
                lo, hi = min(lo, s[0]), max(hi, s[1])
        keep.append([lo, hi])
        keep.sort()
        while len(keep) > self.params.max_segments:  # merge the closest two
            i = min(range(len(keep) - 1), key=lambda j: keep[j + 1][0] - keep[j][1])
            keep[i:i + 2] = [[keep[i][0], max(keep[i][1], keep[i + 1][1])]]
        ks.segments = keep

    def _skip_gap(self, st: JobState, kind: str, ks: KindState, wm: int) -> int | None:
        """Move `next_start` over windows that lie in a gap between stretches (module
        docstring, "Gaps"), up to the next stretch and no further than the watermark. Returns
        the end of the last window before the next gap (None: no gap ahead): windows due in
        one call stop there, so the next call skips the gap."""
        spec = self.specs[kind]
        w, segs = spec.width_ns, ks.segments

        def last(seg: list[int]) -> int:  # the last window its records can change
            return window_start(seg[1] + spec.reach_ns, w)

        while len(segs) > 1 and last(segs[0]) < ks.next_start:
            segs.pop(0)
        if not segs or last(segs[0]) < ks.next_start:
            return None
        to = min(window_start(segs[0][0], w), window_start(wm, w))
        if to > ks.next_start:
            self.skipped_windows[kind] = (self.skipped_windows.get(kind, 0)
                                          + (to - ks.next_start) // w)
            ks.next_start = to
            ks.fixed = True
            st.moved = True
        return last(segs[0]) + w if len(segs) > 1 else None

    def moved(self, job: str) -> bool:
        """Whether `due` skipped windows of `job` since the last call (its checkpoint is then
        out of date)."""
        st = self.jobs.get(job)
        if st is None or not st.moved:
            return False
        st.moved = False
        return True

    def _learn(self, st: JobState, key: tuple[str, str], t_min: int, t_max: int) -> None:
        now = self.clock()
        src = st.sources.get(key)
        if src is None:
            st.sources[key] = Source(t_max, now, 1)
            return
        src.disorder.append(max(0, src.max_ns - t_min))
        if len(src.disorder) > self.params.learn_batches:
            src.disorder.popleft()
        src.max_ns = max(src.max_ns, t_max)
        src.seen_wall_ns = now
        src.batches += 1

    def _mark_late(self, ks: KindState, spec: WindowSpec, t_min: int, t_max: int) -> bool:
        w = spec.width_ns
        oldest = ks.next_start - spec.max_late_windows * w
        last = min(window_start(t_max + spec.reach_ns, w), ks.next_start - w)
        first = window_start(t_min, w)
        if first < oldest:
            self.dropped_late += (min(last, oldest - w) - first) // w + 1
            first = oldest
        new = set(range(first, last + 1, w)) - ks.late
        ks.late |= new
        return bool(new)

    def watermark(self, job: str, kind: str | None = None) -> int:
        """The job's watermark for derived `kind` (None: over every source); -1 if unknown."""
        st = self.jobs.get(job)
        if st is None:
            return -1
        inputs = self.specs[kind].inputs if kind is not None else ()
        now, p = self.clock(), self.params
        live = {key: s for key, s in st.sources.items() if now - s.seen_wall_ns <= p.silent_ns}
        mine = [s.max_ns - s.lateness(p) for (_, k), s in live.items() if not inputs or k in inputs]
        newest = max((s.seen_wall_ns for s in st.sources.values()),
                     default=st.restored_wall_ns)
        idle = newest is not None and now - newest > p.idle_ns
        if mine:
            wm = min(mine)
        elif idle:  # the job stopped sending: everything it sent is in, the last window too
            wm = st.max_ns if kind is None else (
                window_start(st.max_ns, self.specs[kind].width_ns) + self.specs[kind].width_ns)
        elif live:  # the inputs are quiet while other sources go on: as complete as waited for
            wm = st.max_ns - p.min_lateness_ns
        else:
            wm = st.max_ns - self.lateness_ns
        ks = st.kinds.get(kind) if kind is not None else None
        if ks is None:
            return wm
        ks.watermark = max(ks.watermark, wm)
        return ks.watermark

    def fed(self, job: str, kind: str) -> bool:
        """Whether `job` has windows of derived `kind`: a batch of a raw kind it uses (`inputs`,
        `reads`) was observed, or the kind was restored from a checkpoint. False for a job whose
        batches so far were all of other kinds (a kernel-only producer's job has no progress or
        iteration rows): nothing of the kind is due, and nothing is read."""
        st = self.jobs.get(job)
        return st is not None and kind in st.kinds

    def due(self, job: str, kind: str, limit: int = 64) -> list[int]:
        """Starts of windows of `kind` ready to close, oldest first, at most `limit`."""
        st = self.jobs.get(job)
        if st is None:
            return []
        ks = st.kinds.get(kind)
        if ks is None:
            return []
        w = self.specs[kind].width_ns
        wm = self.watermark(job, kind)
        stop = self._skip_gap(st, kind, ks, wm)
        n = max(0, min(limit, (min(wm, stop if stop is not None else wm) - ks.next_start) // w))
        return [ks.next_start + i * w for i in range(n)]

    def open_window(self, job: str, kind: str) -> tuple[int, int]:
        """(start of the first window of `kind` not closed, the kind's watermark): the part of
        the open window whose events are complete, for previews (streams/derived.py)."""
        st = self.jobs.get(job)
        if st is None or kind not in st.kinds:
            return -1, -1
        return st.kinds[kind].next_start, self.watermark(job, kind)

    def late(self, job: str, kind: str, limit: int = 64) -> list[int]:
        """Closed windows marked for recomputation, oldest first (they stay marked until
        `recomputed`)."""
        st = self.jobs.get(job)
        if st is None or kind not in st.kinds:
            return []
        return sorted(st.kinds[kind].late)[:limit]

    def closed(self, job: str, kind: str, start: int) -> None:
        """Window `start` of `kind` is durable: the next one is due next."""
        ks = self.jobs[job].kinds[kind]
        if start != ks.next_start:
            raise ValueError(f"{job}/{kind}: closing {start} but the next window is "
                             f"{ks.next_start}")
        ks.next_start = start + self.specs[kind].width_ns
        ks.fixed = True

    def recomputed(self, job: str, kind: str, start: int) -> None:
        self.jobs[job].kinds[kind].late.discard(start)

    def checkpoint(self, job: str) -> list[Checkpoint]:
        """The job's rows for `stream_state`: per kind the next window (`<kind>:open` while
        none of its windows is closed: a start that may still move back), and per kind with
        late marks the span they cover (-1, -1 once none is left)."""
        st = self.jobs[job]
        rows = [Checkpoint(job, k if ks.fixed else k + OPEN_SUFFIX, ks.next_start, st.max_ns)
                for k, ks in st.kinds.items()]
        for k, ks in st.kinds.items():
            if self.specs[k].late_marks:
                lo, hi = (min(ks.late), max(ks.late)) if ks.late else (-1, -1)
                rows.append(Checkpoint(job, k + LATE_SUFFIX, lo, hi))
        return rows

    def forget(self, job: str) -> None:
        """Drop everything held of `job` (another worker owns it now)."""
        self.jobs.pop(job, None)

    def restore(self, rows: list[Checkpoint]) -> None:
        """Resume from stored checkpoints (before any batch of their jobs is observed). A stored
        span of late marks is marked again whole (recomputing a window twice is harmless). A
        kind stored open (`<kind>:open`, no window closed) resumes open, its start free to move
        back, unless a row of the kind itself says a window was closed since."""
        self.restored = True
        spans = [r for r in rows if r.kind.endswith(LATE_SUFFIX)]
        closed = {(r.job_id, r.kind) for r in rows if r.kind in self.specs}
        for r in rows:
            kind = r.kind.removesuffix(OPEN_SUFFIX)
            fixed = kind == r.kind
            if kind not in self.specs or (not fixed and (r.job_id, kind) in closed):
                continue
            st = self.jobs.get(r.job_id)
            if st is None:
                st = self.jobs[r.job_id] = JobState(r.next_start, r.max_ns,
                                                    restored_wall_ns=self.clock())
            st.max_ns = max(st.max_ns, r.max_ns)
            st.first_ns = min(st.first_ns, r.next_start)
            st.kinds[kind] = KindState(r.next_start, fixed=fixed)
            # what the previous worker stored from the checkpoint on is not known: no gap
            self._cover(st.kinds[kind], r.next_start, st.max_ns)
        for r in spans:
            kind = r.kind.removesuffix(LATE_SUFFIX)
            st = self.jobs.get(r.job_id)
            if kind not in self.specs or st is None or kind not in st.kinds or r.next_start < 0:
                continue
            w = self.specs[kind].width_ns
            ks = st.kinds[kind]
            ks.late.update(s for s in range(r.next_start, r.max_ns + 1, w) if s < ks.next_start)
