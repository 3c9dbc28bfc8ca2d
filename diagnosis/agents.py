"""The diagnosis agents: the I/O shell around the pure trigger and root-cause code.

Attached to the worker's Faust app (`attach`, called by rankwatch/commands/worker.py):

- trigger agent on `rw.progress` and `rw.iterations` (the derived feeds, streams/derived.py):
  one `JobWatch` per job over its sampled ranks (≤ 10). Progress rows become the trigger
  modules' inputs (`progress_as_ops`): a window in which a (rank, comm) completed calls is
  progress at its end; calls in flight are in flight since `window_end − oldest_inflight_age`;
  `last_beat_ts` is a beat. Iteration rows are the step series. The trigger clock is the job's
  event-time watermark (newest progress `window_end`): the feed closes a window every second
  for every (rank, comm) — a stopped rank still gets rows while its host beats — so silence is
  measured in event time and a lagging feed cannot look like a hang. The price is the feed's
  watermark lag (streams/windows.py: learned per-source lateness). Step rows arrive three
  times: from the stage records themselves as the raw sink stores them (`on_stored`, like the
  beats), as the derived runner's previews at its next tick, and with their window
  (streams/derived.py); JobWatch counts each step once (its time: the largest seen). The
  stored records reach the step-time trigger first: the previews wait for the runner's tick
  (every 0.25 s, longer when it is busy), a publish and this agent's read. The same stored
  batches (and the stored calls) tell the analyst how far each rank's records are stored
  (`Analyst.stored`), and a stored stage batch of a job with a pending performance trigger
  has that trigger tried at once (`_on_evidence`): on the real catalog a slowdown is named
  0-4 steps after its evidence is complete (`rankwatch eval --real --rescore RUN --workdir
  DIR --evidence`), where the quarter-second tick and the progress feed's clock left 3-7. The feed
  agents wait at most `FEED_WITHIN_S` to fill a buffer. Triggers go to `rw.triggers`
  (`TriggerRecord` JSON, keyed by job).
  A job's watch needs its topology (the `jobs` table). Its feed and beats batches that come
  first wait for it, in order, and are read as soon as it is stored (`_ready_watch`; the
  timer looks for it too, `_release_waiting`, for when no later batch comes); a worker reads
  its topics in no particular order, and a replay or a backlog can close a job's first
  progress windows before its `jobs` record is stored — dropped, they took with them the
  only progress a stalled rank made, and a timer never started cannot run out (a replayed
  data stall went undiagnosed this way). At most `WAITING_BATCHES` per job, `WAITING_JOBS`
  jobs and `WAITING_BYTES` of columns wait; beyond that the oldest are dropped and counted
  (`waiting_dropped`).
  The progress rows also go to JobWatch as they are: Mycroft's throughput/interval straggler
  test runs on them per sampled (rank, comm) over spans of several steps
  (diagnosis/triggers/mycroft_progress.py) — the per-op test needs ≥ 3 completions per rank
  and window, which one progress row per window does not give.
- root-cause agent on `rw.triggers`: `Analyst` (diagnosis/analyst.py) reads the job's window
  from ClickHouse (`read_window`: all ranks, raw tables) up to the wall clock capped at the
  job's progress watermark plus the feed's largest lateness (`_event_time`) — a slowdown
  analysis up to where every rank's stage records and calls are stored, if later
  (`Analyst._slow_clock`) — and runs the engine in a worker thread;
  every published version goes to `rw.diagnoses` (keyed by job) and the `diagnoses` table
  (sql/003_diagnoses.sql). A timer (every `tick_s`, a quarter second) re-checks open
  incidents, tries pending triggers again and sweeps jobs (`Analyst.tick`: each of those
  keeps its own pace; most ticks do nothing).
- ownership (streams/ownership.py): with several workers each runs the agents of the jobs it
  owns (the derived and trigger topics are keyed by job, so a job's messages reach its owner).
  After every assignment (`Ownership.generation`) the agents drop the watches, topologies and
  incidents of jobs they lost and load from the `diagnoses` table the open incidents of the jobs
  they own and did not hold (on start: all of them), before anything more is decided — each
  trigger, tick and pending retry checks under the analyst's lock that the incidents held are
  the current assignment's (`_current`), since a rebalance can land mid-batch: a
  trigger the old owner had not committed is absorbed by the incident it opened, and re-checks
  continue the same incident (its next version) instead of announcing a new one. A version is
  stored before it is announced, and a worker that takes an incident over announces its newest
  version again (the same `id`: rw.diagnoses consumers deduplicate by it), so a version stored
  by a worker killed before announcing it is not lost. Messages of a job owned elsewhere (read
  during a rebalance) are skipped; the analyst sweeps owned jobs only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, TypeVar, cast

import faust
import numpy as np
import orjson
from faust.streams import Stream
from faust.types import StreamT

from diagnosis.analyst import Analyst, AnalystConfig, newest_per_rank
from diagnosis.columns import Columns, coded_column, ints
from diagnosis.model import Diagnosis, TriggerRecord
from diagnosis.stage_rows import StageRows
from diagnosis.triggers.base import Trigger
from diagnosis.triggers.watch import JobWatch, steps_from_stages
from diagnosis.window import (
    Window,
    latest_op_rows,
    with_delivered_sends,
    without_superseded_in_flight,
)
from ingest.batch import BatchError, Coded, RecordBatch, decode_batch
from ingest.records import JobTopology
from ingest.topics import Topics
from ingest.units import SECOND
from streams.db import ClickHouseError, Database
from streams.ownership import Ownership
from streams.timers import every
from streams.windows import WatermarkParams

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: raw kind -> (time column, columns read for root cause)
WINDOW_COLUMNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ops": ("t_start", ("rank", "comm_id", "op_seq", "op", "bytes", "peer", "t_enqueue", "t_start",
                        "t_end", "step")),
    "flows": ("t_start", ("rank", "comm_id", "op_seq", "channel", "peer", "nic", "bytes",
                          "t_start", "t_end")),
    "chunks": ("ts", ("rank", "comm_id", "op_seq", "channel", "ts", "total_chunks", "gpu_ready",
                      "rdma_transmitted", "rdma_done")),
    "stages": ("t_start", ("rank", "step", "t_start", "data_next_wait", "model_fwd_loss",
                           "model_backward", "callbacks", "optim_step", "step_other",
                           "sched_wait_ns", "cpu_pressure_ns")),
    "kernels": ("t_start", ("rank", "kernel", "t_start", "duration")),
    "beats": ("ts", ("rank", "ts", "comm_id", "last_op_seq", "step", "stage", "stage_ts",
                     "sched_run_ns", "sched_wait_ns", "exited", "exit_status")),
    "kernel_summaries": ("window_start", ("rank", "stream", "kernel", "cluster", "count",
                                          "p50_ns", "p99_ns", "window_start")),
}
TIME_COLUMNS = {"t_enqueue", "t_start", "t_end", "ts", "stage_ts", "window_start"}
#: kinds read with FINAL: a replaced row counted twice would weigh its cluster twice
FINAL_KINDS = {"kernel_summaries"}
KERNEL_WINDOW_S = 40.0
#: How long the feed agents wait to fill a buffer: the feeds carry a few messages a second, so
#: a long wait is pure latency (Faust's take_events waits this long unless the buffer fills).
FEED_WITHIN_S = 0.05
#: stored beats batches the trigger may fall behind by (one per host agent and second)
BEATS_QUEUE = 1024
#: Batches of a job whose topology is not stored yet, kept until it is (per job; the oldest
#: go first), and the jobs kept so (the longest waiting go first): module docstring.
WAITING_BATCHES = 512
WAITING_JOBS = 64
#: ... and the bytes their columns hold, all jobs together (a 10,000-rank job's progress
#: window is a few MB)
WAITING_BYTES = 256 << 20
#: how often the timer looks for the waiting jobs' topologies
RELEASE_EVERY_NS = SECOND
#: How long a job's topology read by the analyst (`_read`) serves its next reads, s: a
#: slowdown try reads the job twice or three times within milliseconds and comes again a
#: tenth of a second later, each read looked the topology up in the `jobs` table (~4 ms of
#: a ~40 ms try on an idle machine); a topology published again (a communicator created
#: after the first step) is read at most this long after it is stored.
TOPOLOGY_TTL_S = 1.0
#: the end of the query that anchors a job's stage copy (`DiagnosisAgents._stages`): every
#: row stored, whatever its time (DateTime64(9)'s last moment)
STORED_END_NS = 2**63 - 1
#: how far back a takeover looks for incidents still open
OPEN_WITHIN_NS = 86_400 * SECOND
#: The newest version of every incident of the last day whose newest version is not resolved.
OPEN_INCIDENTS_SQL = f"""
SELECT argMax(json, version) FROM diagnoses FINAL
WHERE detected_ns > toUnixTimestamp64Nano(now64(9)) - {OPEN_WITHIN_NS}
GROUP BY job_id, incident_id HAVING argMax(status, version) != 'resolved'
"""


def progress_as_ops(p: Columns) -> tuple[Columns, Columns]:
    """Progress rows → (ops-like rows, beats rows) for the trigger modules (module docstring)."""
    we = ints(p, "window_end")
    done = ints(p, "completed_ops") > 0
    infl = ints(p, "inflight_ops") > 0
    rank = ints(p, "rank")
    n_done, n_in = int(done.sum()), int(infl.sum())
    start_in = we[infl] - ints(p, "oldest_inflight_age_ns")[infl]
    ops = {"rank": np.concatenate([rank[done], rank[infl]]),
           "bytes": np.zeros(n_done + n_in, dtype=np.int64),
           "t_enqueue": np.concatenate([we[done], start_in]),
           "t_start": np.concatenate([we[done] - 1, start_in]),
           "t_end": np.concatenate([we[done], np.zeros(n_in, dtype=np.int64)])}
    beat = ints(p, "last_beat_ts") > 0
    beats = {"rank": rank[beat], "ts": ints(p, "last_beat_ts")[beat]}
    return ops, beats


def _nbytes(b: RecordBatch) -> int:
    """The bytes a batch's columns hold (what a waiting batch costs)."""
    return sum(int(np.asarray(v).nbytes) for v in b.cols.values())


