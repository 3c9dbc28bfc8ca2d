"""ClickHouse access: one client on one thread, the SQL helpers the endpoint needs, and migrations.

`Database` owns ONE clickhouse-connect client for `chdb:///<dir>` (the embedded engine, in this
process) or `http(s)://user:pass@host:port` (a server) and a single-thread executor through which
every call goes: chdb is not used from several threads at once, and the Faust worker's event loop
awaits the `a*` wrappers instead of blocking. A sync method called from that thread runs inline.

Contract:
- Errors from ClickHouse surface as `ClickHouseError` whose `message` is ClickHouse's own text
  ("Code: 60. DB::Exception: ..."). Opening an embedded directory that another process holds
  raises `EmbeddedDatabaseBusy`.
- `insert_columns` sends one Native insert, built by streams.native from numpy columns (string
  columns may come dictionary-encoded, `ingest.batch.Coded`, and go to LowCardinality columns as
  codes + dictionary); int64 nanoseconds go into `DateTime64(9)` columns as raw ticks (no
  datetime objects anywhere).
- `execute_sql` is the SQL endpoint's path (see "The SQL endpoint's path" below): ClickHouse's
  formatted output as bytes, one statement per call, on a fresh engine session of its own with
  `readonly=1` and `SqlLimits` set before it, on a thread of its own (never the writer's).

Migrations (`migrate`) are the numbered files in sql/ (see sql/README.md): applied in order, each
recorded in `schema_migrations` with its checksum; editing an applied file is an error.
Statements use unqualified table names and land in the database the `Database` was opened on.
With `cluster` (a server's cluster), each statement runs in its ON CLUSTER form
(streams.cluster: replicated tables behind Distributed ones of the same names) and every
request carries `cluster_settings`, so the code reads and writes the same tables either way.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, overload
from urllib.parse import parse_qsl, unquote, urlsplit

import clickhouse_connect
import numpy as np
from clickhouse_connect.datatypes.registry import get_from_name
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError as _DriverError
from clickhouse_connect.driver.insert import InsertContext
from clickhouse_connect.driver.query import QueryResult

from ingest.batch import Coded
from streams import cluster, native

log = logging.getLogger(__name__)

T = TypeVar("T")

BUSY_HINT = ("the embedded database is held by another process; start the worker (`rankwatch up`) "
             "so queries go through it")
#: Settings every connection starts with: synchronous inserts (chdb defaults async_insert=1).
CLIENT_SETTINGS: dict[str, Any] = {"async_insert": 0}
_STRING = get_from_name("String")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ClickHouseError(RuntimeError):
    """A failed ClickHouse call. `message` is ClickHouse's own text, `code` its error code."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message, self.code = message, code


class EmbeddedDatabaseBusy(ClickHouseError):
    """Another process holds the embedded data directory (chdb allows one process per dir)."""


class MigrationError(RuntimeError):
    """A migration file is malformed, or changed after it was applied."""


def _message(e: BaseException) -> str:
    """ClickHouse's message without the driver's preamble (HTTP URL, "Unable to open ...")."""
    text = str(e).strip()
    at = text.find("Code: ")
    return text[at:] if at > 0 else text


def _np_dtype(type_name: str) -> np.dtype[Any]:
    try:
        return np.dtype(get_from_name(type_name).np_type)
    except Exception:  # types with no numpy equivalent come back as objects, as query_np does
        return np.dtype(object)


def _wrap(e: _DriverError) -> ClickHouseError:
    message = _message(e)
    if "Error initializing EmbeddedServer" in message:
        return EmbeddedDatabaseBusy(f"{BUSY_HINT} ({message})", getattr(e, "code", None))
    return ClickHouseError(message, getattr(e, "code", None))


# ---------------------------------------------------------------------------------------------
# URLs


@dataclass(frozen=True)
class Target:
    """Where ClickHouse is: the embedded engine at `path`, or a server."""

    scheme: Literal["chdb", "http", "https"]
    path: str = ""  # chdb data directory; ":memory:" for an in-memory engine
    host: str = ""
    port: int = 0
    username: str = ""
    password: str = field(default="", repr=False)
    options: tuple[tuple[str, str], ...] = ()

    @property
    def embedded(self) -> bool:
        return self.scheme == "chdb"

    def display(self) -> str:
        """The URL without its password, for messages and logs."""
        if self.embedded:
            return f"chdb://{self.path}"
        user = f"{self.username}@" if self.username else ""
        return f"{self.scheme}://{user}{self.host}:{self.port}"


