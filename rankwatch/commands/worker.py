"""`rankwatch worker`: the Faust worker that owns ClickHouse and serves SQL to other processes.

Start-up order: open the database (the embedded one can be opened by this process only), apply
migrations, start the SQL endpoint, then consume. SIGTERM/SIGINT stop it cleanly: Faust stops the
agents (each finishes its current insert and acks), then the endpoint and database close.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import sys
import time
from typing import Any

import faust
from aiohttp import web
from prometheus_client import CollectorRegistry

from diagnosis.agents import attach as attach_diagnosis
from ingest.records import DERIVED
from rankwatch import metrics, pages
from rankwatch.settings import Settings
from rankwatch.stack import display_url, ping_notes, record_exit
from streams.app import AppConfig, StreamsApp
from streams.db import ClickHouseError, Database, SqlLimits, migrate
from streams.derived import DerivedConfig, DerivedRunner, ObservingStore
from streams.kernel_summaries import KernelParams
from streams.ownership import Ownership
from streams.progress import ProgressParams
from streams.raw_sink import TimeBounds
from streams.sql_endpoint import start_sql_endpoint, stop_sql_endpoint
from streams.timers import every
from streams.windows import WatermarkParams
from streams.writer import ClickHouseWriter, IngestMetric

log = logging.getLogger("rankwatch.worker")
METRICS_INTERVAL_S = 10.0
#: Exit code when the worker cannot start as configured (port taken, no token beyond loopback):
#: not a crash to restart into.
EXIT_CONFIG = 78
TRIM_INTERVAL_S = 10.0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("worker", help="run the stream worker (owns ClickHouse, serves SQL)")
    p.add_argument("--loglevel", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def derived_config(settings: Settings) -> DerivedConfig:
    """The derived runner's windows from the settings (seconds -> ns)."""
    def ns(s: float) -> int:
        return round(s * 1e9)

    return DerivedConfig(
        lateness_ns=ns(settings.derived_lateness_s),
        progress=ProgressParams(window_ns=ns(settings.progress_window_s)),
        iteration_window_ns=ns(settings.iteration_window_s),
        kernels=KernelParams(window_ns=ns(settings.kernel_window_s)),
        watermark=WatermarkParams(gap_ns=ns(settings.derived_gap_s)))


def sql_limits(settings: Settings) -> SqlLimits:
    return SqlLimits(max_execution_time_s=settings.sql_max_execution_time_s,
                     max_memory_bytes=settings.sql_max_memory_mb << 20,
                     max_result_bytes=settings.sql_max_result_mb << 20,
                     concurrency=settings.sql_concurrency,
                     stuck_grace_s=settings.sql_stuck_grace_s, nice=settings.sql_nice)


def time_bounds(settings: Settings) -> TimeBounds:
    def ns(s: float) -> int:
        return round(s * 1e9)

    return TimeBounds(min_ns=settings.event_time_min_ns,
                      future_ns=ns(settings.event_time_future_s),
                      span_ns=ns(settings.event_time_span_s),
                      past_ns=ns(settings.event_time_past_s))


