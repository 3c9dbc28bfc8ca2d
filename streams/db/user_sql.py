"""User SQL: how a statement from the SQL endpoint (streams.sql_endpoint) or `rankwatch sql` runs.

Each call gets a fresh engine session of its own: `SqlLimits` (time, memory, result size,
threads) are set on it first, then `readonly=1` (a read-only call), so the query cannot raise
them. ClickHouse's own parser (`formatQuery`) then refuses anything but exactly one statement,
and its canonical text is what `refusal` checks and, read-only, what runs. The checks are made
on the engine's canonical form, never by matching the caller's text.

On a server the call runs as the endpoint's own user (`url.endpoint_target`), whose grants and
settings profile bind; see `execute` for what differs there.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import clickhouse_connect
from clickhouse_connect.driver.exceptions import ClickHouseError as DriverError

from streams.db.errors import ClickHouseError, coded, from_chdb, from_driver
from streams.db.url import Target, client_args

_STRIP = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|`(?:[^`\\]|\\.)*`|--[^\n]*|#[^\n]*"""
                    r"""|/\*.*?\*/""", re.S)
_HAS_FORMAT = re.compile(r"\bFORMAT\s+\w+\s*(?:SETTINGS\b.*)?;?\s*$", re.I | re.S)
_ROWS = re.compile(r"^[\s(]*(SELECT|WITH|SHOW|DESC|DESCRIBE|EXPLAIN|EXISTS|CHECK)\b", re.I)
_FORMAT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OUTFILE = re.compile(r"^INTO\s+OUTFILE\b", re.M)

#: What the read-only endpoint runs: statements whose canonical form (the engine's formatter)
#: starts with one of these. SYSTEM, KILL, USE, SET and the rest are refused: chdb runs every
#: query as its `default` user with every grant and has no access storage for a user of our own,
#: and `readonly=1` alone lets SYSTEM and KILL through there.
READ_STATEMENTS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS", "(")


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
    #: A query in flight this long past `max_execution_time_s` is stuck (the endpoint's /ping).
    stuck_grace_s: float = 30.0
    #: How much lower the CPU priority of the endpoint's queries is than the worker's own
    #: threads (Linux nice increment, 0-19), so that under a storm of queries ingest, windows
    #: and diagnosis get the CPU first (`rankwatch bench storm`). Set on the endpoint's thread
    #: before each query (`Database.aexecute_sql`; lowering one's own priority needs no
    #: privilege: ClickHouse puts a thread it reniced back to 0 when the query ends) and,
    #: embedded, on the engine's query threads (`os_thread_priority`, which ClickHouse applies
    #: only with CAP_SYS_NICE and otherwise ignores).
    nice: int = 10

    def settings(self, embedded: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_execution_time": self.max_execution_time_s, "timeout_overflow_mode": "throw",
            "max_memory_usage": self.max_memory_bytes,
            "max_result_rows": self.max_result_rows, "max_result_bytes": self.max_result_bytes,
            "result_overflow_mode": "throw", "max_threads": self.max_threads,
        }
        if embedded:  # chdb's own: python(name) reads objects of this process
            out["allow_python_table_function"] = 0
            if self.nice:
                out["os_thread_priority"] = min(19, self.nice)  # absolute: the worker runs at 0
        return out


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


def set_thread_nice(nice: int) -> bool:
    """Give the calling thread Linux nice value `nice` (a thread's nice value is its own);
    False where it could not (not Linux; raising priority needs privilege)."""
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) != nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except (OSError, AttributeError):
        return False


def _escape_param(value: str) -> str:
    """A query parameter's value in ClickHouse's escaped form (parameters are parsed as such)."""
    return (value.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
            .replace("\r", "\\r").replace("\0", "\\0"))


def execute(target: Target, sql_target: Target, database: str, sql: str, fmt: str,
            readonly: bool, limits: SqlLimits) -> bytes:
    """Run `sql` in `database` on a fresh session of its own, on the calling thread: the limits,
    then `readonly=1` (read-only calls), then the engine's parser: `formatQuery` refuses
    anything but exactly one statement, and its canonical text is checked (`refusal`) and,
    read-only, is what runs. `fmt` is the default format for statements that return rows and
    name none; the reply is ClickHouse's output. `sql_target` is where it runs on a server."""
    if not _FORMAT_NAME.match(fmt):
        raise ClickHouseError(
            f"Code: 73. DB::Exception: Unknown format {fmt}. (UNKNOWN_FORMAT)", 73)
    settings = limits.settings(target.embedded)
    if not target.embedded:
        return _execute_http(sql_target, database, sql, fmt, readonly, settings)
    return _execute_embedded(target.path, database, sql, fmt, readonly, settings)


def _execute_embedded(path: str, database: str, sql: str, fmt: str, readonly: bool,
                      settings: dict[str, Any]) -> bytes:
    """The embedded engine: a chdb connection of its own (a session) on the engine this
    process holds, the session settings made with SET before the statement."""
    import chdb  # the embedded engine is loaded already (this process holds the database)

    try:
        conn = chdb.connect(path)  # type: ignore[no-untyped-call]
    except Exception as e:
        raise from_chdb(e) from None
    try:
        def run(query: str, out: str = "TSVRaw", params: dict[str, str] | None = None) -> bytes:
            try:
                return bytes(conn.query(query, out, params=params or {}).bytes())
            except Exception as e:  # chdb's errors carry ClickHouse's text
                raise from_chdb(e) from None

        run(f"USE `{database}`")
        for name, value in settings.items():
            run(f"SET {name} = {value!r}")
        if readonly:
            run("SET readonly = 1")
        canonical = run("SELECT formatQuery({q:String})",
                        params={"q": _escape_param(sql)}).decode().rstrip("\n")
        why = refusal(canonical, readonly)
        if why:
            raise coded(why)
        # read-only: what was checked is what runs; writable: the caller's text (the
        # formatter leaves out an INSERT's inline data)
        return run(canonical if readonly else sql, fmt)
    finally:
        conn.close()


def _execute_http(sql_target: Target, database: str, sql: str, fmt: str, readonly: bool,
                  settings: dict[str, Any]) -> bytes:
    """A server: a client of its own per call (no session id: every request is its own
    session), as `sql_target`'s user; the server refuses INTO OUTFILE and several statements
    over HTTP itself, and enforces that user's grants and profile. readonly=2 here, not 1:
    readonly=1 in a request would refuse the request's own limits. readonly=2 alone lets a
    query's SETTINGS raise the limits, and (chdb shows it) leaves file() and temporary tables
    allowed: what binds on a server is the endpoint's own user with SELECT alone and the
    `rankwatch_sql` profile's constraints (docs/architecture.md). Not run against a server
    here (none in the test environment)."""
    if readonly:
        settings = {**settings, "readonly": 2}
    client = clickhouse_connect.get_client(**client_args(sql_target, settings))
    try:
        client.database = database
        canonical = str(client.command("SELECT formatQuery({q:String})",
                                       parameters={"q": sql}))
        why = refusal(canonical, readonly)
        if why:
            raise coded(why)
        return client.raw_query(sql, fmt=fmt if wants_format(sql) else None)
    except DriverError as e:
        raise from_driver(e) from None
    finally:
        client.close()
