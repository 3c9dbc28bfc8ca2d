"""The worker's SQL endpoint: other processes query the embedded database the worker owns.

Only one process may open an embedded ClickHouse directory, so the worker serves SQL over HTTP,
speaking the part of ClickHouse's HTTP interface that `rankwatch sql` and curl need:

    GET  /ping                       -> "Ok."
    POST /?default_format=PrettyCompact   body: the SQL
    GET  /?query=SELECT+1&format=JSON

`query` (URL) and the body are joined as ClickHouse does. The format applies to statements that
return rows and have no FORMAT clause of their own; the reply is ClickHouse's own output. A query
error is HTTP 400 with ClickHouse's message (no traceback). Read-only unless `writable`
(ClickHouse's readonly=2: settings may change, data and schema may not). Queries run on the
database thread, one at a time, between the writer's inserts; each is limited to
`streams.db.SQL_MAX_EXECUTION_TIME` seconds unless it sets max_execution_time itself.

No authentication: bind it to loopback (the default) and never expose it.
"""

from __future__ import annotations

import logging

from aiohttp import web

from streams.db import ClickHouseError, Database

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


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message.rstrip("\n") + "\n",
                        content_type="text/plain", charset="utf-8")


async def _ping(request: web.Request) -> web.Response:
    return web.Response(text="Ok.\n", content_type="text/plain")


async def _query(request: web.Request) -> web.Response:
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
        out = await db.aexecute_sql(sql, fmt, readonly=not writable)
    except ClickHouseError as e:
        return _error(400, e.message)
    except Exception as e:  # never a traceback to the caller; the worker's log has it
        log.exception("SQL endpoint: query failed")
        return _error(500, f"rankwatch SQL endpoint: {type(e).__name__}: {e}")
    return web.Response(body=out, headers={"X-ClickHouse-Format": fmt},
                        content_type=_CONTENT_TYPES.get(fmt, "text/plain"), charset="utf-8")


def make_app(db: Database, writable: bool = False) -> web.Application:
    """The endpoint's aiohttp application over `db` (read-only unless `writable`)."""
    app = web.Application(client_max_size=MAX_QUERY_BYTES)
    app[DB_KEY] = db
    app[WRITABLE_KEY] = writable
    app.router.add_get("/ping", _ping)
    app.router.add_route("GET", "/", _query)
    app.router.add_route("POST", "/", _query)
    return app


async def start_sql_endpoint(db: Database, host: str = "127.0.0.1", port: int = 8124,
                             writable: bool = False) -> web.AppRunner:
    """Serve `make_app(db, writable)` on host:port until `stop_sql_endpoint`. Raises OSError when
    the port is taken. Port 0 picks a free port: read it with `bound_port(runner)`."""
    runner = web.AppRunner(make_app(db, writable), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("SQL endpoint on http://%s:%d (%s)", host, bound_port(runner),
             "writable" if writable else "read-only")
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The TCP port the endpoint listens on."""
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return int(addr[1])
    raise RuntimeError("the SQL endpoint is not listening")


async def stop_sql_endpoint(runner: web.AppRunner) -> None:
    await runner.cleanup()