def build(settings: Settings, db: Database, derived: DerivedConfig | None = None) -> StreamsApp:
    """The streams app wired to `db`, with the SQL endpoint, the derived runner (progress,
    iterations, kernel summaries: streams/derived.py) and a metrics timer attached."""
    writer = ClickHouseWriter(db)
    cfg = AppConfig(app_id=f"rankwatch-{settings.topic_prefix}", bootstrap=settings.bootstrap,
                    topics=settings.topics, max_messages=settings.writer_max_messages,
                    within_s=settings.writer_max_seconds,
                    latency_within_s=settings.writer_latency_seconds, bounds=time_bounds(settings),
                    session_timeout_s=settings.kafka_session_timeout_s)
    topics: dict[str, Any] = {}

    async def publish(kind: str, job: str, data: bytes) -> None:
        fut = await topics[kind].send(key=job.encode(), value=data)
        await fut  # delivered before the window is checkpointed

    derived = derived or derived_config(settings)
    ownership = Ownership(standalone=False)  # the jobs whose home partition is assigned here
    deriver = DerivedRunner(db, publish, derived, ownership=ownership)

    async def report(job: str, data: bytes) -> None:  # for the job's owner (streams/reports.py)
        fut = await topics["stored"].send(key=job.encode(), value=data)
        await fut  # delivered before the raw batch is acked

    store = ObservingStore(writer, deriver.windows, deriver.kernels.buffer, ownership=ownership,
                           report=report)
    sapp = StreamsApp(cfg, store, ownership)
    sapp.add_reports_agent(store.fold_reports)
    sapp.derived = deriver
    sapp.on_exit = lambda code, reason: record_exit(settings, code, reason)
    sapp.diagnosis = attach_diagnosis(  # type: ignore[attr-defined]
        sapp.app, db, settings.topics, ownership=ownership, lateness_ns=derived.lateness_ns)
    store.listeners.append(sapp.diagnosis.on_stored)  # type: ignore[attr-defined]
    store.end_listeners.append(sapp.diagnosis.on_stored_ends)  # type: ignore[attr-defined]
    sapp.metrics = worker_metrics(settings, sapp, writer)  # type: ignore[attr-defined]
    for kind in DERIVED:
        topics[kind] = sapp.app.topic(settings.topics.for_kind(kind), value_serializer="raw",
                                      key_serializer="raw")
    topics["stored"] = sapp.app.topic(settings.topics.stored, value_serializer="raw",
                                      key_serializer="raw")
    restored: list[bool] = []

    async def derive() -> None:
        try:  # the derived path never takes the worker (and the raw ingest) down
            if not restored:
                await deriver.restore()
                restored.append(True)
            await deriver.tick()
        except Exception:
            log.exception("derived streams tick failed; retrying at the next tick")

    def health() -> list[str]:
        return sapp.health(settings.worker_stall_s)
    runner: dict[str, web.AppRunner] = {}
    last: dict[str, tuple[int, int]] = {}

    async def serve_sql() -> None:
        try:
            runner["sql"] = await start_sql_endpoint(
                db, settings.bind_host, settings.sql_port, writable=settings.sql_writable,
                token=settings.sql_token.get_secret_value(), limits=sql_limits(settings),
                health=health, notes=lambda: ping_notes(settings))
        except (OSError, ValueError) as e:
            log.critical("SQL endpoint: %s; stopping", e)
            record_exit(settings, EXIT_CONFIG, f"SQL endpoint: {e}")
            os._exit(EXIT_CONFIG)
        log.info("SQL endpoint on http://%s:%d (%s)", settings.bind_host, settings.sql_port,
                 "writable" if settings.sql_writable else "read-only")

    async def store_metrics() -> None:
        rows, seen = [], {}
        now = time.time_ns()
        for kind, st in sapp.stats().items():
            rows_before, msgs_before = last.get(kind, (0, 0))
            if st["messages"] == msgs_before:
                continue
            seen[kind] = (st["rows"], st["messages"])
            rows.append(IngestMetric(now, settings.worker_id, settings.topics.for_kind(kind), -1,
                                     st["rows"] - rows_before, st["messages"] - msgs_before,
                                     st.get("lag_ms_p50", 0.0), st.get("lag_ms_max", 0.0)))
        if not rows:
            return
        try:  # metrics are a convenience: a full disk or an outage must not stop the worker
            await writer.write_metrics(rows)
        except Exception as e:  # the counts stay due: the next tick stores them
            log.warning("storing ingest metrics failed (%s); retrying at the next tick",
                        getattr(e, "message", e))
            return
        last.update(seen)

    async def serve_pages() -> None:
        if settings.page_port:
            pages_runner = await pages.start(pages.db_query(db), settings.bind_host,
                                             settings.page_port)
            if pages_runner is not None:
                runner["pages"] = pages_runner

    async def close_sql(sender: Any, *args: Any, signal: Any = None, **kwargs: Any) -> None:
        if "sql" in runner:
            await stop_sql_endpoint(runner.pop("sql"))
        if "pages" in runner:
            await runner.pop("pages").cleanup()

    async def trim_memory() -> None:
        await asyncio.to_thread(release_free_memory)

    sapp.app.task(serve_sql)
    sapp.app.task(serve_pages)
    sapp.app.timer(METRICS_INTERVAL_S)(store_metrics)
    sapp.app.timer(TRIM_INTERVAL_S)(trim_memory)
    every(sapp.app, derived.tick_s, derive, "rankwatch.derived.tick")
    sapp.app.on_before_shutdown.connect(close_sql)  # type: ignore[arg-type]
    return sapp


