"""The worker's SQL endpoint: other processes query the embedded database the worker owns.

Only one process may open an embedded ClickHouse directory, so the worker serves SQL over HTTP,
speaking the part of ClickHouse's HTTP interface that `rankwatch sql` and curl need:

    GET  /ping                       -> "Ok."
    POST /?default_format=PrettyCompact   body: the SQL
    GET  /?query=SELECT+1&format=JSON

`query` (URL) and the body are joined as ClickHouse does. The format applies to statements that
return rows and have no FORMAT clause of their own; the reply is ClickHouse's own output. A query
error is HTTP 400 with ClickHouse's message (no traceback).

What the engine enforces (streams.db.user_sql): every request gets a fresh engine
session; `SqlLimits` (time, memory, result size, threads) are set on it and then `readonly=1`, so
a caller can change no setting (SET or SETTINGS alike) and write nothing; table functions that
reach files, URLs, other servers or programs (file, url, s3, remote, mysql, executable, ...) are
refused by readonly=1, chdb's python() by a setting; exactly one statement, parsed by the
engine's own parser, which must be a read (SELECT, SHOW, DESCRIBE, EXPLAIN, EXISTS; SYSTEM and
KILL are refused: chdb's only user holds every grant); INTO OUTFILE is refused. Queries run on
threads of their own, `limits.concurrency` at a time and `limits.queue` waiting, never on the
writer's thread. `writable` drops readonly=1 and the statement check (an operator's choice).

Authentication: with a `token`, every request but /ping must carry it (`Authorization: Bearer`,
basic auth with the token as password, or `X-ClickHouse-Key`). Serving anywhere but loopback
without a token is refused.

`/ping` answers "Ok." when the worker's health checks pass, else HTTP 503 naming the problems
(a stalled consumer, a stuck query, ...). Either way the lines after the first carry `notes`:
what is wrong but not with this process now, e.g. a crash loop of the worker (recent unclean
exits, rankwatch.stack.crash_loop) — 200 while the restarted worker is itself healthy, so a
readiness check (`rankwatch up`, a container health check) does not reject a worker that
recovered, while a reader of the body sees the crashes.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import ipaddress
import logging
import time
from collections.abc import Callable

from aiohttp import web

from streams.db import ClickHouseError, Database, SqlLimits

log = logging.getLogger(__name__)

#: Output formats the endpoint accepts by name (ClickHouse's names and aliases).
FORMATS: frozenset[str] = frozenset({
    "Pretty", "PrettyCompact", "PrettyCompactMonoBlock", "PrettySpace", "PrettyNoEscapes",
    "TSV", "TabSeparated", "TSVWithNames", "TabSeparatedWithNames", "TSVWithNamesAndTypes",
    "TabSeparatedWithNamesAndTypes", "TSVRaw", "CSV", "CSVWithNames", "CSVWithNamesAndTypes",
    "JSONEachRow", "JSON", "JSONCompact", "JSONCompactEachRow", "JSONLines", "NDJSON",
    "Vertical", "Markdown", "Values", "XML",
})
DEFAULT_FORMAT = "TabSeparated"
MAX_QUERY_BYTES = 16 * 1024 * 1024

_CONTENT_TYPES = {"JSON": "application/json", "JSONCompact": "application/json",
                  "CSV": "text/csv", "CSVWithNames": "text/csv", "XML": "application/xml"}

DB_KEY: web.AppKey[Database] = web.AppKey("db", Database)
WRITABLE_KEY: web.AppKey[bool] = web.AppKey("writable", bool)
GATE_KEY: web.AppKey[_Gate] = web.AppKey("gate")

Health = Callable[[], list[str]]


class _Gate:
    """Who may query and how many at once."""

    def __init__(self, token: str, limits: SqlLimits, health: Health | None,
                 notes: Health | None = None) -> None:
        self.token = token
        self.limits = limits
        self.health, self.notes = health, notes
        self.running = asyncio.Semaphore(limits.concurrency)
        self.waiting = 0

    def allowed(self, request: web.Request) -> bool:
        if not self.token:
            return True
        given = request.headers.get("X-ClickHouse-Key", "")
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[7:].strip()
        elif auth.startswith("Basic "):
            try:
                given = base64.b64decode(auth[6:]).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                given = ""
        return hmac.compare_digest(given.encode(), self.token.encode())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def stuck_queries(db: Database, limits: SqlLimits, now: float | None = None) -> list[str]:
    """Queries in flight longer than their time limit plus `limits.stuck_grace_s`."""
    now = time.monotonic() if now is None else now
    over = limits.max_execution_time_s + limits.stuck_grace_s
    return [f"a SQL query has run {now - t0:.0f} s (limit {limits.max_execution_time_s} s): "
            f"{text[:80]}" for t0, text in list(db.sql_inflight.values()) if now - t0 > over]


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message.rstrip("\n") + "\n",
                        content_type="text/plain", charset="utf-8")


async def _ping(request: web.Request) -> web.Response:
    gate = request.app[GATE_KEY]
    problems = stuck_queries(request.app[DB_KEY], gate.limits)
    if gate.health is not None:
        try:
            problems += gate.health()
        except Exception as e:  # a broken check is a problem to report, not a crash
            problems.append(f"health check failed: {type(e).__name__}: {e}")
    notes = []
    if gate.notes is not None:
        try:
            notes = gate.notes()
        except Exception as e:
            notes = [f"notes failed: {type(e).__name__}: {e}"]
    tail = "".join(f"note: {n}\n" for n in notes)
    if problems:
        return _error(503, "rankwatch worker unhealthy: " + "; ".join(problems) + "\n" + tail)
    return web.Response(text="Ok.\n" + tail, content_type="text/plain")


async def _query(request: web.Request) -> web.Response:
    gate = request.app[GATE_KEY]
    if not gate.allowed(request):
        resp = _error(401, "Code: 516. DB::Exception: rankwatch SQL endpoint: a token is "
                           "required (Authorization: Bearer <RANKWATCH_SQL_TOKEN>). "
                           "(AUTHENTICATION_FAILED)")
        resp.headers["WWW-Authenticate"] = 'Basic realm="rankwatch"'
        return resp
    if gate.running.locked() and gate.waiting >= gate.limits.queue:
        return _error(503, "Code: 202. DB::Exception: rankwatch SQL endpoint: too many queries "
                           f"at once ({gate.limits.concurrency} running, {gate.waiting} "
                           "waiting); retry later. (TOO_MANY_SIMULTANEOUS_QUERIES)")
    gate.waiting += 1
    try:
        await gate.running.acquire()
    finally:
        gate.waiting -= 1
    try:
        return await _run_query(request, gate)
    finally:
        gate.running.release()


async def _run_query(request: web.Request, gate: _Gate) -> web.Response:
    fmt = request.query.get("default_format") or request.query.get("format") or DEFAULT_FORMAT
    if fmt not in FORMATS:
        return _error(400, f"Code: 73. DB::Exception: Unknown or unsupported format {fmt!r}; "
                           f"use one of {', '.join(sorted(FORMATS))}. (UNKNOWN_FORMAT)")
    body = (await request.read()).decode("utf-8", errors="replace") if request.can_read_body \
        else ""
    sql = "\n".join(part for part in (request.query.get("query", ""), body) if part.strip())
    if not sql.strip():
        return _error(400, "Code: 62. DB::Exception: Empty query. (SYNTAX_ERROR)")
    db, writable = request.app[DB_KEY], request.app[WRITABLE_KEY]
    try:
        out = await db.aexecute_sql(sql, fmt, readonly=not writable, limits=gate.limits)
    except ClickHouseError as e:
        return _error(400, e.message)
    except Exception as e:  # never a traceback to the caller; the worker's log has it
        log.exception("SQL endpoint: query failed")
        return _error(500, f"rankwatch SQL endpoint: {type(e).__name__}: {e}")
    return web.Response(body=out, headers={"X-ClickHouse-Format": fmt},
                        content_type=_CONTENT_TYPES.get(fmt, "text/plain"), charset="utf-8")


def make_app(db: Database, writable: bool = False, *, token: str = "",
             limits: SqlLimits | None = None, health: Health | None = None,
             notes: Health | None = None) -> web.Application:
    """The endpoint's aiohttp application over `db` (read-only unless `writable`); `health`
    and `notes` feed /ping (module docstring)."""
    app = web.Application(client_max_size=MAX_QUERY_BYTES)
    app[DB_KEY] = db
    app[WRITABLE_KEY] = writable
    app[GATE_KEY] = _Gate(token, limits or SqlLimits(), health, notes)
    app.router.add_get("/ping", _ping)
    app.router.add_route("GET", "/", _query)
    app.router.add_route("POST", "/", _query)
    return app


async def start_sql_endpoint(db: Database, host: str = "127.0.0.1", port: int = 8124,
                             writable: bool = False, *, token: str = "",
                             limits: SqlLimits | None = None,
                             health: Health | None = None,
                             notes: Health | None = None) -> web.AppRunner:
    """Serve `make_app(db, writable, ...)` on host:port until `stop_sql_endpoint`. Raises OSError
    when the port is taken, ValueError when `host` is not loopback and there is no `token`. Port
    0 picks a free port: read it with `bound_port(runner)`."""
    if not is_loopback(host):
        if not token:
            raise ValueError(f"refusing to serve SQL on {host} without authentication: set "
                             "RANKWATCH_SQL_TOKEN, or bind to loopback (RANKWATCH_BIND_HOST="
                             "127.0.0.1)")
        log.warning("SQL endpoint bound to %s (beyond loopback)%s; requests need the token",
                    host, ", WRITABLE" if writable else "")
    runner = web.AppRunner(make_app(db, writable, token=token, limits=limits, health=health,
                                    notes=notes), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("SQL endpoint on http://%s:%d (%s%s)", host, bound_port(runner),
             "writable" if writable else "read-only", ", token required" if token else "")
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The TCP port the endpoint listens on."""
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return int(addr[1])
    raise RuntimeError("the SQL endpoint is not listening")


async def stop_sql_endpoint(runner: web.AppRunner) -> None:
    await runner.cleanup()