def iterations_as_steps(it: Columns) -> Columns:
    return {k: ints(it, k) for k in ("rank", "step", "step_ns", "t_end")}


def read_topology(db: Database, job_id: str) -> JobTopology | None:
    r = db.query("SELECT argMax(topology, ts) FROM jobs WHERE job_id = {j:String}",
                 parameters={"j": job_id})
    rows = r.result_rows
    if not rows or not rows[0][0]:
        return None
    return JobTopology.model_validate_json(rows[0][0])


def read_window(db: Database, topo: JobTopology, start_ns: int, now_ns: int,
                kinds: Collection[str] | None = None) -> Window:
    """All ranks' raw rows of one job in [start_ns, now_ns] (plus ops still in flight), of
    every raw kind or of `kinds` only."""
    tables: dict[str, Columns] = {}
    for kind, (tcol, cols) in WINDOW_COLUMNS.items():
        if kinds is not None and kind not in kinds:
            continue
        # aliases must not shadow the columns the WHERE clause compares
        sel = ", ".join(f"toUnixTimestamp64Nano({c}) AS {c}__ns" if c in TIME_COLUMNS else c
                        for c in cols)
        lo = max(start_ns, now_ns - int(KERNEL_WINDOW_S * SECOND)) \
            if kind in ("kernels", "kernel_summaries") else start_ns
        where = (f"job_id = {{j:String}} AND {tcol} >= fromUnixTimestamp64Nano({{lo:Int64}}, "
                 f"'UTC') AND {tcol} <= fromUnixTimestamp64Nano({{hi:Int64}}, 'UTC')")
        if kind == "ops":
            where = (f"({where}) OR (job_id = {{j:String}} AND toUnixTimestamp64Nano(t_end) = 0"
                     " AND t_start >= fromUnixTimestamp64Nano({lo2:Int64}, 'UTC'))")
        final = " FINAL" if kind in FINAL_KINDS else ""
        res = db.query_coded(f"SELECT {sel} FROM {kind}{final} WHERE {where}",
                             {"j": topo.job_id, "lo": lo, "hi": now_ns,
                              "lo2": start_ns - 3600 * SECOND})
        if res and len(next(iter(res.values()))):
            # LowCardinality columns arrive dictionary-encoded: the rules' factorization of
            # them (columns.codes) then costs nothing
            tables[kind] = {k.removesuffix("__ns"): coded_column(v.values, v.codes)
                            if isinstance(v, Coded) else np.asarray(v) for k, v in res.items()}
    if "ops" in tables:
        tables["ops"] = with_delivered_sends(
            without_superseded_in_flight(latest_op_rows(tables["ops"]), now_ns), start_ns, now_ns)
    return Window(topo, tables, start_ns, now_ns)


