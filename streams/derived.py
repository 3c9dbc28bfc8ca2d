"""The derived runner: closes event-time windows of every job and writes progress, iterations and
kernel summaries, computed from the durable raw tables (docs/architecture.md, "Derived streams").

Flow per tick (a Faust timer, every `tick_s`):
1. The raw sinks' store (`ObservingStore`) reports the event-time range of every batch *after*
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
   last known step ends (`_bounds`, docs/architecture.md "Iteration previews").

Restart: the checkpoint says which windows are closed; every raw row is durable before it is
observed, so the windows after the checkpoint are computed from complete raw data. The checkpoints
are loaded (`restore_windows`, once) before the first batch is observed — by whichever comes
first, a raw sink's write or the runner's first tick: Faust starts the agents and the timers
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
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ingest.batch import TIME_COLUMN, Coded, RecordBatch, encode_batch
from ingest.inflight import superseded
from ingest.records import comm_kind_code_sql, declared_codes
from ingest.units import SECOND as SEC
from streams.db import Database
from streams.iterations import KIND_CODES, Bounds, OpFrame, iteration_rows
from streams.kernel_summaries import KernelBuffer, KernelParams, KernelSummarizer
from streams.ownership import Ownership
from streams.progress import ProgressFeed, ProgressParams
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
    """The raw sinks' store; reports each stored batch's event-time range, producer and kind to
    `windows`, and hands stored kernel batches to `kernels` (the runner's `kernels.buffer`:
    summaries from memory, streams/kernel_summaries.py). A batch that marks closed windows late,
    or opens a job's windows or moves their start back, has the job's checkpoint stored before
    `write` returns, i.e. before the raw sink acks the batch. The stored checkpoints are loaded
    into `windows` before the first batch is observed (`restore_windows`)."""

    def __init__(self, writer: ClickHouseWriter, windows: Windows,
                 kernels: KernelBuffer | None = None, *,
                 ownership: Ownership | None = None) -> None:
        super().__init__(writer)
        self.windows, self.kernels = windows, kernels
        self.ownership = ownership or Ownership()

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]]) -> int:
        # a failure here fails the write (nothing stored yet): the raw sink retries it
        await restore_windows(self.writer.db, self.windows, self.ownership)
        n = await super().write(kind, batches, token, sources=sources)
        changed: set[str] = set()
        try:  # the rows are stored: a bookkeeping bug must not fail (and stop) the raw sink
            column = TIME_COLUMN[kind]
            for b in batches:
                if not self.ownership.owns(b.job_id):  # stored; its owner closes its windows
                    continue
                t = b.cols[column]
                known = t[t > 0]
                if not len(known):
                    continue
                hi = int(known.max())
                if "t_end" in b.cols and len(b.cols["t_end"]):  # a completion is an event too
                    hi = max(hi, int(np.asarray(b.cols["t_end"]).max()))
                if self.windows.observe(b.job_id, int(known.min()), hi, source=b.producer,
                                        kind=kind):
                    changed.add(b.job_id)
                if kind == "kernels" and self.kernels is not None:
                    self.kernels.close(b.job_id, self.windows.open_window(
                        b.job_id, "kernel_summaries")[0])
                    self.kernels.add(b)
        except Exception:
            log.exception("derived windows: observing a %s write failed", kind)
        for job in sorted(changed):  # a failure here fails the write: the batch comes again
            rows = self.windows.checkpoint(job)  # stamped by the runner's clock, as its own are
            await self.writer.db.ainsert("stream_state",
                                         checkpoint_columns(rows, self.windows.clock()),
                                         insert_settings(None))
        return n


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
    of them is observed or closed: called by the raw sinks' store before each write and by the
    runner before each tick, it reads only when the ownership changed (once for a standalone
    worker). A rebalance (`ownership.generation`) drops the jobs this worker lost and loads the
    checkpoints of those it gained; jobs it kept keep their live state (module docstring,
    "Restart"; streams/ownership.py, "Handover")."""
    own = ownership or Ownership()
    generation = own.generation
    if windows.restored and windows.owner_generation == generation:
        return
    rows = await db.aquery_columns(STATE_SQL)
    if windows.restored and windows.owner_generation == generation:
        return  # another caller restored them while this one read
    if own.generation != generation:  # reassigned while this one read: the next call loads
        return
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
    #: Preview ticks whose frame started at the ranks' last known step ends (`_bounds`).
    prior_frames: int = 0
    #: Ticks whose preview was skipped because the job's event time ran ahead (`_replaying`).
    previews_skipped: int = 0
    #: Iteration windows computed from a frame reaching back `_reach` (short) / max_step_ns.
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
        #: per job: (open iterations window, preview cut, (rank << 32 | step) already previewed)
        self._previews: dict[str, tuple[int, int, set[int]]] = {}
        #: per job: (wall clock, largest event time) at recent previews, oldest first
        self._pace: dict[str, deque[tuple[int, int]]] = {}
        #: per job, from its first closed iterations window on: each rank's last step known
        #: (rank ascending, step, end ns) — where previews' frames start (`_preview`)
        self._bounds: dict[str, Bounds] = {}
        #: job -> the longest step of its last iterations window (ns): how far frames reach
        self._recent_step: dict[str, int] = {}
        self.progress = ProgressFeed(db, cfg.progress)
        self.kernels = KernelSummarizer(db, cfg.kernels)
        self.stats = RunnerStats()
        self._topology: dict[str, tuple[list[str], list[int]]] = {}
        self._lock = asyncio.Lock()
        #: job -> (monotonic time of its next try, the wait that set it) after failed ticks
        self._backoff: dict[str, tuple[float, float]] = {}

    async def restore(self) -> None:
        """Resume from the stored checkpoints of the jobs owned (again after each rebalance;
        otherwise later calls, and the first tick, find them loaded)."""
        await restore_windows(self.db, self.windows, self.ownership)
        held = self.windows.jobs
        for per_job in (self._previews, self._pace, self._bounds, self._recent_step,
                        self._backoff, self.kernels.buffer.jobs):
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
                retry_at, wait = self._backoff.get(job, (0.0, 0.0))
                if now < retry_at:
                    continue
                try:
                    done += await self._job(job)
                    self._backoff.pop(job, None)
                except Exception as e:  # a failing job must not stall the others
                    log.debug("derived failure", exc_info=True)
                    self.stats.errors += 1
                    self.stats.last_error = f"{job}: {type(e).__name__}: {e}"
                    # a lasting failure must not recompute the job's windows on every tick
                    wait = min(self.cfg.max_retry_s, max(self.cfg.tick_s, 2 * wait))
                    self._backoff[job] = (time.monotonic() + wait, wait)
                    log.warning("derived windows of %s failed (%s); retrying in %.2g s",
                                job, self.stats.last_error, wait)
            return done

    async def _job(self, job: str) -> int:
        w, limit, done = self.windows, self.cfg.max_windows_per_tick, 0
        for ws in w.due(job, "progress", limit):
            await self._emit("progress", job, ws, await self.progress.compute(job, ws))
            w.closed(job, "progress", ws)
            done += 1
        recomputed = 0
        for ws in w.late(job, "iterations", limit):
            rows = await self._iterations(job, ws)
            await self._emit("iterations", job, ws, rows, token_suffix=f":late:{self.clock()}")
            if job in self._bounds:
                self._bounds[job] = _last_steps(self._bounds[job], rows)
            w.recomputed(job, "iterations", ws)
            self.stats.late_recomputed += 1
            recomputed += 1
        for ws in w.due(job, "iterations", limit):
            rows = await self._window_iterations(job, ws)
            await self._emit("iterations", job, ws, rows)
            self._bounds[job] = _last_steps(self._bounds.get(job), rows)
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
        if done or recomputed or w.late(job, "iterations", 1):
            await self._checkpoint(job)
        return done

    async def _preview(self, job: str) -> None:
        """Publish the open iterations window's steps that are complete (module docstring);
        nothing while the job is replayed faster than real time (`_replaying`)."""
        if self._replaying(job):
            self.stats.previews_skipped += 1
            return
        ws, _ = self.windows.open_window(job, "iterations")
        cut = min(self.windows.jobs[job].max_ns + 1, ws + self.cfg.iteration_window_ns)
        start, done, seen = self._previews.get(job, (ws, ws, set()))
        if start != ws:
            done, seen = ws, set()
        if cut <= done:
            return
        lo = done - min(self.cfg.preview_reach_ns, self._reach(job))
        prior = self._bounds.get(job)
        if prior is not None and len(prior[0]) and int(prior[2].min()) > lo:
            lo = int(prior[2].min())  # every rank's next step starts after its known end
            self.stats.prior_frames += 1
        else:
            prior = None
        if not await self._steps_end(job, lo, done, cut):
            self._previews[job] = (ws, cut, seen)  # no step can end in [done, cut)
            return
        cols = await self._iterations(job, ws, lo=lo, we=cut, preview=True, prior=prior)
        if job in self._bounds:
            self._bounds[job] = _last_steps(self._bounds[job], cols)
        keys = (cols["rank"].astype(np.int64) << 32) | cols["step"].astype(np.int64)
        new = ~np.isin(keys, np.fromiter(seen, np.int64, len(seen)))
        seen.update(keys[new].tolist())
        self._previews[job] = (ws, cut, seen)
        if new.any():
            await self._publish("iterations", job, ws, {k: v[new] for k, v in cols.items()})
            self.stats.previews += 1

    def _replaying(self, job: str) -> bool:
        """Whether the job's largest event time advanced more than `preview_max_pace` times
        faster than the wall clock over the last `pace_span_ns` (at least half of it observed).

        A preview publishes a step's row before its window closes, which for a live job is up
        to a window (10 s) earlier. When a worker catches up on a backlog, or a job is replayed,
        windows close at the pace records are read and a preview is published a tick or two
        before the window's own rows, from a frame the close reads again: on `rankwatch bench
        streams --only ops` (a replay at ~5x real time) half of the iteration frames read were
        such previews."""
        now, newest = self.clock(), self.windows.jobs[job].max_ns
        seen = self._pace.setdefault(job, deque())
        seen.append((now, newest))
        while len(seen) > 2 and now - seen[1][0] >= self.cfg.pace_span_ns:
            seen.popleft()
        wall0, event0 = seen[0]
        if now - wall0 < self.cfg.pace_span_ns // 2:
            return False
        return newest - event0 > self.cfg.preview_max_pace * (now - wall0)

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

    def _reach(self, job: str) -> int:
        """How far before a window its frame of records starts: twice the longest step of the
        job's last window plus a second, at most `max_step_ns` (unknown: `max_step_ns`)."""
        recent = self._recent_step.get(job)
        if recent is None:
            return self.cfg.max_step_ns
        return min(self.cfg.max_step_ns, 2 * recent + SEC)

    async def _window_iterations(self, job: str, ws: int) -> dict[str, np.ndarray]:
        """The rows of iterations window `ws`, as from a frame reaching `max_step_ns` back, but
        read from a short frame (`_reach`) when that yields the same rows: every row's start is
        exact in it (no rank's first step is estimated: the rank's previous step boundary is in
        the frame, so are all ops of its steps), and no op or stage record that starts before
        the frame ends in the window (`REACH_SQL`, a count on two columns). Otherwise the full
        frame is read. A 1,024-rank job's 10 s window with 1.7 s steps reads ~14 s of records
        instead of 70 s. (One case is not checked: with several gradient buckets per step, a
        bucket that starts before the frame and ends after the frame's last bucket of the
        previous step but before the window would move that step's end.)"""
        reach = self._reach(job)
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
            self._recent_step[job] = int(rows["step_ns"].max())
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
        return await asyncio.to_thread(
            iteration_rows, stages, of, ws, we, max_step_ns=self.cfg.max_step_ns,
            grad_collectives_per_step=self.cfg.grad_collectives_per_step, preview=preview,
            report=report, prior=prior)

    async def _comm_kinds(self, job: str) -> tuple[list[str], list[int]]:
        got = self._topology.get(job)
        if got is None:
            res = await self.db.aquery(TOPOLOGY_SQL, {"job": job})
            ids: list[str] = []
            codes: list[int] = []
            for comm_ids, kinds in res.result_rows:
                ids, codes = declared_codes(zip(comm_ids, kinds, strict=False))
            got = (ids, codes)
            if ids:  # cache only once the topology arrived
                self._topology[job] = got
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
        """rw.<kind> messages of at most `publish_rows` rows and `publish_max_bytes` encoded (a
        part over the size is halved until it fits: wide rows, e.g. long kernel names)."""
        step = self.cfg.publish_rows
        n = len(cols["rank"])
        todo = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
        while todo:
            lo, hi = todo.pop(0)
            part = {k: v[lo:hi] for k, v in cols.items()}
            data = encode_batch(kind, job, part, producer="rankwatch/streams", seq=ws // SEC,
                                validate=False)
            if len(data) > self.cfg.publish_max_bytes and hi - lo > 1:
                mid = (lo + hi) // 2
                todo[:0] = [(lo, mid), (mid, hi)]
                continue
            await self.publish(kind, job, data)

    async def _insert(self, table: str, job: str, cols: dict[str, np.ndarray], token: str) -> None:
        n = len(next(iter(cols.values())))
        job_col = np.empty(n, dtype=object)
        job_col[:] = job
        await self.db.ainsert(table, {"job_id": job_col, **cols}, insert_settings(token))

    async def _checkpoint(self, job: str) -> None:
        cols = checkpoint_columns(self.windows.checkpoint(job), self.clock())
        await self.db.ainsert("stream_state", cols, insert_settings(None))