def worker_metrics(settings: Settings, sapp: StreamsApp, writer: ClickHouseWriter
                   ) -> tuple[CollectorRegistry, metrics.ConsumerLag]:
    """The worker's Prometheus registry (rankwatch/metrics.py) and its consumer-lag probe;
    `run` serves the one and starts the other."""
    registry = CollectorRegistry()
    metrics.time_inserts(writer, registry)
    t = settings.topics
    consumed = [t.jobs, t.ops, t.flows, t.chunks, t.stages, t.kernels, t.wr, t.beats,
                t.progress, t.iterations, t.triggers, t.stored]
    lag = metrics.ConsumerLag(settings.bootstrap, f"rankwatch-{settings.topic_prefix}", consumed)
    registry.register(metrics.WorkerCollector(sapp, lag))
    return registry, lag


def release_free_memory() -> bool:
    """Hand the C allocator's free memory back to the system (glibc's malloc_trim; False where
    there is none). The worker's windows allocate and free hundreds of MB of arrays from several
    threads, each with its own malloc arena, and glibc keeps what they freed: untrimmed, the
    worker's RSS grows with every large job although Python, numpy and ClickHouse hold far less
    (docs/architecture.md, "Derived streams"; the worker's memory in docs/performance.md). A
    trim can take tens of milliseconds, so the caller runs it in a thread off the event loop."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim(0)
    return True


def no_numpy_hugepages() -> bool:
    """Stop numpy advising transparent huge pages for its large arrays in this process, unless
    the user chose with numpy's own NUMPY_MADVISE_HUGEPAGE. Where the kernel's THP defrag is
    `madvise` (a common default), every fresh advised region is compacted on its first touch:
    the worker allocates tens of MB afresh for each kernel window's KDE and each insert, and the
    KDE thread spent 0.86 s in the kernel against 0.24 s of its own work per 3.8 M events
    (`rankwatch bench streams --only kernels`; 0.29 s in the kernel with advice off). Returns
    whether it was turned off."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return False
    import numpy as np

    core = getattr(np, "_core", None) or getattr(np, "core", None)  # numpy 2 / 1.x
    advise = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if advise is None:  # pragma: no cover - a numpy without the switch: leave its default
        return False
    advise(False)
    return True


def run(args: argparse.Namespace, settings: Settings) -> int:
    logging.basicConfig(level=args.loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in filter(None, settings.debug_loggers.split(",")):
        logging.getLogger(name).setLevel(logging.DEBUG)
    no_numpy_hugepages()
    try:
        db = Database(settings.clickhouse, settings.clickhouse_database,
                      cluster=settings.clickhouse_cluster,
                      sql_user=settings.sql_clickhouse_user,
                      sql_password=settings.sql_clickhouse_password.get_secret_value())
    except ClickHouseError as e:
        print(f"rankwatch worker: cannot open ClickHouse at {display_url(settings.clickhouse)}: "
              f"{e.message}",
              file=sys.stderr)
        return 1
    if not db.target.embedded and not settings.sql_clickhouse_user:
        log.warning("the SQL endpoint's queries run as the writer's ClickHouse user: on a server "
                    "its limits bind only through a user of its own; set "
                    "RANKWATCH_SQL_CLICKHOUSE_USER to a user with SELECT alone and the "
                    "rankwatch_sql settings profile (docs/architecture.md)")
    try:
        applied = migrate(db)
        if applied:
            log.info("applied migrations: %s", ", ".join(m.name for m in applied))
        sapp = build(settings, db)
        registry, lag = sapp.metrics  # type: ignore[attr-defined]
        if metrics.serve(registry, settings.bind_host, settings.metrics_port):
            lag.start()
        worker = faust.Worker(sapp.app, loglevel=args.loglevel, quiet=True,
                              override_logging=False)
        return execute(worker, settings)
    except SystemExit as e:
        return int(e.code or 0) if isinstance(e.code, int) else 0
    finally:
        db.close()


def execute(worker: Any, settings: Settings) -> int:
    """Run the Faust worker until it stops; its exit code. mode ends a worker that crashed
    (an exception out of an agent, a task or a timer) with exit code 1, 71 when out of memory:
    such an exit is noted with `record_exit`, as the agents' own uncommitted exits are, so that
    `rankwatch status` counts it towards a crash loop."""
    try:
        worker.execute_from_commandline()  # raises SystemExit when the worker stops
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    if code:
        crash = getattr(worker, "crash_reason", None)
        why = f"{type(crash).__name__}: {crash}" if crash is not None else "see its log"
        record_exit(settings, code, f"the worker stopped with exit code {code}: {why}")
    return code