def diagnosis_row(d: Diagnosis) -> bytes:
    return orjson.dumps({
        "job_id": d.job_id, "incident_id": d.incident_id, "version": d.version, "id": d.id,
        "status": d.status, "kind": d.kind, "culprit_ranks": d.culprit_ranks,
        "culprit_hosts": d.culprit_hosts, "stage": d.stage or "", "component": d.component or "",
        "confidence": d.confidence, "labels": d.labels, "rules": d.rules,
        "onset_ns": d.onset_ns or 0, "detected_ns": d.detected_ns, "summary": d.summary,
        "json": d.model_dump_json()})


def beat_counters(b: RecordBatch) -> Columns:
    """The columns of a stored beats batch the heartbeat timer reads (rank, ts, comm_id,
    last_op_seq, exited); the raw sink decodes string columns dictionary-coded, apart from
    `cols`."""
    out: dict[str, np.ndarray] = {k: b.cols[k] for k in ("rank", "ts", "last_op_seq", "exited")
                                  if k in b.cols}
    if "comm_id" in b.cols or "comm_id" in b.strings:
        out["comm_id"] = b.column("comm_id")
    return out


class DiagnosisAgents:
    """Trigger and root-cause agents on one Faust app (see the module docstring)."""

    def __init__(self, app: faust.App, db: Database, topics: Topics, *,
                 clock: Callable[[], int] = time.time_ns, tick_s: float = 0.25,
                 config: AnalystConfig | None = None,
                 ownership: Ownership | None = None,
                 lateness_ns: int = WatermarkParams().lateness_ns) -> None:
        self.app, self.db, self.clock = app, db, clock
        self.lateness_ns = lateness_ns  # the derived feed's (settings.derived_lateness_s)
        self.ownership = ownership or Ownership()
        self._restoring = asyncio.Lock()
        #: the ownership generation the held state is for (-1: nothing restored yet)
        self.restored_generation = -1
        self.watches: dict[str, JobWatch] = {}
        self.watermark: dict[str, int] = {}  # per job: newest progress window_end (event time)
        self.topos: dict[str, JobTopology] = {}
        #: per job: when `_read` last looked its topology up (time.monotonic())
        self.topo_read: dict[str, float] = {}
        #: the owned jobs' stage records as stored, for the analyst's reads (`_read`)
        self.stage_rows = StageRows()
        busy = getattr(db, "busy_s", None)
        self.analyst = Analyst(self._read, config or AnalystConfig(),
                               event_clock=self._event_time,
                               spent=time.thread_time if busy is None else
                               lambda: time.thread_time() + busy())
        self.lock = asyncio.Lock()
        #: the worker's CPU seconds spent diagnosing, per kind of work ("trigger": a trigger's
        #: analysis; "evidence": pending slowdown tries as stage records are stored; "tick":
        #: the timer's sweeps, re-checks and pending tries): the analyst's thread and its
        #: reads on the database thread (`_in_thread`; the worker's /metrics)
        self.analysis_cpu_s: dict[str, float] = dict.fromkeys(("trigger", "evidence", "tick"),
                                                              0.0)
        self._db_cpu: Callable[[], float] = getattr(db, "cpu_s", lambda: 0.0)
        self.published: list[Diagnosis] = []
        #: triggers published per trigger kind (the worker's /metrics)
        self.trigger_counts: dict[str, int] = {}

        def topic(name: str) -> Any:
            return app.topic(name, value_serializer="raw", key_serializer="raw")

        self.t_progress = topic(topics.progress)
        self.t_iterations = topic(topics.iterations)
        self.t_triggers = topic(topics.triggers)
        self.t_diagnoses = topic(topics.diagnoses)
        app.agent(self.t_progress, name="rankwatch.diagnosis.progress")(self._on_progress)
        app.agent(self.t_iterations, name="rankwatch.diagnosis.iterations")(self._on_iterations)
        app.agent(self.t_triggers, name="rankwatch.diagnosis.root_cause")(self._on_triggers)
        every(app, tick_s, self._tick, "rankwatch.diagnosis.tick")
        #: stored beats and stage batches waiting for the trigger (`on_stored`); full:
        #: dropped, counted per kind
        self._stored: asyncio.Queue[tuple[str, RecordBatch]] = asyncio.Queue(
            maxsize=BEATS_QUEUE)
        self.beats_dropped = 0
        self.stages_dropped = 0
        #: per job without a stored topology: its batches so far, (what, batch), in order
        self._waiting: dict[str, deque[tuple[str, RecordBatch]]] = {}
        self._waiting_bytes = 0
        self.waiting_dropped = 0
        self._release_due_ns = 0  # the next look for the waiting jobs' topologies (`_tick`)
        app.task(self._on_stored)
        #: set when a job with a pending performance trigger has stage records stored
        self._evidence = asyncio.Event()
        app.task(self._on_evidence)

    # -- I/O helpers -------------------------------------------------------------------------

    def _event_time(self, job_id: str, now_ns: int) -> int:
        """Up to when the job's records are stored: the wall clock, but never more than the
        feed's largest lateness past the job's progress watermark (the feed closes a window
        once every source is past it). Live, the watermark trails the wall clock by less than
        that, so this is the wall clock; for a replayed capture or a job that has ended it is
        the job's own last moment, which re-checks then judge again and again the same."""
        wm = self.watermark.get(job_id)
        return now_ns if wm is None else min(now_ns, wm + self.lateness_ns)

    def _read(self, job_id: str, start_ns: int, now_ns: int,
              kinds: Collection[str] | None = None) -> Window | None:
        """The job's window, on its newest topology: a job publishes its topology again when
        its communicators change (a group created after the first step), and an analysis on
        the first one would not know the newer groups' members (one indexed lookup per read).
        The topology looked up serves the reads of the next `TOPOLOGY_TTL_S`; the stage records
        come from the copy the stored batches keep (`_stages`). Its queries go ahead of the
        inserts waiting for the database thread (`Database.urgent`): a diagnosis waits on
        them."""
        urgent = getattr(self.db, "urgent", None)
        with contextlib.nullcontext() if urgent is None else urgent():
            topo, now = self.topos.get(job_id), time.monotonic()
            if topo is None or now - self.topo_read.get(job_id, -TOPOLOGY_TTL_S) \
                    >= TOPOLOGY_TTL_S:
                topo = read_topology(self.db, job_id) or topo
                if topo is None:
                    return None
                self.topos[job_id], self.topo_read[job_id] = topo, now
            if kinds is not None and "stages" not in kinds:
                return read_window(self.db, topo, start_ns, now_ns, kinds)
            stages = self._stages(topo, start_ns, now_ns)
            rest = [k for k in (WINDOW_COLUMNS if kinds is None else kinds) if k != "stages"]
            w = read_window(self.db, topo, start_ns, now_ns, rest)
            return w if not stages else Window(topo, {**w.tables, "stages": stages},
                                               start_ns, now_ns)

    def _stages(self, topo: JobTopology, start_ns: int, now_ns: int) -> Columns:
        """The job's stage records in [start_ns, now_ns], from the stored batches' copy
        (diagnosis/stage_rows.py); the first read of a job, or one the copy cannot serve,
        queries every stage record stored from `start_ns` on and anchors the copy there."""
        job = topo.job_id
        got = self.stage_rows.read(job, start_ns, now_ns)
        if got is not None:
            return got
        self.stage_rows.begin(job, start_ns)
        w = read_window(self.db, topo, start_ns, STORED_END_NS, ("stages",))
        st = w.get("stages")
        self.stage_rows.anchor(job, start_ns, st)
        got = self.stage_rows.read(job, start_ns, now_ns)
        if got is not None:
            return got
        if not st:  # dropped while the query ran: its rows, cut to the read
            return {}
        keep = ints(st, "t_start") <= now_ns
        return {k: np.asarray(v)[keep] for k, v in st.items()} if keep.any() else {}

    async def _watch(self, job_id: str) -> JobWatch | None:
        w = self.watches.get(job_id)
        if w is None:
            topo = await asyncio.to_thread(read_topology, self.db, job_id)
            if topo is None:
                return None
            self.topos[job_id] = topo
            w = self.watches[job_id] = JobWatch(topo)
        return w

    async def _publish_triggers(self, triggers: list[Trigger]) -> None:
        for t in triggers:
            rec = TriggerRecord(job_id=t.job_id, ts=t.ts, kind=t.kind, ranks=list(t.ranks),
                                evidence=orjson.loads(orjson.dumps(dict(t.evidence),
                                                                   default=str)))
            log.info("trigger %s %s ranks=%s", t.job_id, t.kind, list(t.ranks)[:8])
            await self.t_triggers.send(key=t.job_id.encode(), value=rec.model_dump_json().encode())
            self.trigger_counts[t.kind] = self.trigger_counts.get(t.kind, 0) + 1

    async def _publish(self, diags: list[Diagnosis]) -> None:
        """Store each version, then announce it: a version on rw.diagnoses is always in the
        `diagnoses` table, where a worker that takes the job over finds its incident (a worker
        stopped between the two has its version announced by that worker: `_restore`)."""
        for d in diags:
            log.info("diagnosis %s", d.summary)
            # ahead of the raw inserts waiting for the database thread: the announcement
            # waits on it, and a user's tooling on the announcement
            await self.db.acommand("INSERT INTO diagnoses FORMAT JSONEachRow\n"
                                   + diagnosis_row(d).decode(), urgent=True)
            await self._announce(d)
            self.published.append(d)

    async def _announce(self, d: Diagnosis) -> None:
        fut = await self.t_diagnoses.send(key=d.job_id.encode(), value=d.to_json())
        await fut

    @property
    def restored(self) -> bool:
        return self.restored_generation >= 0

    async def _restore(self) -> None:
        """Hand jobs over after an assignment (module docstring, "ownership"); nothing to do
        while the ownership is unchanged. A failed read is retried at the next call."""
        if self.restored_generation == self.ownership.generation:
            return
        async with self._restoring:
            generation = self.ownership.generation
            if self.restored_generation == generation:
                return
            try:
                r = await self.db.aquery(OPEN_INCIDENTS_SQL)
            except ClickHouseError as e:  # the table may not exist in an old database
                log.warning("cannot restore incidents: %s", e.message)
                if e.code != 60:  # UNKNOWN_TABLE: nothing to restore; otherwise retry
                    return
                r = None
            found = [Diagnosis.model_validate_json(row[0]) for row in r.result_rows] if r else []
            async with self.lock:  # the analyst's thread does not run meanwhile
                self._forget([j for j in self._held() if not self.ownership.owns(j)])
                held = {job for job, _ in self.analyst.book.open}
                gained = [d for d in found
                          if d.job_id not in held and self.ownership.owns(d.job_id)]
                self.analyst.book.restore(gained)
                self.analyst.jobs |= {d.job_id for d in gained}
            if gained:
                log.info("took over %d open incident(s) of %d job(s)", len(gained),
                         len({d.job_id for d in gained}))
            # the previous owner may have stopped between storing a version and announcing it:
            # announce the newest version again, under its own `id` (consumers deduplicate)
            for d in gained:
                try:
                    await self._announce(d)
                except Exception as e:  # the broker is out: the incident goes on regardless
                    log.warning("announcing taken-over incident %s again failed: %s",
                                d.incident_id, e)
            self.restored_generation = generation

    def _current(self) -> bool:
        """Whether the held incidents are those of the current assignment (read under
        `self.lock`, just before the analyst decides anything)."""
        return self.restored_generation == self.ownership.generation

    async def _restored(self) -> None:
        """Return once the open incidents of the current assignment are loaded (`_restore`;
        a failed read is tried again a second later). Nothing of a job gained in a rebalance
        may be decided before: a trigger analysed first would open a second incident for one
        the previous owner announced, and the restore keeps incidents already held."""
        while not self._current():
            generation = self.ownership.generation
            try:
                await self._restore()
            except Exception as e:  # the store is out: wait for it (nothing is decided before)
                log.warning("loading the open incidents failed (%s: %s); trying again",
                            type(e).__name__, e)
            if self.restored_generation != generation:  # the read failed: not a new assignment
                await asyncio.sleep(1.0)

    def _held(self) -> set[str]:
        a = self.analyst
        return set(self.watches) | set(self.topos) | set(self.watermark) | set(self._waiting) \
            | a.jobs \
            | {job for job, _ in a.book.open} | set(a.pending) | set(a.pending_slow)

    def _forget(self, jobs: Collection[str]) -> None:
        """Drop everything held of `jobs` (another worker owns them now)."""
        if not jobs:
            return
        gone = set(jobs)
        a = self.analyst
        # a pending trigger too: retried here, it would open the new owner's incident twice
        for per_job in (self.watches, self.topos, self.topo_read, self.watermark, a.last_check,
                        a.last_sweep,
                        a.swept_at, a.resolved_hangs, a.exits_judged, a.exit_checks,
                        a.exit_clock_since, a.pending,
                        a.pending_slow, a.stages_stored, a.slow_tried_at):
            for job in [j for j in per_job if j in gone]:
                del per_job[job]
        for job in gone:
            self.stage_rows.drop(job)
        for job in [j for j in self._waiting if j in gone]:
            self._waiting_bytes -= sum(_nbytes(b) for _, b in self._waiting.pop(job))
        a.jobs -= gone
        for key in [k for k in a.book.open if k[0] in gone]:
            del a.book.open[key]
        for key in [k for k in a.triggers if k[0] in gone]:
            del a.triggers[key]
        log.info("handed over %d job(s) to other workers", len(gone))

    # -- agents ------------------------------------------------------------------------------

    async def _feed(self, stream: StreamT[Any], what: str) -> None:
        """Read the derived feed `what` into the job's watch (bad batches logged and skipped;
        batches of a job without a stored topology wait for it: `_ready_watch`)."""
        async for events in cast(Stream[bytes], stream).take_events(64, FEED_WITHIN_S):
            for e in events:
                try:
                    b = decode_batch(e.message.value or b"")
                except BatchError as err:
                    log.warning("bad %s batch: %s", what, err)
                    continue
                if not self.ownership.owns(b.job_id):  # read during a rebalance
                    continue
                w = await self._ready_watch(what, b)
                if w is not None:
                    await self._observe(what, b, w)

    async def _ready_watch(self, what: str, b: RecordBatch) -> JobWatch | None:
        """The watch of `b`'s job, after the batches that waited for it are read; None while
        the job's topology is not stored (`b` then waits: module docstring)."""
        w = await self._watch(b.job_id)
        if w is None:
            self._wait(what, b)
            return None
        await self._release(b.job_id, w)
        return w

    async def _release(self, job: str, w: JobWatch) -> None:
        """Read the batches of `job` that waited for its topology, in order."""
        waited = self._waiting.pop(job, None)
        if waited:
            self._waiting_bytes -= sum(_nbytes(early) for _, early in waited)
            log.info("topology of %s stored: reading the %d batch(es) that waited for it",
                     job, len(waited))
            for kind, early in waited:
                await self._observe(kind, early, w)

    async def _release_waiting(self, now_ns: int) -> None:
        """Release the waiting jobs whose topology is stored by now: a job's last batches may
        all be read before its topology is stored (a replayed capture is read in seconds), and
        then no later batch would release them. One indexed lookup per waiting job, at most
        once a second."""
        if not self._waiting or now_ns < self._release_due_ns:
            return
        self._release_due_ns = now_ns + RELEASE_EVERY_NS
        for job in list(self._waiting):
            if self.ownership.owns(job):
                w = await self._watch(job)
                if w is not None:
                    await self._release(job, w)

    def _wait(self, what: str, b: RecordBatch) -> None:
        """Keep `b` until its job's topology is stored, within the bounds (module docstring):
        the longest-waiting job's oldest batches go first."""
        if b.job_id not in self._waiting and len(self._waiting) >= WAITING_JOBS:
            self._drop_waiting(next(iter(self._waiting)), all_of=True)
        q = self._waiting.setdefault(b.job_id, deque())
        q.append((what, b))
        self._waiting_bytes += _nbytes(b)
        if len(q) > WAITING_BATCHES:
            self._drop_waiting(b.job_id)
        while self._waiting_bytes > WAITING_BYTES and self._waiting:
            self._drop_waiting(next(iter(self._waiting)))

    def _drop_waiting(self, job: str, all_of: bool = False) -> None:
        q = self._waiting[job]
        for _ in range(len(q) if all_of else 1):
            self._waiting_bytes -= _nbytes(q.popleft()[1])
            self.waiting_dropped += 1
        if not q:
            del self._waiting[job]

    async def _observe(self, what: str, b: RecordBatch, w: JobWatch) -> None:
        """One batch of a job with a watch: `progress`, `iterations`, or stored `beats` or
        `stages`."""
        if what == "progress":
            ops, beats = progress_as_ops(b.cols)
            we = ints(b.cols, "window_end")
            now = max(self.watermark.get(b.job_id, 0), int(we.max()) if we.size else 0)
            self.watermark[b.job_id] = now
            await self._publish_triggers(w.observe(now, ops=ops, beats=beats, progress=b.cols))
        elif what in ("iterations", "stages"):
            steps = iterations_as_steps(b.cols) if what == "iterations" else \
                steps_from_stages(b.cols)
            now = self.watermark.get(b.job_id) or int(steps["t_end"].max(initial=0))
            await self._publish_triggers(w.observe(
                now, steps=steps, stages=b.cols if what == "stages" else None))
        else:
            await self._publish_triggers(w.observe_beats(beat_counters(b)))

    async def _on_progress(self, stream: StreamT[Any]) -> None:
        await self._feed(stream, "progress")

    async def _on_iterations(self, stream: StreamT[Any]) -> None:
        await self._feed(stream, "iterations")

    def on_stored(self, kind: str, batch: RecordBatch) -> None:
        """A raw batch of an owned job is stored (streams.derived.ObservingStore's listener):
        beats go to the trigger, which reads the ranks' op counters in them without waiting
        for the progress feed's windows (heartbeat.beat_progress_trigger), and stage records
        go to the step-time trigger as they are stored, without waiting for the iteration
        previews of the derived runner's next tick (module docstring)."""
        self.analyst.seen(batch.job_id, kind)
        if kind == "stages":
            self.stage_rows.add(batch.job_id, batch.cols)
        if kind in ("stages", "ops"):
            try:  # how far the job's stage records and calls are stored (`Analyst.stored`)
                self._stored_ends(batch.job_id, kind, *newest_per_rank(kind, batch.cols))
            except (KeyError, ValueError, TypeError):  # stored, but not this bookkeeping's
                log.warning("stored %s batch of %s: no rank/time columns", kind, batch.job_id)
        if kind not in ("beats", "stages"):
            return
        try:
            self._stored.put_nowait((kind, batch))
        except asyncio.QueueFull:  # the trigger is behind: the derived feeds still cover it
            if kind == "beats":
                self.beats_dropped += 1
            else:
                self.stages_dropped += 1

    def on_stored_ends(self, job: str, kind: str, ranks: np.ndarray, ends: np.ndarray) -> None:
        """Records of `kind` of an owned job are stored up to `ends[i]` for rank `ranks[i]` by
        another worker (its report: streams/reports.py). Stage records stored elsewhere (the
        job's previous owner, in a rebalance) are not in the copy of this worker's stored
        batches: the next read queries them."""
        if kind == "stages":
            self.stage_rows.drop(job)
        self._stored_ends(job, kind, ranks, ends)

    def _stored_ends(self, job: str, kind: str, ranks: np.ndarray, ends: np.ndarray) -> None:
        """Records of `kind` of an owned job are stored up to `ends[i]` for rank `ranks[i]`,
        by this worker (`on_stored`) or another one (`on_stored_ends`)."""
        self.analyst.seen(job, kind)
        if kind not in ("stages", "ops"):
            return
        self.analyst.stored(job, kind, ranks, ends)
        # a pending slowdown's evidence may be complete: try it now, not at the tick
        if kind == "stages" and job in self.analyst.pending_slow:
            self._evidence.set()

    async def _on_stored(self) -> None:
        while True:
            kind, b = await self._stored.get()
            try:
                if not self.ownership.owns(b.job_id):
                    continue
                w = await self._ready_watch(kind, b)
                if w is not None:
                    await self._observe(kind, b, w)
            except Exception:  # never stop reading for one bad batch or a broker blip
                log.exception("%s trigger failed for %s", kind, b.job_id)

    async def _on_evidence(self) -> None:
        """Pending performance triggers tried again as their jobs' stage records are stored
        (`Analyst.retry_slow`: each when its pacing allows), not at the next tick."""
        while True:
            await self._evidence.wait()
            self._evidence.clear()
            try:
                await self._restored()
                async with self.lock:
                    if not self._current():  # reassigned meanwhile: the next wake-up
                        self._evidence.set()
                        continue
                    diags = await self._in_thread("evidence", self.analyst.retry_slow,
                                                  self.clock())
                await self._publish(diags)
            except Exception:  # never stop trying for one bad window or a broker blip
                log.exception("pending slowdown try failed")

    async def _on_triggers(self, stream: StreamT[Any]) -> None:
        async for events in cast(Stream[bytes], stream).take_events(16, FEED_WITHIN_S):
            for e in events:
                try:
                    rec = TriggerRecord.model_validate_json(e.message.value or b"")
                except ValueError as err:
                    log.warning("bad trigger: %s", err)
                    continue
                t = Trigger(rec.job_id, rec.ts, rec.kind, tuple(rec.ranks), rec.evidence)
                # a trigger's way here: the Kafka hop, then the analyst's lock
                hop_ms = (time.time() - (e.message.timestamp or 0.0)) * 1e3
                read_at = time.monotonic()
                try:
                    diags = await self._analyse(t)
                    log.debug("%s trigger %s read %.0f ms after it was published, root cause "
                              "done %.0f ms after that", t.kind, t.job_id, hop_ms,
                              (time.monotonic() - read_at) * 1e3)
                    await self._publish(diags)
                except Exception:  # a bad window must not stop the worker; next trigger/tick
                    log.exception("root cause failed for %s %s", t.job_id, t.kind)

    async def _analyse(self, t: Trigger) -> list[Diagnosis]:
        """Root cause for trigger `t` (`Analyst.on_trigger`), once the held incidents are the
        current assignment's (`_restored`); nothing for a job owned elsewhere (a trigger read
        during a rebalance)."""
        while True:
            await self._restored()
            async with self.lock:
                if not self._current():  # reassigned while waiting for the lock
                    continue
                if not self.ownership.owns(t.job_id):
                    return []
                return await self._in_thread("trigger", self.analyst.on_trigger, t,
                                             self.clock())

    async def _in_thread(self, work: str, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)`, an analyst call, on a thread (it must not hold the event loop), its
        CPU added to `analysis_cpu_s[work]`: what the call's thread and the database thread
        spent on it. The analyst's calls hold `lock`, so they never run two at a time."""
        def run() -> _T:
            c0, d0 = time.thread_time(), self._db_cpu()
            try:
                return fn(*args)
            finally:
                spent = time.thread_time() - c0 + self._db_cpu() - d0
                self.analysis_cpu_s[work] = self.analysis_cpu_s.get(work, 0.0) + spent

        return await asyncio.to_thread(run)

    async def _tick(self) -> None:
        try:
            now = self.clock()
            await self._restore()
            await self._release_waiting(now)
            self.analyst.jobs |= set(self.watches)
            self.analyst.jobs = {j for j in self.analyst.jobs if self.ownership.owns(j)}
            if self.lock.locked() or not self.analyst.busy():
                return  # (an idle worker's tick does not hop to a thread for nothing)
            async with self.lock:
                if not self._current():  # not restored for this assignment: a later tick
                    return
                diags = await self._in_thread("tick", self.analyst.tick, now)
            await self._publish(diags)
        except Exception:  # never crash the worker from the diagnosis timer
            log.exception("diagnosis tick failed")


def attach(app: faust.App, db: Database, topics: Topics,
           ownership: Ownership | None = None, *,
           lateness_ns: int = WatermarkParams().lateness_ns) -> DiagnosisAgents:
    """Add the diagnosis agents to the worker's app (the hook rankwatch worker calls) for the
    jobs `ownership` says this worker owns (all by default), with the derived feed's lateness
    (`derived_lateness_s`)."""
    return DiagnosisAgents(app, db, topics, ownership=ownership, lateness_ns=lateness_ns)
