"""The derived runner: closes event-time windows of every job and writes progress, iterations and
kernel summaries, computed from the durable raw tables (docs/architecture.md, "Derived streams").

Flow per tick (every `tick_s`, a task of the app: `streams.timers.every`):
1. The raw sinks' store (`ObservingStore`) reports the event-time range of every batch (and the
   stretches its records cover: `streams.windows.event_segments`) *after*
   it is stored; `streams.windows.Windows` turns that into per-job watermarks and due windows.
2. For each due window: compute from ClickHouse (progress: streams/progress.py; iterations:
   streams/iterations.py over the window's stages and ops; kernels: streams/kernel_summaries.py),
   insert with a deduplication token naming (kind, job, window), publish to rw.<kind> keyed by
   job_id, then mark the window closed.
3. Store the job's checkpoint (`stream_state`: next window per kind, largest event time, and
   the span of iteration windows marked late).
4. Preview the open iterations window: the rows of steps whose bounds are known exactly from
   the records stored so far (`iteration_rows(preview=True)`: a stage record, or a gradient
   collective after the rank's previous one), each once, are published to rw.iterations as soon
   as their records are stored — not stored themselves; the window's close stores and publishes
   the authoritative rows (consumers key on (job, rank, step)). A preview's step bounds and
   step_ns are final; its communication columns may miss ops that arrive later. A step's row
   thus reaches the triggers when its last record is stored instead of after its 10 s window
   closes. Frames of previews reach `preview_reach_ns` back, so steps longer than that are only
   in the window's rows; once a window of the job has closed they start instead at the ranks'
   last known step ends (`DerivedJob.bounds`, docs/architecture.md "Iteration previews").

What the runner keeps of a job between ticks is one `DerivedJob`; the decisions made from it
(`replaying`, `frame_reach`, `preview_range`, `frame_start`, `encoded_parts`) are functions of
explicit values and clock readings.

Restart: the checkpoint says which windows are closed; every raw row is durable before it is
observed, so the windows after the checkpoint are computed from complete raw data. The checkpoints
are loaded (`restore_windows`, once) before the first batch is observed — by whichever comes
first, a raw sink's write or the runner's first tick: Faust starts the agents and the tasks
together. A batch observed on a state not restored yet would open its job's windows at that
batch, and its late mark would store that state as the job's checkpoint, newer than the previous
worker's: the windows between the two would never be closed. A window that was written but not
checkpointed is computed again, its insert dropped by the token (no duplicate row) and its
message published again (consumers key on (job_id, window) — see docs/records.md).
Late iterations: a batch older than the closed windows marks them; they are recomputed and the new
rows replace the old ones (ReplacingMergeTree on (job_id, rank, step), newest ingest_ts). The
mark is made durable before the raw sink returns (`ObservingStore.write` stores the job's
checkpoint with the span of marked windows), so a crash before the recomputation does not lose
it: the raw sink would skip the redelivered batch, and the restored checkpoint marks the span
again.
The same holds for where a job's windows start: the batch that opens a kind's windows (or moves
their start back, before the first closes) stores the checkpoint (`<kind>:open`) before it is
acked. Else a worker killed after committing a job's first batches but before checkpointing
any window would restart without the job: its windows would open at the first batch delivered
again, and those before it were never computed (or, if some were stored, a gap).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ingest.backoff import Backoff
from ingest.batch import Coded, RecordBatch, encode_batch
from ingest.inflight import superseded
from ingest.records import comm_kind_code_sql, declared_codes
from ingest.units import SECOND as SEC
from streams.db import Database
from streams.iterations import KIND_CODES, Bounds, OpFrame, iteration_rows
from streams.kernel_summaries import KernelBuffer, KernelParams, KernelSummarizer
from streams.ownership import Ownership
from streams.progress import ProgressFeed, ProgressParams
from streams.reports import Extent, encode_report, extent
from streams.store import ClickHouseStore
from streams.windows import Checkpoint, WatermarkParams, Windows, WindowSpec
from streams.writer import ClickHouseWriter, insert_settings

log = logging.getLogger(__name__)
Publish = Callable[[str, str, bytes], Awaitable[None]]  # (kind, job_id, batch bytes)


@dataclass(frozen=True)
class DerivedConfig:
    lateness_ns: int = 2 * SEC
    progress: ProgressParams = field(default_factory=ProgressParams)
    iteration_window_ns: int = 10 * SEC
    max_step_ns: int = 60 * SEC
    grad_collectives_per_step: int = 1
    kernels: KernelParams = field(default_factory=KernelParams)
    watermark: WatermarkParams = field(default_factory=WatermarkParams)
    preview_iterations: bool = True
    preview_reach_ns: int = 10 * SEC
    #: Previews are for live jobs: none while a job's event time runs more than this many times
    #: faster than the wall clock over the last `pace_span_ns` (a backlog, a replay).
    preview_max_pace: float = 2.0
    pace_span_ns: int = 4 * SEC
    tick_s: float = 0.25
    #: A job whose windows fail is retried after tick_s, then twice as long each time, up to this.
    max_retry_s: float = 30.0
    max_windows_per_tick: int = 16
    publish_rows: int = 20_000
    #: Largest encoded message published to rw.<kind>: a batch over it is split (by rows).
    publish_max_bytes: int = 1 << 20


def checkpoint_columns(rows: Sequence[Checkpoint], now: int) -> dict[str, np.ndarray]:
    """`stream_state` columns for checkpoint rows (newest `updated` wins)."""
    return {"job_id": np.array([r.job_id for r in rows], dtype=object),
            "kind": np.array([r.kind for r in rows], dtype=object),
            "next_start": np.array([r.next_start for r in rows], np.int64),
            "max_ns": np.array([r.max_ns for r in rows], np.int64),
            "updated": np.full(len(rows), now, np.int64)}


class ObservingStore(ClickHouseStore):
    """The raw sinks' store; reports each stored batch's event-time extent (streams/reports.py)
    to `windows` when this worker owns the batch's job, else to the job's owner (`report`:
    published on the job-keyed `stored` topic, awaited), and hands stored kernel batches to
    `kernels` (the runner's `kernels.buffer`: summaries from memory,
    streams/kernel_summaries.py). A batch that marks closed windows late, or opens a job's
    windows or moves their start back, has the job's checkpoint stored before `write` returns,
    i.e. before the raw sink acks the batch; the owner folding a report does the same before
    the report is acked (`fold_reports`). The stored checkpoints are loaded into `windows`
    before the first batch is observed (`restore_windows`)."""

    def __init__(self, writer: ClickHouseWriter, windows: Windows,
                 kernels: KernelBuffer | None = None, *,
                 ownership: Ownership | None = None,
                 report: Callable[[str, bytes], Awaitable[None]] | None = None) -> None:
        super().__init__(writer)
        self.windows, self.kernels = windows, kernels
        self.ownership = ownership or Ownership()
        #: publishes (job, report) for the job's owner; None: a batch of a job this worker does
        #: not own is stored and nothing more (one worker, or tests)
        self.report = report
        #: called with (kind, batch) for every stored batch of an owned job (the diagnosis
        #: agents read the beats this way); each must be quick and must not block
        self.listeners: list[Callable[[str, RecordBatch], None]] = []
        #: called with (job, kind, ranks, newest ends) for each folded report of an owned job
        #: (what `listeners` learn of calls another worker stored); quick, never blocking
        self.end_listeners: list[Callable[[str, str, np.ndarray, np.ndarray], None]] = []
        self.reports_sent = self.reports_folded = self.reports_not_owned = 0

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]]) -> int:
        # a failure here fails the write (nothing stored yet): the raw sink retries it
        await restore_windows(self.writer.db, self.windows, self.ownership)
        n = await super().write(kind, batches, token, sources=sources)
        await self.stored(kind, batches)
        return n

    async def skipped(self, kind: str, batches: Sequence[RecordBatch]) -> None:
        """`batches` were stored before (a redelivery the raw sink skips: `RawSink.on_skipped`):
        report and observe them again, which is idempotent, but hand them to no listener and
        no kernel buffer — those may have them already."""
        await self.stored(kind, batches, again=True)

    async def stored(self, kind: str, batches: Sequence[RecordBatch], *,
                     again: bool = False) -> None:
        """`batches` of `kind` are stored (by `write`; `again`: before, `skipped`): report
        them to their jobs' owners first (a failure fails the write, which is retried and
        deduplicated, so nothing is observed twice here), then observe those of owned jobs.

        Ownership is read again after the reports, once the checkpoints of the current
        assignment are loaded, with no await between that and the observations: a rebalance
        during the insert or the reports would otherwise have a batch of a job just gained
        open the job's windows at that batch, and the restore that follows keeps a job already
        held, so the windows the previous owner left open before it would never close (a
        job's first iteration windows, in a takeover). A job lost meanwhile is reported to its
        new owner instead."""
        gap = self.windows.params.gap_ns
        mine: list[RecordBatch] = []
        remote: dict[str, list[Extent]] = {}
        for b in batches:
            if self.ownership.owns(b.job_id):
                mine.append(b)
            elif self.report is not None:
                self._extent_for_owner(kind, b, gap, remote)
        await self._report(kind, remote)
        await restore_windows(self.writer.db, self.windows, self.ownership)
        changed: set[str] = set()
        lost: dict[str, list[Extent]] = {}
        for b in mine:
            if not self.ownership.owns(b.job_id):  # handed over during the reports
                if self.report is not None:
                    self._extent_for_owner(kind, b, gap, lost)
                continue
            try:  # the rows are stored: a bookkeeping bug must not fail (and stop) the raw sink
                ext = extent(kind, b, gap, ends=False)
                if ext is not None and self._observe(ext):
                    changed.add(b.job_id)
                if ext is not None and kind == "kernels" and self.kernels is not None \
                        and not again:
                    self.kernels.close(b.job_id, self.windows.open_window(
                        b.job_id, "kernel_summaries")[0])
                    self.kernels.add(b)
            except Exception:
                log.exception("derived windows: observing a %s write failed", kind)
            for fn in [] if again else self.listeners:
                try:
                    fn(kind, b)
                except Exception:  # a listener's bug must not fail (and stop) the raw sink
                    log.exception("a listener of stored %s batches failed", kind)
        await self._checkpoint(changed)
        await self._report(kind, lost)

    @staticmethod
    def _extent_for_owner(kind: str, b: RecordBatch, gap: int,
                          out: dict[str, list[Extent]]) -> None:
        """Add the extent of `b`, a batch of a job another worker owns, to `out` by job."""
        try:
            ext = extent(kind, b, gap)
        except Exception:  # stored: a bookkeeping bug must not fail (and stop) the sink
            log.exception("derived windows: the extent of a stored %s batch", kind)
            return
        if ext is not None:
            out.setdefault(b.job_id, []).append(ext)

    async def _report(self, kind: str, remote: dict[str, list[Extent]]) -> None:
        """Publish each job's extents for its owner (streams/reports.py)."""
        for job, exts in remote.items():
            try:
                assert self.report is not None
                await self.report(job, encode_report(job, exts))
            except Exception as e:  # an outage: the raw sink retries the (deduplicated) write
                raise ReportUndelivered(f"reporting stored {kind} of {job} to its owner: "
                                        f"{type(e).__name__}: {e}") from e
            self.reports_sent += 1

    async def fold_reports(self, reports: Sequence[list[Extent]]) -> None:
        """Fold reports of what other workers stored (`stored`) into the windows of the jobs
        this worker owns; a job's checkpoint is stored before this returns when a report
        changed what a restart resumes from (as for the worker's own batches). Reports of jobs
        this worker does not own (read during a rebalance) are counted and skipped: their
        new owner restores the job from the stored tables."""
        await restore_windows(self.writer.db, self.windows, self.ownership)
        changed: set[str] = set()
        for exts in reports:
            for ext in exts:
                if not self.ownership.owns(ext.job):
                    self.reports_not_owned += 1
                    break
                try:
                    if self._observe(ext):
                        changed.add(ext.job)
                except Exception:
                    log.exception("derived windows: folding a report of %s failed", ext.job)
                for fn in self.end_listeners:
                    try:
                        fn(ext.job, ext.kind, ext.ranks, ext.ends)
                    except Exception:
                        log.exception("a listener of stored %s extents failed", ext.kind)
            else:
                self.reports_folded += 1
        await self._checkpoint(changed)

    def _observe(self, ext: Extent) -> bool:
        return self.windows.observe(ext.job, ext.lo, ext.hi, source=ext.producer,
                                    kind=ext.kind, segments=list(ext.segments))

    async def _checkpoint(self, jobs: set[str]) -> None:
        """Store the checkpoints of `jobs`; a failure fails the caller (the batch or report
        comes again)."""
        for job in sorted(jobs):
            rows = self.windows.checkpoint(job)  # stamped by the runner's clock, as its own are
            await self.writer.db.ainsert("stream_state",
                                         checkpoint_columns(rows, self.windows.clock()),
                                         insert_settings(None))


class ReportUndelivered(ConnectionError):
    """A report for a job's owner could not be published: an outage, the write is retried."""


STAGES_SQL = """
SELECT rank, step, toUnixTimestamp64Nano(t_start) AS start_ns, data_next_wait, model_fwd_loss,
       model_backward, callbacks, optim_step, step_other
FROM stages WHERE job_id = {job:String}
  AND t_start >= fromUnixTimestamp64Nano({lo:Int64}, 'UTC')
  AND t_start < fromUnixTimestamp64Nano({we:Int64}, 'UTC')
"""
#: A communicator's kind code (ingest.records.comm_kind_codes): the job's topology (`ids` ->
#: `codes`), else the comm_id's name.
COMM_KIND_SQL = comm_kind_code_sql()
OPS_SQL = """
SELECT rank,
       """ + COMM_KIND_SQL + """ AS kind,
       CAST(op IN ('AllReduce', 'ReduceScatter') AS UInt8) AS grad_op, op_seq, step, bytes,
       toUnixTimestamp64Nano(t_start) AS start_ns, toUnixTimestamp64Nano(t_end) AS end_ns,
       comm_id
FROM ops WHERE job_id = {job:String}
  AND t_start >= fromUnixTimestamp64Nano({lo:Int64}, 'UTC')
  AND t_start < fromUnixTimestamp64Nano({we:Int64}, 'UTC')
"""
#: A stage record's end (ns): its start plus the six durations (streams/iterations.py).
STAGE_END_SQL = """(toUnixTimestamp64Nano(t_start) + data_next_wait + model_fwd_loss
     + model_backward + callbacks + optim_step + step_other)"""
#: Records that may end a step in [t0, t1) (streams/iterations.py: a DP gradient collective or
#: a stage record), among those starting at or after `lo`.
STEP_ENDS_SQL = """
SELECT
  ifNull((SELECT count() FROM ops WHERE job_id = {job:String}
     AND t_start >= fromUnixTimestamp64Nano({lo:Int64}, 'UTC')
     AND t_start < fromUnixTimestamp64Nano({t1:Int64}, 'UTC')
     AND t_end >= fromUnixTimestamp64Nano({t0:Int64}, 'UTC')
     AND t_end < fromUnixTimestamp64Nano({t1:Int64}, 'UTC')
     AND op IN ('AllReduce', 'ReduceScatter')
     AND """ + COMM_KIND_SQL + """ = 2), 0) AS ops,
  ifNull((SELECT count() FROM stages WHERE job_id = {job:String}
     AND t_start >= fromUnixTimestamp64Nano({lo:Int64}, 'UTC')
     AND t_start < fromUnixTimestamp64Nano({t1:Int64}, 'UTC')
     AND """ + STAGE_END_SQL + """ >= {t0:Int64}
     AND """ + STAGE_END_SQL + """ < {t1:Int64}), 0) AS stages
"""
#: Records that start before an iterations frame (from `far`, max_step_ns before the window, to
#: `lo`) and end in or after the window: if any, the short frame misses a step's records.
REACH_SQL = """
SELECT
  ifNull((SELECT count() FROM ops WHERE job_id = {job:String}
     AND t_start >= fromUnixTimestamp64Nano({far:Int64}, 'UTC')
     AND t_start < fromUnixTimestamp64Nano({lo:Int64}, 'UTC')
     AND t_end >= fromUnixTimestamp64Nano({ws:Int64}, 'UTC')), 0) AS ops,
  ifNull((SELECT count() FROM stages WHERE job_id = {job:String}
     AND t_start >= fromUnixTimestamp64Nano({far:Int64}, 'UTC')
     AND t_start < fromUnixTimestamp64Nano({lo:Int64}, 'UTC')
     AND """ + STAGE_END_SQL + """ >= {ws:Int64}), 0) AS stages
"""
TOPOLOGY_SQL = """
SELECT comm_ids, comm_kinds FROM jobs FINAL WHERE job_id = {job:String} LIMIT 1
"""
STATE_SQL = "SELECT job_id, kind, next_start, max_ns FROM stream_state FINAL"


async def restore_windows(db: Database, windows: Windows,
                          ownership: Ownership | None = None) -> None:
    """Load the stored checkpoints of the jobs this worker owns into `windows` before anything
    of them is observed or closed: called by the raw sinks' store before each write and again
    before it observes what it stored, and by the runner before each tick, it reads only when
    the ownership changed (once for a standalone worker), and returns only once the checkpoints
    of the current assignment are loaded (an assignment during the read reads again). A
    rebalance (`ownership.generation`) drops the jobs this worker lost and loads the checkpoints
    of those it gained; jobs it kept keep their live state (module docstring, "Restart";
    streams/ownership.py, "Handover")."""
    own = ownership or Ownership()
    while not (windows.restored and windows.owner_generation == own.generation):
        generation = own.generation
        rows = await db.aquery_columns(STATE_SQL)
        if own.generation != generation:  # reassigned while this one read: read again
            continue
        if windows.restored and windows.owner_generation == generation:
            return  # another caller restored them while this one read
        for job in [j for j in windows.jobs if not own.owns(j)]:
            windows.forget(job)
        held = set(windows.jobs)
        windows.restore([Checkpoint(str(j), str(k), int(s), int(m)) for j, k, s, m in zip(
            rows["job_id"], rows["kind"], rows["next_start"], rows["max_ns"], strict=True)
            if str(j) not in held and own.owns(str(j))])
        windows.owner_generation = generation


@dataclass
class RunnerStats:
    windows: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    late_recomputed: int = 0
    previews: int = 0
    #: Preview ticks whose frame started at the ranks' last known step ends (`frame_start`).
    prior_frames: int = 0
    #: Ticks whose preview was skipped because the job's event time ran ahead (`replaying`).
    previews_skipped: int = 0
    #: Iteration windows computed from a frame reaching back `frame_reach` (short) /
    #: max_step_ns.
    short_frames: int = 0
    full_frames: int = 0
    errors: int = 0
    last_error: str = ""


def _last_steps(known: Bounds | None, rows: dict[str, np.ndarray]) -> Bounds:
    """Each rank's last step, from the bounds known and iteration rows (a row of the same step
    replaces the known one: a recomputed window's rows are newer)."""
    rank = rows["rank"].astype(np.int64)
    step = rows["step"].astype(np.int64)
    end = rows["t_end"].astype(np.int64)
    if known is not None:
        rank, step, end = (np.r_[k, r] for k, r in zip(known, (rank, step, end), strict=True))
    if not len(rank):
        return rank, step, end
    order = np.lexsort((np.arange(len(rank)), step, rank))  # by rank, step, then newest last
    rank, step, end = rank[order], step[order], end[order]
    last = np.r_[rank[1:] != rank[:-1], True]
    return rank[last], step[last], end[last]


#: (wall clock, largest event time) of a job at its recent previews, oldest first
PaceSamples = Sequence[tuple[int, int]]


def pace_samples(seen: PaceSamples, now: int, newest: int, span_ns: int
                 ) -> list[tuple[int, int]]:
    """`seen` with (`now`, `newest`) appended, less the samples older than needed to measure the
    pace over the last `span_ns`: the oldest one kept is the newest at least `span_ns` old (two
    samples are always kept), so the samples are bounded by the span, not the job's age."""
    kept = [*seen, (now, newest)]
    first = 0
    while len(kept) - first > 2 and now - kept[first + 1][0] >= span_ns:
        first += 1
    return kept[first:]


def replaying(seen: PaceSamples, *, span_ns: int, max_pace: float) -> bool:
    """Whether a job's largest event time advanced more than `max_pace` times faster than the
    wall clock over the samples `seen` (`pace_samples`, the last one now), once they cover at
    least half of `span_ns` (before that a job counts as live).

    A preview publishes a step's row before its window closes, which for a live job is up to a
    window (10 s) earlier. When a worker catches up on a backlog, or a job is replayed, windows
    close at the pace records are read and a preview is published a tick or two before the
    window's own rows, from a frame the close reads again (in a replay, half of the iteration
    frames read: docs/architecture.md, "Iteration previews")."""
    (wall0, event0), (now, newest) = seen[0], seen[-1]
    if now - wall0 < span_ns // 2:
        return False
    return newest - event0 > max_pace * (now - wall0)


def frame_reach(recent_step: int | None, max_step_ns: int) -> int:
    """How far before a window its frame of records starts: twice the longest step of the job's
    last window (`recent_step`) plus a second, at most `max_step_ns` (unknown: `max_step_ns`)."""
    if recent_step is None:
        return max_step_ns
    return min(max_step_ns, 2 * recent_step + SEC)


@dataclass
class Preview:
    """How far the open iterations window of a job has been previewed."""

    window: int  #: the window's start (ns)
    cut: int  #: steps ending before this (ns) were looked for
    seen: set[int]  #: (rank << 32 | step) of the rows already published


def preview_range(done: Preview | None, ws: int, max_ns: int, window_ns: int
                  ) -> tuple[int, int, set[int]]:
    """(from, cut, rows published) of the next preview of the open iterations window `ws`: steps
    ending in [from, cut) are new; the cut is the job's largest event time (`max_ns`) + 1, at most
    the window's end. A preview of an earlier window counts for nothing. Nothing to do when
    cut <= from."""
    cut = min(max_ns + 1, ws + window_ns)
    if done is None or done.window != ws:
        return ws, cut, set()
    return done.cut, cut, done.seen


def frame_start(done: int, reach_ns: int, prior: Bounds | None) -> tuple[int, Bounds | None]:
    """Where a preview's frame of records starts, and the step bounds it starts from: `reach_ns`
    before `done`, or later, at the ranks' earliest known step end when `prior` (each rank's last
    known step) has one past that — every rank's next step starts after its known end. The
    bounds are None when the frame does not start at them."""
    lo = done - reach_ns
    if prior is not None and len(prior[0]) and int(prior[2].min()) > lo:
        return int(prior[2].min()), prior
    return lo, None


def encoded_parts(kind: str, job: str, ws: int, cols: dict[str, np.ndarray], *, rows: int,
                  max_bytes: int) -> Iterator[bytes]:
    """rw.<kind> messages of `cols`, in row order: at most `rows` rows and `max_bytes` encoded
    each (a part over the size is halved until it fits: wide rows, e.g. long kernel names); a
    single row over the size goes alone."""
    n = len(cols["rank"])
    todo = [(lo, min(n, lo + rows)) for lo in range(0, n, rows)]
    while todo:
        lo, hi = todo.pop(0)
        part = {k: v[lo:hi] for k, v in cols.items()}
        data = encode_batch(kind, job, part, producer="rankwatch/streams", seq=ws // SEC,
                            validate=False)
        if len(data) > max_bytes and hi - lo > 1:
            mid = (lo + hi) // 2
            todo[:0] = [(lo, mid), (mid, hi)]
            continue
        yield data


@dataclass
class DerivedJob:
    """What the runner keeps of one job between ticks; dropped whole with the job."""

    #: waits between tries of the job while its windows fail (tick_s doubling to max_retry_s)
    backoff: Backoff
    #: how far the open iterations window has been previewed
    preview: Preview | None = None
    #: (wall clock, largest event time) at recent previews, oldest first (`pace_samples`)
    pace: list[tuple[int, int]] = field(default_factory=list)
    #: from the job's first closed iterations window on: each rank's last step known (rank
    #: ascending, step, end ns) — where previews' frames start (`frame_start`)
    bounds: Bounds | None = None
    #: the longest step of the job's last iterations window (ns): how far frames reach
    recent_step: int | None = None
    #: the job's declared communicators (ids, kind codes), once its topology arrived
    topology: tuple[list[str], list[int]] | None = None
    #: ranks with a row from stage records so far (sorted): never previewed from a collective
    staged: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: after failed ticks: monotonic time of the next try
    retry_at: float = 0.0


class DerivedRunner:
    """See the module docstring. `publish` sends one encoded batch to rw.<kind> keyed by job."""

    def __init__(self, db: Database, publish: Publish, cfg: DerivedConfig | None = None, *,
                 clock: Callable[[], int] = time.time_ns,
                 ownership: Ownership | None = None) -> None:
        cfg = cfg or DerivedConfig()
        self.db, self.publish, self.cfg, self.clock = db, publish, cfg, clock
        #: Which jobs this worker closes windows of (streams/ownership.py); all standalone.
        self.ownership = ownership or Ownership()
        self.windows = Windows([
            WindowSpec("progress", cfg.progress.window_ns, inputs=("ops",), reads=("beats",)),
            WindowSpec("iterations", cfg.iteration_window_ns, reach_ns=cfg.max_step_ns,
                       late_marks=True, inputs=("ops", "stages")),
            WindowSpec("kernel_summaries", cfg.kernels.window_ns, inputs=("kernels",)),
        ], cfg.lateness_ns, cfg.watermark, clock=clock)
        #: job id -> what the runner keeps of it between ticks
        self.jobs: dict[str, DerivedJob] = {}
        self.progress = ProgressFeed(db, cfg.progress)
        self.kernels = KernelSummarizer(db, cfg.kernels)
        self.stats = RunnerStats()
        self._lock = asyncio.Lock()

    def job_state(self, job: str) -> DerivedJob:
        """The runner's state of `job`, new when it has none."""
        got = self.jobs.get(job)
        if got is None:
            got = self.jobs[job] = DerivedJob(
                backoff=Backoff(self.cfg.tick_s, self.cfg.max_retry_s))
        return got

    async def restore(self) -> None:
        """Resume from the stored checkpoints of the jobs owned (again after each rebalance;
        otherwise later calls, and the first tick, find them loaded)."""
        await restore_windows(self.db, self.windows, self.ownership)
        held = self.windows.jobs
        for per_job in (self.jobs, self.kernels.buffer.jobs):
            for job in [j for j in per_job if j not in held]:
                del per_job[job]

    async def tick(self) -> int:
        """Close every due window of every job; returns the windows closed."""
        if self._lock.locked():
            return 0
        async with self._lock:
            await self.restore()
            done = 0
            now = time.monotonic()
            for job in list(self.windows.jobs):
                state = self.job_state(job)
                if now < state.retry_at:
                    continue
                try:
                    done += await self._job(job)
                    state.retry_at = 0.0
                    state.backoff.reset()
                except Exception as e:  # a failing job must not stall the others
                    log.debug("derived failure", exc_info=True)
                    self.stats.errors += 1
                    self.stats.last_error = f"{job}: {type(e).__name__}: {e}"
                    # a lasting failure must not recompute the job's windows on every tick
                    wait = state.backoff.next()
                    state.retry_at = time.monotonic() + wait
                    log.warning("derived windows of %s failed (%s); retrying in %.2g s",
                                job, self.stats.last_error, wait)
            return done

    async def _job(self, job: str) -> int:
        w, limit, done = self.windows, self.cfg.max_windows_per_tick, 0
        state = self.job_state(job)
        for ws in w.due(job, "progress", limit):
            await self._emit("progress", job, ws, await self.progress.compute(job, ws))
            w.closed(job, "progress", ws)
            done += 1
        recomputed = 0
        for ws in w.late(job, "iterations", limit):
            rows = await self._iterations(job, ws)
            await self._emit("iterations", job, ws, rows, token_suffix=f":late:{self.clock()}")
            if state.bounds is not None:
                state.bounds = _last_steps(state.bounds, rows)
            w.recomputed(job, "iterations", ws)
            self.stats.late_recomputed += 1
            recomputed += 1
        for ws in w.due(job, "iterations", limit):
            rows = await self._window_iterations(job, ws)
            await self._emit("iterations", job, ws, rows)
            state.bounds = _last_steps(state.bounds, rows)
            w.closed(job, "iterations", ws)
            done += 1
        if self.cfg.preview_iterations and w.fed(job, "iterations"):
            await self._preview(job)
        for ws in w.due(job, "kernel_summaries", 2):
            rows, window = await self.kernels.compute(job, ws)
            await self._emit("kernel_summaries", job, ws, rows)
            if window:
                await self._insert("kernel_windows", job, window, f"kw:{job}:{ws}")
            w.closed(job, "kernel_summaries", ws)
            done += 1
        if w.moved(job) or done or recomputed or w.late(job, "iterations", 1):
            await self._checkpoint(job)
        return done

    async def _preview(self, job: str) -> None:
        """Publish the open iterations window's steps that are complete (module docstring);
        nothing while the job is replayed faster than real time (`replaying`)."""
        state, cfg = self.job_state(job), self.cfg
        newest = self.windows.jobs[job].max_ns
        state.pace = pace_samples(state.pace, self.clock(), newest, cfg.pace_span_ns)
        if replaying(state.pace, span_ns=cfg.pace_span_ns, max_pace=cfg.preview_max_pace):
            self.stats.previews_skipped += 1
            return
        ws, _ = self.windows.open_window(job, "iterations")
        done, cut, seen = preview_range(state.preview, ws, newest, cfg.iteration_window_ns)
        if cut <= done:
            return
        lo, prior = frame_start(done, min(cfg.preview_reach_ns,
                                          frame_reach(state.recent_step, cfg.max_step_ns)),
                                state.bounds)
        if prior is not None:
            self.stats.prior_frames += 1
        if not await self._steps_end(job, lo, done, cut):
            state.preview = Preview(ws, cut, seen)  # no step can end in [done, cut)
            return
        cols = await self._iterations(job, ws, lo=lo, we=cut, preview=True, prior=prior)
        if state.bounds is not None:
            state.bounds = _last_steps(state.bounds, cols)
        keys = (cols["rank"].astype(np.int64) << 32) | cols["step"].astype(np.int64)
        new = ~np.isin(keys, np.fromiter(seen, np.int64, len(seen)))
        seen.update(keys[new].tolist())
        state.preview = Preview(ws, cut, seen)
        if new.any():
            await self._publish("iterations", job, ws, {k: v[new] for k, v in cols.items()})
            self.stats.previews += 1

    async def _steps_end(self, job: str, lo: int, t0: int, t1: int) -> bool:
        """Whether a stored record can end a step in [t0, t1): a DP gradient collective or a
        stage record (starting at or after `lo`). A count over a few columns, so a preview tick
        with nothing new does not read and recompute its whole frame (most ticks: a step has
        one gradient collective per rank, ticks come every 0.25 s). Communicators are
        classified as in `OPS_SQL`: the job's topology, else the name's prefix."""
        ids, codes = await self._comm_kinds(job)
        got = await self.db.aquery_columns(STEP_ENDS_SQL, {
            "job": job, "lo": lo, "t0": t0, "t1": t1, "ids": ids, "codes": codes})
        return bool(int(got["ops"][0]) or int(got["stages"][0]))

    async def _window_iterations(self, job: str, ws: int) -> dict[str, np.ndarray]:
        """The rows of iterations window `ws`, as from a frame reaching `max_step_ns` back, but
        read from a short frame (`frame_reach`) when that yields the same rows: every row's start is
        exact in it (no rank's first step is estimated: the rank's previous step boundary is in
        the frame, so are all ops of its steps), and no op or stage record that starts before
        the frame ends in the window (`REACH_SQL`, a count on two columns). Otherwise the full
        frame is read. A 1,024-rank job's 10 s window with 1.7 s steps reads ~14 s of records
        instead of 70 s. (One case is not checked: with several gradient buckets per step, a
        bucket that starts before the frame and ends after the frame's last bucket of the
        previous step but before the window would move that step's end.)"""
        state = self.job_state(job)
        reach = frame_reach(state.recent_step, self.cfg.max_step_ns)
        rows: dict[str, np.ndarray] | None = None
        if reach < self.cfg.max_step_ns:
            report: dict[str, int] = {}
            rows = await self._iterations(job, ws, lo=ws - reach, report=report)
            if report["estimated"]:
                rows = None
            else:
                far = await self.db.aquery_columns(REACH_SQL, {
                    "job": job, "far": ws - self.cfg.max_step_ns, "lo": ws - reach, "ws": ws})
                if int(far["ops"][0]) or int(far["stages"][0]):
                    rows = None
        if rows is None:
            rows = await self._iterations(job, ws)
            self.stats.full_frames += 1
        else:
            self.stats.short_frames += 1
        if len(rows["step_ns"]):
            state.recent_step = int(rows["step_ns"].max())
        return rows

    async def _iterations(self, job: str, ws: int, *, lo: int | None = None,
                          we: int | None = None, preview: bool = False,
                          report: dict[str, int] | None = None, prior: Bounds | None = None
                          ) -> dict[str, np.ndarray]:
        """Rows of steps ending in [ws, we) (default: the window's end), from a frame of
        records starting at `lo` (default: `max_step_ns` before the window)."""
        we = ws + self.cfg.iteration_window_ns if we is None else we
        lo = ws - self.cfg.max_step_ns if lo is None else lo
        ids, codes = await self._comm_kinds(job)
        frame = {"job": job, "lo": lo, "we": we}
        stages = await self.db.aquery_columns(STAGES_SQL, frame)
        stages["t_start"] = stages.pop("start_ns")  # (an alias named t_start would shadow it)
        # comm_id arrives dictionary-coded (LowCardinality): its codes key the in-flight rule
        res = await self.db.aquery_coded(OPS_SQL, {**frame, "ids": ids, "codes": codes})
        comm = res.pop("comm_id")
        ops = {k: np.asarray(v) for k, v in res.items()}
        stale = superseded(ops["rank"], comm.codes if isinstance(comm, Coded) else comm,
                           ops["op_seq"], ops["end_ns"])
        if stale.any():  # stored in flight, completed since (ingest.inflight)
            ops = {k: v[~stale] for k, v in ops.items()}
        grad = (ops["kind"] == KIND_CODES["dp"]) & (ops["grad_op"] > 0)
        of = OpFrame(ops["rank"], ops["kind"], grad, ops["op_seq"], ops["step"], ops["bytes"],
                     ops["start_ns"], ops["end_ns"])
        state = self.job_state(job)
        rows = await asyncio.to_thread(
            iteration_rows, stages, of, ws, we, max_step_ns=self.cfg.max_step_ns,
            grad_collectives_per_step=self.cfg.grad_collectives_per_step, preview=preview,
            report=report, prior=prior, staged=state.staged if preview else None)
        if len(stages["rank"]):
            state.staged = np.union1d(state.staged, stages["rank"].astype(np.int64))
        return rows

    async def _comm_kinds(self, job: str) -> tuple[list[str], list[int]]:
        state = self.job_state(job)
        got = state.topology
        if got is None:
            res = await self.db.aquery(TOPOLOGY_SQL, {"job": job})
            ids: list[str] = []
            codes: list[int] = []
            for comm_ids, kinds in res.result_rows:
                ids, codes = declared_codes(zip(comm_ids, kinds, strict=False))
            got = (ids, codes)
            if ids:  # cache only once the topology arrived
                state.topology = got
        return got

    async def _emit(self, kind: str, job: str, ws: int, cols: dict[str, np.ndarray],
                    token_suffix: str = "") -> None:
        if not cols or not len(cols["rank"]):
            return
        await self._insert(kind, job, cols, f"{kind}:{job}:{ws}{token_suffix}")
        await self._publish(kind, job, ws, cols)
        self.stats.windows[kind] = self.stats.windows.get(kind, 0) + 1
        self.stats.rows[kind] = self.stats.rows.get(kind, 0) + len(cols["rank"])

    async def _publish(self, kind: str, job: str, ws: int, cols: dict[str, np.ndarray]) -> None:
        """rw.<kind> messages of at most `publish_rows` rows and `publish_max_bytes` encoded
        (`encoded_parts`)."""
        for data in encoded_parts(kind, job, ws, cols, rows=self.cfg.publish_rows,
                                  max_bytes=self.cfg.publish_max_bytes):
            await self.publish(kind, job, data)

    async def _insert(self, table: str, job: str, cols: dict[str, np.ndarray], token: str) -> None:
        n = len(next(iter(cols.values())))
        job_col = np.empty(n, dtype=object)
        job_col[:] = job
        await self.db.ainsert(table, {"job_id": job_col, **cols}, insert_settings(token))

    async def _checkpoint(self, job: str) -> None:
        cols = checkpoint_columns(self.windows.checkpoint(job), self.clock())
        await self.db.ainsert("stream_state", cols, insert_settings(None))