def parse_url(url: str) -> Target:
    """Parse `chdb:///abs/dir`, `chdb://rel/dir`, `chdb://memory` or
    `http(s)://[user[:password]@]host[:port][/][?option=value...]`.

    The database is not part of the URL (it is settings.clickhouse_database): an HTTP URL with a
    path is refused rather than silently ignored. Options pass through to clickhouse-connect.
    """
    if url.startswith("chdb://"):
        rest, _, query = url[len("chdb://"):].partition("?")
        if query:
            raise ValueError(f"{url!r}: chdb URLs take no options")
        if rest in ("", "memory", ":memory:"):
            return Target("chdb", ":memory:")
        return Target("chdb", str(Path(unquote(rest)).expanduser().resolve()))
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: expected chdb://, http:// or https://")
    if not parts.hostname:
        raise ValueError(f"{url!r}: no host")
    if parts.path not in ("", "/"):
        raise ValueError(f"{url!r}: the database is not part of the URL; "
                         "set RANKWATCH_CLICKHOUSE_DATABASE instead")
    try:
        port = parts.port or (8443 if parts.scheme == "https" else 8123)
    except ValueError as e:
        raise ValueError(f"{url!r}: {e}") from None
    scheme: Literal["http", "https"] = "https" if parts.scheme == "https" else "http"
    return Target(scheme, "", parts.hostname, port, unquote(parts.username or ""),
                  unquote(parts.password or ""), tuple(parse_qsl(parts.query)))


def client_args(target: Target, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for `clickhouse_connect.get_client` (no database: it may not exist yet).
    HTTP clients get no session id, so every request is its own session, as on chdb."""
    merged = {**CLIENT_SETTINGS, **(settings or {})}
    if target.embedded:
        return {"interface": "chdb", "path": target.path, "settings": merged}
    return {"interface": target.scheme, "host": target.host, "port": target.port,
            "username": target.username or None, "password": target.password,
            "autogenerate_session_id": False, "settings": merged, **dict(target.options)}


# ---------------------------------------------------------------------------------------------
# SQL text helpers (the endpoint's read-only guard and default format)

_STRIP = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|`(?:[^`\\]|\\.)*`|--[^\n]*|#[^\n]*"""
                    r"""|/\*.*?\*/""", re.S)
_HAS_FORMAT = re.compile(r"\bFORMAT\s+\w+\s*(?:SETTINGS\b.*)?;?\s*$", re.I | re.S)
_ROWS = re.compile(r"^[\s(]*(SELECT|WITH|SHOW|DESC|DESCRIBE|EXPLAIN|EXISTS|CHECK)\b", re.I)


def strip_sql(sql: str) -> str:
    """SQL with string literals, quoted names and comments blanked out, for keyword checks."""
    return _STRIP.sub(" ", sql)


def wants_format(sql: str) -> bool:
    """True when `sql` returns rows and has no FORMAT clause of its own, so the caller's default
    format applies (ClickHouse's HTTP `default_format` rule; chdb has no such setting)."""
    bare = strip_sql(sql)
    return bool(_ROWS.match(bare)) and not _HAS_FORMAT.search(bare)


@dataclass(frozen=True)
class SqlLimits:
    """What one query through the SQL endpoint may use. Set on its session before `readonly=1`,
    so the query cannot raise them (ClickHouse refuses any setting change in readonly=1, in SET
    and in a SETTINGS clause alike). `concurrency` queries run at once, each on its own thread;
    `queue` more may wait for one, the rest are refused (HTTP 503)."""

    max_execution_time_s: int = 60
    max_memory_bytes: int = 2 << 30
    max_result_rows: int = 10_000_000
    max_result_bytes: int = 512 << 20
    max_threads: int = 2
    concurrency: int = 2
    queue: int = 8

    def settings(self, embedded: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_execution_time": self.max_execution_time_s, "timeout_overflow_mode": "throw",
            "max_memory_usage": self.max_memory_bytes,
            "max_result_rows": self.max_result_rows, "max_result_bytes": self.max_result_bytes,
            "result_overflow_mode": "throw", "max_threads": self.max_threads,
        }
        if embedded:  # chdb's own: python(name) reads objects of this process
            out["allow_python_table_function"] = 0
        return out


