"""The ClickHouse client: one connection, used from one thread, for the writers and readers.

`Database` owns ONE clickhouse-connect client for `chdb:///<dir>` (the embedded engine, in this
process) or `http(s)://user:pass@host:port` (a server) and a single-thread executor through which
every call goes: chdb is not used from several threads at once, and the Faust worker's event loop
awaits the `a*` wrappers instead of blocking. A sync method called from that thread runs inline.
Each method and its `a*` twin run the same implementation (`_query`, `_insert`, ...); only the
way they reach the database thread differs (`_call` waits, `_acall` awaits).

Contract:
- Errors from ClickHouse surface as `ClickHouseError` whose `message` is ClickHouse's own text
  ("Code: 60. DB::Exception: ..."). Opening an embedded directory that another process holds
  raises `EmbeddedDatabaseBusy`.
- `insert_columns` sends one Native insert, built by streams.native from numpy columns (string
  columns may come dictionary-encoded, `ingest.batch.Coded`, and go to LowCardinality columns as
  codes + dictionary); int64 nanoseconds go into `DateTime64(9)` columns as raw ticks (no
  datetime objects anywhere).
- `execute_sql` is the SQL endpoint's path (streams.db.user_sql): ClickHouse's formatted output
  as bytes, one statement per call, on a fresh engine session of its own with `readonly=1` and
  `SqlLimits` set before it, on a thread of its own (never the writer's).

With `cluster` (a server's cluster), every request carries `cluster_settings`, so that a read
sees the rows just written (streams.cluster: replicated tables behind Distributed ones of the
same names).

Calls made inside `urgent()` (the diagnosis analyst's reads: streams.db's one thread is shared
with the ingest's inserts) go ahead of the calls waiting on the database thread, not behind
them: live on 2 loaded cores an analysis's read queued for seconds behind inserts, and its
diagnosis came out that much later. A call already running is not interrupted; the analyst's
reads are paced (diagnosis/analyst.py), so inserts are not starved.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast, overload

import clickhouse_connect
import numpy as np
from clickhouse_connect.datatypes.registry import get_from_name
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError as DriverError
from clickhouse_connect.driver.insert import InsertContext
from clickhouse_connect.driver.query import QueryResult

from ingest.batch import Coded
from streams import cluster, native
from streams.db import user_sql
from streams.db.errors import ClickHouseError, from_driver
from streams.db.url import CLIENT_SETTINGS, client_args, endpoint_target, parse_url
from streams.db.user_sql import SqlLimits, set_thread_nice

log = logging.getLogger(__name__)

T = TypeVar("T")

_STRING = get_from_name("String")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _np_dtype(type_name: str) -> np.dtype[Any]:
    try:
        return np.dtype(get_from_name(type_name).np_type)
    except Exception:  # types with no numpy equivalent come back as objects, as query_np does
        return np.dtype(object)



@dataclass(frozen=True)
class _TableShape:
    """A table's insert columns: its qualified name, clickhouse-connect types, type names."""

    table: str
    types: dict[str, Any]
    type_names: dict[str, str]