#: What the read-only endpoint runs: statements whose canonical form (the engine's formatter)
#: starts with one of these. SYSTEM, KILL, USE, SET and the rest are refused: chdb runs every
#: query as its `default` user with every grant and has no access storage for a user of our own,
#: and `readonly=1` alone lets SYSTEM and KILL through there.
READ_STATEMENTS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS", "(")
_OUTFILE = re.compile(r"^INTO\s+OUTFILE\b", re.M)
_CODE = re.compile(r"Code: (\d+)\.")


def _escape_param(value: str) -> str:
    """A query parameter's value in ClickHouse's escaped form (parameters are parsed as such)."""
    return (value.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
            .replace("\r", "\\r").replace("\0", "\\0"))


def refusal(canonical: str, readonly: bool) -> str | None:
    """Why the statement whose canonical text (ClickHouse's `formatQuery`) is `canonical` is
    refused, or None. The formatter writes a statement's clauses on lines of their own and
    escapes line breaks inside literals and quoted names, so a line starting with INTO OUTFILE
    is that clause and nothing else."""
    if _OUTFILE.search(canonical):
        return ("Code: 344. DB::Exception: rankwatch SQL endpoint: INTO OUTFILE writes a file "
                "on the worker's machine; it is not allowed. (INTO_OUTFILE_NOT_ALLOWED)")
    if readonly and not canonical.lstrip().upper().startswith(READ_STATEMENTS):
        first = canonical.split(None, 1)[0] if canonical.split() else ""
        return (f"Code: 164. DB::Exception: rankwatch SQL endpoint: {first} statements are not "
                f"allowed; read-only: {', '.join(READ_STATEMENTS[:-1])}. (READONLY)")
    return None


# ---------------------------------------------------------------------------------------------
# The database


@dataclass(frozen=True)
class _TableShape:
    """A table's insert columns: its qualified name, clickhouse-connect types, type names."""

    table: str
    types: dict[str, Any]
    type_names: dict[str, str]


class Database:
    """One ClickHouse database (`database`) at `url`, accessed from one thread. See module doc."""

    def __init__(self, url: str, database: str, *, create: bool = True,
                 cluster: str = "") -> None:
        if not _IDENT.match(database):
            raise ValueError(f"database {database!r}: expected letters, digits and underscores")
        if cluster and not _IDENT.match(cluster):
            raise ValueError(f"cluster {cluster!r}: expected letters, digits and underscores")
        self.target = parse_url(url)
        if cluster and self.target.embedded:
            raise ValueError(f"cluster {cluster!r} needs a ClickHouse server "
                             "(RANKWATCH_CLICKHOUSE_URL=http://...): the embedded engine is "
                             "one node; unset RANKWATCH_CLICKHOUSE_CLUSTER to use it")
        self.database = database
        #: The server's cluster (remote_servers) the schema spans; "" on one node. See
        #: streams.cluster for the tables, `cluster_settings` for how writes are read back.
        self.cluster = cluster
        self._cluster_settings: dict[str, Any] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"clickhouse-{database}")
        self._thread: int | None = None
        #: The SQL endpoint's threads (`aexecute_sql`), made on first use; queries in flight
        #: there: id -> (time.monotonic() at start, the SQL's first 200 characters).
        self._sql_pool: ThreadPoolExecutor | None = None
        self.sql_inflight: dict[int, tuple[float, str]] = {}
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

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the database thread and wait; inline when already on it."""
        if self._closed:
            raise ClickHouseError(f"database {self.database} at {self.target.display()} is closed")
        if threading.get_ident() == self._thread:
            return self._guarded(fn, *args, **kwargs)
        future: Future[T] = self._executor.submit(self._guarded, fn, *args, **kwargs)
        return future.result()

    async def _acall(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._closed:
            raise ClickHouseError(f"database {self.database} at {self.target.display()} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, functools.partial(self._guarded, fn, *args, **kwargs))

    def _guarded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._thread = threading.get_ident()
        try:
            return fn(*args, **kwargs)
        except _DriverError as e:
            raise _wrap(e) from None

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
        Runs on the calling thread, on a session of its own (see `_execute_sql`)."""
        if self._closed:
            raise ClickHouseError(f"database {self.database} at {self.target.display()} is closed")
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

    async def acommand(self, sql: str, parameters: Mapping[str, Any] | None = None) -> Any:
        return await self._acall(self._command, sql, parameters)

    async def aexecute_sql(self, sql: str, fmt: str = "TabSeparated", *,
                           readonly: bool = True, limits: SqlLimits | None = None) -> bytes:
        """`execute_sql` on the SQL endpoint's own threads (`limits.concurrency` of them), never
        the database thread: a slow query does not hold up the writer's inserts."""
        if self._closed:
            raise ClickHouseError(f"database {self.database} at {self.target.display()} is closed")
        limits = limits or SqlLimits()
        if self._sql_pool is None:
            self._sql_pool = ThreadPoolExecutor(limits.concurrency, thread_name_prefix="sql")
        self._sql_ids += 1
        qid = self._sql_ids
        self.sql_inflight[qid] = (time.monotonic(), " ".join(sql.split())[:200])
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._sql_pool, self._execute_sql, sql, fmt, readonly, limits)
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
        """One caller's statement on a fresh session: the limits, then `readonly=1` (read-only
        calls), then the engine's parser: `formatQuery` refuses anything but exactly one
        statement, and its canonical text is checked (`refusal`) and, read-only, is what
        runs."""
        if not _IDENT.match(fmt):
            raise ClickHouseError(
                f"Code: 73. DB::Exception: Unknown format {fmt}. (UNKNOWN_FORMAT)", 73)
        settings = limits.settings(self.target.embedded)
        if not self.target.embedded:
            return self._execute_sql_http(sql, fmt, readonly, settings)
        import chdb  # the embedded engine is loaded already (this process holds the database)

        try:
            conn = chdb.connect(self.target.path)  # type: ignore[no-untyped-call]
        except Exception as e:
            raise _chdb_error(e) from None
        try:
            def run(query: str, out: str = "TSVRaw", params: dict[str, str] | None = None
                    ) -> bytes:
                try:
                    return bytes(conn.query(query, out, params=params or {}).bytes())
                except Exception as e:  # chdb's errors carry ClickHouse's text
                    raise _chdb_error(e) from None

            run(f"USE `{self.database}`")
            for name, value in settings.items():
                run(f"SET {name} = {value!r}")
            if readonly:
                run("SET readonly = 1")
            canonical = run("SELECT formatQuery({q:String})",
                            params={"q": _escape_param(sql)}).decode().rstrip("\n")
            why = refusal(canonical, readonly)
            if why:
                raise ClickHouseError(why, int(_CODE.search(why).group(1)))  # type: ignore[union-attr]
            # read-only: what was checked is what runs; writable: the caller's text (the
            # formatter leaves out an INSERT's inline data)
            return run(canonical if readonly else sql, fmt)
        finally:
            conn.close()

    def _execute_sql_http(self, sql: str, fmt: str, readonly: bool,
                          settings: dict[str, Any]) -> bytes:
        """A server: a client of its own per call (no session id: every request is its own
        session); the server refuses INTO OUTFILE and several statements over HTTP itself, and
        enforces its user's grants and profile. readonly=2 here, not 1: readonly=1 in a request
        would refuse the request's own limits. So on a server the limits are defaults a query's
        SETTINGS could raise: give rankwatch's user a profile with readonly=1 and constraints
        (ClickHouse's settings profiles) to make them binding; not tested here (no server)."""
        if readonly:
            settings = {**settings, "readonly": 2}
        client = self._connect(settings)
        try:
            client.database = self.database
            canonical = str(client.command("SELECT formatQuery({q:String})",
                                           parameters={"q": sql}))
            why = refusal(canonical, readonly)
            if why:
                raise ClickHouseError(why, int(_CODE.search(why).group(1)))  # type: ignore[union-attr]
            return client.raw_query(sql, fmt=fmt if wants_format(sql) else None)
        except _DriverError as e:
            raise _wrap(e) from None
        finally:
            client.close()


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


def _chdb_error(e: BaseException) -> ClickHouseError:
    message = _message(e)
    code = _CODE.search(message)
    return ClickHouseError(message, int(code.group(1)) if code else None)


# ---------------------------------------------------------------------------------------------
# Migrations

_MIGRATION_NAME = re.compile(r"^(\d{3,})_([a-z0-9_]+)\.sql$")
_MIGRATIONS_TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations (
    version UInt32, name String, checksum String, applied_at DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree(applied_at) ORDER BY version"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str  # file name without .sql, e.g. "001_raw"
    checksum: str  # sha256 of the file's bytes
    statements: tuple[str, ...]


def migrations_dir() -> Path:
    """sql/ beside the packages (source tree, editable install), else a copy inside streams/."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "sql", here / "sql"):
        if candidate.is_dir():
            return candidate
    raise MigrationError(f"no sql/ directory found beside {here}")


def split_statements(text: str) -> list[str]:
    """Split a migration into statements: a statement ends at a line ending with `;`. Pieces that
    hold only comments and blank lines are dropped."""
    out, current = [], []
    for line in text.splitlines():
        current.append(line)
        if line.rstrip().endswith(";"):
            out.append("\n".join(current).rstrip()[:-1])
            current = []
    out.append("\n".join(current))
    return [s.strip() for s in out if strip_sql(s).strip(" \n\t;")]


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """Every `NNN_name.sql` in `directory` (default `migrations_dir()`), ordered by version.
    Files whose names start with a digit must follow that pattern; other files are ignored."""
    directory = directory or migrations_dir()
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        if not path.name[:1].isdigit():
            continue
        m = _MIGRATION_NAME.match(path.name)
        if not m:
            raise MigrationError(f"{path}: migration files are named NNN_lower_case_name.sql")
        version = int(m.group(1))
        if version in found:
            raise MigrationError(f"{path}: version {version} is also {found[version].name}.sql")
        data = path.read_bytes()
        statements = tuple(split_statements(data.decode()))
        if not statements:
            raise MigrationError(f"{path}: no statements")
        found[version] = Migration(version, path.stem, hashlib.sha256(data).hexdigest(),
                                   statements)
    return [found[v] for v in sorted(found)]


def applied_statements(db: Database, statement: str) -> list[str]:
    """`statement` as it runs on `db`: as written, or its ON CLUSTER form (streams.cluster)."""
    try:
        return cluster.statements(statement, db.cluster or None, db.database)
    except cluster.ClusterFormError as e:
        raise MigrationError(str(e)) from None


def applied_migrations(db: Database) -> dict[int, tuple[str, str]]:
    """version -> (name, checksum) of the migrations recorded in `db`."""
    for statement in applied_statements(db, _MIGRATIONS_TABLE):
        db.command(statement)
    rows = db.query("SELECT version, argMax(name, applied_at), argMax(checksum, applied_at) "
                    "FROM schema_migrations GROUP BY version").result_rows
    return {int(v): (str(n), str(c)) for v, n, c in rows}


def migrate(db: Database, directory: Path | None = None) -> list[Migration]:
    """Apply the migrations `db` lacks, in order; return those applied (empty when up to date).

    A migration is recorded only after all its statements succeed; ClickHouse DDL is not
    transactional, so statements must be idempotent (`IF NOT EXISTS`) for a re-run after a
    failure midway. Raises MigrationError when an applied file's checksum changed.
    """
    migrations = load_migrations(directory)
    done = applied_migrations(db)
    for mig in migrations:
        if mig.version in done and done[mig.version][1] != mig.checksum:
            raise MigrationError(
                f"migration {mig.name}.sql changed after it was applied to database "
                f"{db.database} (recorded checksum {done[mig.version][1][:12]}, file "
                f"{mig.checksum[:12]}); applied migrations are immutable: revert the file and "
                "add a new numbered migration")
    applied = []
    for mig in migrations:
        if mig.version in done:
            continue
        for statement in mig.statements:
            for sql in applied_statements(db, statement):
                db.command(sql)
        record_migration(db, mig)
        applied.append(mig)
    return applied


def record_migration(db: Database, mig: Migration) -> None:
    db.insert_columns("schema_migrations", {
        "version": np.array([mig.version], np.uint32),
        "name": np.array([mig.name], object),
        "checksum": np.array([mig.checksum], object),
        "applied_at": np.array([time.time_ns() // 1_000_000], np.int64),
    })


__all__: Sequence[str] = (
    "BUSY_HINT", "ClickHouseError", "Database", "EmbeddedDatabaseBusy", "Migration",
    "MigrationError", "SqlLimits", "Target", "applied_migrations", "applied_statements",
    "client_args", "cluster_settings", "load_migrations", "migrate", "migrations_dir",
    "parse_url", "refusal", "split_statements", "strip_sql", "wants_format",
)