class _DatabaseThread(Executor):
    """One thread that runs submitted calls in order, the urgent ones (`submit_first`) ahead
    of the others that wait; `ThreadPoolExecutor(1)` otherwise (`loop.run_in_executor` and
    `shutdown` as usual)."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._urgent: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...],
                                  dict[str, Any]]] = deque()
        self._normal: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...],
                                  dict[str, Any]]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()
        # as ThreadPoolExecutor's threads: at the interpreter's exit the thread runs what is
        # queued and ends (a Database never closed must not hold the exit for ever)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self.shutdown, False)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self.submit_first(False, fn, *args, **kwargs)

    def submit_first(self, urgent: bool, fn: Callable[..., T], /, *args: Any,
                     **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("cannot schedule new futures after shutdown")
            (self._urgent if urgent else self._normal).append((future, fn, args, kwargs))
            self._cv.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._urgent or self._normal or self._stopping):
                    self._cv.wait()
                if not (self._urgent or self._normal):
                    return  # stopping, nothing left
                future, fn, args, kwargs = (self._urgent or self._normal).popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the caller, as an executor does
                future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cv:
            self._stopping = True
            if cancel_futures:
                for future, *_ in (*self._urgent, *self._normal):
                    future.cancel()
                self._urgent.clear()
                self._normal.clear()
            self._cv.notify_all()
        if wait:
            self._thread.join()

class Database:
    """One ClickHouse database (`database`) at `url`, accessed from one thread. See module doc."""

    def __init__(self, url: str, database: str, *, create: bool = True,
                 cluster: str = "", sql_user: str = "", sql_password: str = "") -> None:
        if not _IDENT.match(database):
            raise ValueError(f"database {database!r}: expected letters, digits and underscores")
        if cluster and not _IDENT.match(cluster):
            raise ValueError(f"cluster {cluster!r}: expected letters, digits and underscores")
        self.target = parse_url(url)
        if cluster and self.target.embedded:
            raise ValueError(f"cluster {cluster!r} needs a ClickHouse server "
                             "(RANKWATCH_CLICKHOUSE_URL=http://...): the embedded engine is "
                             "one node; unset RANKWATCH_CLICKHOUSE_CLUSTER to use it")
        #: where `execute_sql` runs on a server (`endpoint_target`)
        self.sql_target = endpoint_target(self.target, sql_user, sql_password)
        self.database = database
        #: The server's cluster (remote_servers) the schema spans; "" on one node. See
        #: streams.cluster for the tables, `cluster_settings` for how writes are read back.
        self.cluster = cluster
        self._cluster_settings: dict[str, Any] = {}
        self._executor = _DatabaseThread(f"clickhouse-{database}")
        self._thread: int | None = None
        #: per calling thread: seconds the database thread spent running its calls (`busy_s`),
        #: and its CPU seconds on them (`cpu_s`)
        self._busy = threading.local()
        #: The SQL endpoint's threads (`aexecute_sql`), made on first use; queries in flight
        #: there: id -> (time.monotonic() at start, the SQL's first 200 characters).
        self._sql_pool: ThreadPoolExecutor | None = None
        self.sql_inflight: dict[int, tuple[float, str]] = {}
        self._sql_nice = 0  # the endpoint threads' nice value, set with the pool
        self._sql_ids = 0
        self._shapes: dict[str, _TableShape] = {}
        self._generic_sql: set[str] = set()  # queries whose results streams.native cannot read
        self._empty_shapes: dict[str, list[tuple[str, np.dtype[Any]]]] = {}
        self._closed = False
        try:
            self._client: Client = self._call(self._open, create)
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    # -- plumbing ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClickHouseError(f"database {self.database} at {self.target.display()} is closed")

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the database thread and wait; inline when already on it. The time it
        ran there, not the time it queued behind other threads' calls, is added to the
        calling thread's `busy_s`."""
        self._check_open()
        if threading.get_ident() == self._thread:
            return self._guarded(fn, *args, **kwargs)
        future: Future[tuple[T, float, float]] = self._executor.submit_first(
            bool(getattr(self._busy, "urgent", False)), self._timed, fn, *args, **kwargs)
        out, took, cpu = future.result()
        self._busy.s = getattr(self._busy, "s", 0.0) + took
        self._busy.cpu = getattr(self._busy, "cpu", 0.0) + cpu
        return out

    def _timed(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float, float]:
        """`fn`'s result, the seconds it ran and the database thread's CPU seconds on it."""
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self._guarded(fn, *args, **kwargs)
        return out, time.perf_counter() - t0, time.thread_time() - c0

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """The calling thread's calls inside go ahead of those waiting for the database thread
        (module docstring)."""
        was = getattr(self._busy, "urgent", False)
        self._busy.urgent = True
        try:
            yield
        finally:
            self._busy.urgent = was

    def busy_s(self) -> float:
        """Seconds the database has spent running the calling thread's calls, ever: the
        difference over a piece of work is what the work cost the database, without the
        time its calls waited for the inserts of the ingest ahead of them. A caller that
        paces its work by its cost (the analyst's tries) counts this with its own CPU time;
        the process's CPU time counts every other thread's work as the caller's."""
        return float(getattr(self._busy, "s", 0.0))

    def cpu_s(self) -> float:
        """CPU seconds this process's database thread has spent on the calling thread's
        calls, ever (encoding, HTTP, decoding, and what of an embedded engine's work runs on
        that thread): with the caller's own thread CPU, what its work cost the worker
        (`DiagnosisAgents.analysis_cpu_s`). A server's time on the calls is not in it."""
        return float(getattr(self._busy, "cpu", 0.0))

    async def _acall(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, functools.partial(self._guarded, fn, *args, **kwargs))

    async def _acall_first(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`_acall`, ahead of the calls waiting for the database thread (`urgent`)."""
        self._check_open()
        return await asyncio.wrap_future(self._executor.submit_first(
            True, functools.partial(self._guarded, fn, *args, **kwargs)))

    def _guarded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._thread = threading.get_ident()
        try:
            return fn(*args, **kwargs)
        except DriverError as e:
            raise from_driver(e) from None

    def _connect(self, settings: Mapping[str, Any] | None = None) -> Client:
        merged = {**self._cluster_settings, **(settings or {})}
        return clickhouse_connect.get_client(**client_args(self.target, merged))

    def _open(self, create: bool) -> Client:
        client = self._connect()
        try:
            if self.cluster:
                self._cluster_settings = cluster_settings(self._replicas(client))
                for name, value in self._cluster_settings.items():
                    client.set_client_setting(name, value)
            if create:
                client.command(cluster.create_database(self.database, self.cluster or None))
            client.database = self.database
            client.command("SELECT 1")  # fails now, not later, if the database is missing
        except BaseException:
            client.close()
            raise
        return client

    def _replicas(self, client: Client) -> int:
        """Replicas per shard of `self.cluster` (the same for every shard), from the server."""
        rows = client.query("SELECT shard_num, count() FROM system.clusters WHERE cluster = "
                            "{c:String} GROUP BY shard_num", parameters={"c": self.cluster}
                            ).result_rows
        counts = {int(n) for _, n in rows}
        if not counts:
            raise ClickHouseError(f"cluster {self.cluster!r} is not in the remote_servers of "
                                  f"{self.target.display()} (system.clusters); set "
                                  "RANKWATCH_CLICKHOUSE_CLUSTER to one of its clusters")
        if len(counts) > 1:
            raise ClickHouseError(f"cluster {self.cluster!r}: shards with {sorted(counts)} "
                                  "replicas; rankwatch needs the same number in every shard "
                                  "(an insert waits for all of a shard's replicas)")
        return counts.pop()

    # -- sync API ---------------------------------------------------------------------------

    @overload
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None,
              fmt: None = None) -> QueryResult: ...
    @overload
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None, *,
              fmt: str) -> bytes: ...
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None,
              fmt: str | None = None) -> QueryResult | bytes:
        """Rows as a clickhouse-connect QueryResult, or with `fmt` ClickHouse's formatted bytes.
        `parameters` bind server-side: `{name:Type}` placeholders."""
        return self._call(self._query, sql, parameters, fmt)

    def query_columns(self, sql: str,
                      parameters: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """The result as numpy columns by name (DateTime64 as datetime64[ns], strings as object).
        Read from ClickHouse's Native output by streams.native (numbers with one `frombuffer`,
        LowCardinality strings from their dictionary); results with other types (Nullable,
        Array, ...) go through clickhouse-connect's numpy reader, with the same dtypes."""
        return self._call(self._query_columns, sql, parameters)

    def query_coded(self, sql: str, parameters: Mapping[str, Any] | None = None
                    ) -> dict[str, np.ndarray | Coded]:
        """`query_columns`, but LowCardinality(String) columns come as `Coded` (distinct values
        + one int64 code per row, as ClickHouse sent them) when streams.native reads the
        result; results it does not read come as `query_columns` gives them."""
        return self._call(self._query_any, sql, parameters, True)

    def insert_columns(self, table: str, columns: Mapping[str, np.ndarray | Coded],
                       settings: Mapping[str, Any] | None = None) -> int:
        """Insert equal-length numpy columns into `table` in one column-oriented insert; returns
        the rows sent. Integer columns may feed DateTime64 columns (ticks: ns for DateTime64(9));
        string columns may be `Coded` (codes + distinct values). Tables whose every column type
        streams.native writes get a Native body built with numpy; others (arrays) go through
        clickhouse-connect's column writer."""
        return self._call(self._insert, table, columns, settings)

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> Any:
        """A statement without a result set (DDL, SET...); returns ClickHouse's summary/value."""
        return self._call(self._command, sql, parameters)

    def execute_sql(self, sql: str, fmt: str = "TabSeparated", *, readonly: bool = True,
                    limits: SqlLimits | None = None) -> bytes:
        """Run user SQL the way ClickHouse's HTTP interface does: `fmt` is the default format for
        statements that return rows and have no FORMAT clause; the reply is ClickHouse's text.
        Runs on the calling thread, on a session of its own (`user_sql.execute`)."""
        self._check_open()
        return self._execute_sql(sql, fmt, readonly, limits or SqlLimits())

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._call(self._client.close)
        finally:
            self._closed = True
            if self._sql_pool is not None:
                self._sql_pool.shutdown(wait=False, cancel_futures=True)
            # from the database thread itself (a callback), it cannot wait for itself
            self._executor.shutdown(wait=threading.get_ident() != self._thread)

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- async API (run on the database thread) ----------------------------------------------

    @overload
    async def aquery(self, sql: str, parameters: Mapping[str, Any] | None = None,
                     fmt: None = None) -> QueryResult: ...
    @overload
    async def aquery(self, sql: str, parameters: Mapping[str, Any] | None = None, *,
                     fmt: str) -> bytes: ...
    async def aquery(self, sql: str, parameters: Mapping[str, Any] | None = None,
                     fmt: str | None = None) -> QueryResult | bytes:
        return await self._acall(self._query, sql, parameters, fmt)

    async def aquery_columns(self, sql: str, parameters: Mapping[str, Any] | None = None
                             ) -> dict[str, np.ndarray]:
        return await self._acall(self._query_columns, sql, parameters)

    async def aquery_coded(self, sql: str, parameters: Mapping[str, Any] | None = None
                           ) -> dict[str, np.ndarray | Coded]:
        return await self._acall(self._query_any, sql, parameters, True)

    async def ainsert(self, table: str, columns: Mapping[str, np.ndarray | Coded],
                      settings: Mapping[str, Any] | None = None) -> int:
        return await self._acall(self._insert, table, columns, settings)

    #: The name streams.store uses.
    ainsert_columns = ainsert

    async def acommand(self, sql: str, parameters: Mapping[str, Any] | None = None, *,
                       urgent: bool = False) -> Any:
        """`command` from the event loop; `urgent`: ahead of the calls waiting for the
        database thread (a diagnosis's version, stored before it is announced, waited behind
        the ingest's inserts)."""
        if urgent:
            return await self._acall_first(self._command, sql, parameters)
        return await self._acall(self._command, sql, parameters)

    async def aexecute_sql(self, sql: str, fmt: str = "TabSeparated", *,
                           readonly: bool = True, limits: SqlLimits | None = None) -> bytes:
        """`execute_sql` on the SQL endpoint's own threads (`limits.concurrency` of them), never
        the database thread: a slow query does not hold up the writer's inserts."""
        self._check_open()
        limits = limits or SqlLimits()
        if self._sql_pool is None:
            self._sql_pool = ThreadPoolExecutor(limits.concurrency, thread_name_prefix="sql")
            # the worker's own nice value (this, the event loop's thread), plus the increment
            self._sql_nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + limits.nice)
        self._sql_ids += 1
        qid = self._sql_ids
        self.sql_inflight[qid] = (time.monotonic(), " ".join(sql.split())[:200])
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._sql_pool, self._execute_sql_niced, sql, fmt, readonly, limits)
        finally:
            self.sql_inflight.pop(qid, None)

    # -- implementations (database thread only) ---------------------------------------------

    def _query(self, sql: str, parameters: Mapping[str, Any] | None,
               fmt: str | None) -> QueryResult | bytes:
        params = dict(parameters) if parameters else None
        if fmt is None:
            return self._client.query(sql, parameters=params)
        return self._client.raw_query(sql, parameters=params, fmt=fmt)

    def _query_columns(self, sql: str,
                       parameters: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
        return cast(dict[str, np.ndarray], self._query_any(sql, parameters, False))

    def _query_any(self, sql: str, parameters: Mapping[str, Any] | None,
                   coded: bool) -> dict[str, np.ndarray | Coded]:
        params = dict(parameters) if parameters else None
        if sql not in self._generic_sql:
            data = self._client.raw_query(sql, parameters=params, fmt="Native")
            if not data:
                return dict(self._described(sql, params))
            try:
                return native.read_columns(data, coded=coded)[0]
            except native.Unsupported as e:
                # a type streams.native does not read: this SQL goes the generic way from now on
                # (several times slower: worth a CAST in the SQL when it runs every tick)
                if len(self._generic_sql) > 1024:
                    self._generic_sql.clear()
                self._generic_sql.add(sql)
                log.info("query result type %s is read by the generic reader: %.120s", e,
                         " ".join(sql.split()))
        ctx = self._client.create_query_context(query=sql, parameters=params, use_numpy=True)
        result: Any = self._client.query(context=ctx)  # a NumpyResult for a numpy context
        arr, names = result.np_result, result.column_names
        if arr.dtype.names:  # mixed types: a structured array
            return {n: np.ascontiguousarray(arr[n]) for n in names}
        if arr.ndim == 2:  # one dtype for every column: a 2-D array
            return {n: np.ascontiguousarray(arr[:, i]) for i, n in enumerate(names)}
        return dict(self._described(sql, params))

    def _described(self, sql: str, params: dict[str, Any] | None) -> dict[str, np.ndarray]:
        """Empty columns of `sql`'s result. With no rows chdb (and HTTP Native) send no block,
        so no column metadata: ask for it, once per SQL text (the derived runner and the
        diagnosis agents repeat theirs every tick with other parameters)."""
        shape = self._empty_shapes.get(sql)
        if shape is None:
            described = self._client.query(f"DESCRIBE ({sql})", parameters=params)
            shape = [(str(row[0]), _np_dtype(str(row[1]))) for row in described.result_rows]
            if len(self._empty_shapes) > 1024:
                self._empty_shapes.clear()
            self._empty_shapes[sql] = shape
        return {name: np.empty(0, dtype=dtype) for name, dtype in shape}

    def _command(self, sql: str, parameters: Mapping[str, Any] | None) -> Any:
        return self._client.command(sql, parameters=dict(parameters) if parameters else None)

    def _insert(self, table: str, columns: Mapping[str, np.ndarray | Coded],
                settings: Mapping[str, Any] | None) -> int:
        names = list(columns)
        lengths = {len(v) for v in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"insert into {table}: columns of unequal lengths {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        if n == 0:
            return 0
        shape = self._table_shape(table)
        unknown = [c for c in names if c not in shape.types]
        if unknown:
            raise ValueError(f"insert into {table}: no column(s) {unknown}")
        merged = {**CLIENT_SETTINGS, **(settings or {})}
        try:
            if all(native.supports(shape.type_names[c]) for c in names):
                body = native.native_block([(c, shape.type_names[c], columns[c]) for c in names])
                self._client.raw_insert(shape.table, names, body, settings=merged, fmt="Native")
            else:
                self._insert_generic(shape, names, columns, merged)
        except BaseException:
            self._shapes.pop(table, None)  # the table may have changed under us
            self._empty_shapes.clear()
            raise
        return n

    def _insert_generic(self, shape: _TableShape, names: list[str],
                        columns: Mapping[str, np.ndarray | Coded],
                        settings: dict[str, Any]) -> None:
        """clickhouse-connect's column writer, for types the Native writer lacks (arrays)."""
        col_types = [shape.types[c] for c in names]
        int_cols = {c: "int" for c, t in zip(names, col_types, strict=True)
                    if t.base_type.startswith("DateTime")}
        ctx = InsertContext(shape.table, names, col_types, column_oriented=True,
                            settings=settings, column_formats=dict(int_cols))
        ctx.data = [v.strings() if isinstance(v := columns[c], Coded) else v for c in names]
        self._client.insert(context=ctx)

    def _table_shape(self, table: str) -> _TableShape:
        cached = self._shapes.get(table)
        if cached is None:
            ctx = self._client.create_insert_context(table, "*")
            # LowCardinality(String) columns are sent as String and converted by ClickHouse:
            # the client builds LowCardinality dictionaries with a per-row Python loop.
            types = {n: _STRING if t.low_card and t.base_type == "String" else t
                     for n, t in zip(ctx.column_names, ctx.column_types, strict=True)}
            names = {n: t.name for n, t in zip(ctx.column_names, ctx.column_types, strict=True)}
            cached = _TableShape(ctx.table, types, names)
            self._shapes[table] = cached
        return cached

    def _execute_sql(self, sql: str, fmt: str, readonly: bool, limits: SqlLimits) -> bytes:
        return user_sql.execute(self.target, self.sql_target, self.database, sql, fmt,
                                readonly, limits)

    def _execute_sql_niced(self, sql: str, fmt: str, readonly: bool, limits: SqlLimits
                           ) -> bytes:
        """`_execute_sql` at the endpoint's lower priority (`SqlLimits.nice`)."""
        if limits.nice:
            set_thread_nice(self._sql_nice)
        return self._execute_sql(sql, fmt, readonly, limits)


def cluster_settings(replicas: int) -> dict[str, Any]:
    """What every request to a cluster carries, so that a read sees the rows just written:

    - ``distributed_foreground_insert=1``: an insert into a Distributed table returns once each
      shard has stored its rows (not when they are queued on the node that took the insert);
    - ``insert_quorum=<replicas>``: ... on every replica of the shard, so the replica a later
      read lands on (any: Distributed reads balance over replicas) has them. A shard with a
      replica down refuses inserts (TOO_FEW_LIVE_REPLICAS, an outage the writer retries)
      until it is back: rankwatch stalls rather than store rows a read would miss.
      ``insert_quorum_parallel`` stays on (several workers insert at once), which is why
      ``select_sequential_consistency`` (it needs it off) is not the means used.

    The deduplication token of a retried insert reaches each shard with the same rows, as the
    sharding key is a stable hash (streams.cluster)."""
    out: dict[str, Any] = {"distributed_foreground_insert": 1}
    if replicas > 1:
        out["insert_quorum"] = replicas
    return out


