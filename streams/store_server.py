"""The embedded store served to other workers: ClickHouse's HTTP interface over chdb.

Only one process may open an embedded ClickHouse directory. With several workers
(`rankwatch up --workers N`) the store process (`rankwatch store`) opens it and serves this
endpoint; each worker connects with the same code it would use against a ClickHouse server
(streams.db with an ``http://`` URL: clickhouse-connect). It speaks the part of ClickHouse's HTTP
interface clickhouse-connect uses:

    GET  /ping                                        -> "Ok."
    POST /?database=D&<setting>=<value>&param_<p>=<v>   body: the statement
    POST /?query=INSERT+INTO+t+(a,b)+FORMAT+Native      body: the data (Content-Encoding: lz4,
                                                        zstd, gzip, deflate, br as the client
                                                        compressed it)
    POST /                 body: "INSERT INTO t (a,b) FORMAT Native\\n" then the data
    POST /  multipart/form-data or urlencoded fields: query, param_<p>, settings

A statement's rows come back in its FORMAT (clickhouse-connect asks for Native), else in
`default_format`, else TabSeparated. An error is HTTP 500 with ClickHouse's own message and the
`X-ClickHouse-Exception-Code` header, as a server answers. An insert's data is handed to the
engine as a file (`INSERT ... FROM INFILE`, as clickhouse-connect's own chdb backend inserts): the
engine parses it, nothing is decoded here.

It is not the public SQL endpoint (streams/sql_endpoint.py, read-only): workers write through it,
so it binds to loopback only and requires a token (basic auth as any user, ``X-ClickHouse-Key``
or a bearer token; `rankwatch up` makes a random one per stack and passes it to its workers).
What the engine enforces per request: a fresh engine session (no state shared between requests,
as a server with no session id), the caller's settings, then the store's own — chdb's python()
table function off and `StoreLimits` (time, memory, threads) — set last, so a request cannot
change them by its URL. chdb has one user with every grant and no access storage for another, so
file and URL table functions are not refused by grants: the endpoint is for the stack's own
workers, who hold the token, on this machine only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import tempfile
from base64 import b64decode
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from clickhouse_connect.driver._backend.httpcommon import decompress_response

from streams.sql_endpoint import is_loopback

log = logging.getLogger(__name__)

#: URL parameters that are the protocol's, not settings.
TRANSPORT = frozenset({"query", "database", "default_format", "query_id", "session_id",
                       "session_timeout", "session_check", "compress", "decompress",
                       "enable_http_compression", "wait_end_of_query", "user", "password",
                       "client_protocol_version", "send_progress_in_http_headers",
                       "http_headers_progress_interval_ms", "buffer_size", "quota_key",
                       "role", "output_format_parallel_formatting"})
MAX_BODY_BYTES = 512 << 20
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_CODE = re.compile(r"Code: (\d+)\.")
#: An INSERT whose data follows the statement: the statement's head (before FORMAT) and the
#: format's name. The data starts after the line the statement ends on.
_INSERT = re.compile(rb"^\s*(INSERT\s+INTO\s+.*?)\s+FORMAT\s+([A-Za-z0-9_]+)\s*$", re.I | re.S)


@dataclass(frozen=True)
class StoreLimits:
    """What one request may use; set after the caller's settings."""

    max_execution_time_s: int = 600
    max_memory_bytes: int = 4 << 30
    max_threads: int = 2
    #: Requests run at once, each on a thread of its own with its own engine session.
    concurrency: int = 4

    def settings(self) -> dict[str, Any]:
        return {"max_execution_time": self.max_execution_time_s,
                "max_memory_usage": self.max_memory_bytes, "max_threads": self.max_threads,
                "allow_python_table_function": 0}


class StoreError(Exception):
    def __init__(self, message: str, code: int | None = None, status: int = 500) -> None:
        super().__init__(message)
        self.message, self.code, self.status = message, code, status


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def split_request(query: str, body: bytes) -> tuple[str, bytes | None, str | None]:
    """(statement, insert data or None, the data's format) from the `query` URL parameter and
    the body, as ClickHouse's HTTP server reads them: with a `query` parameter the body is the
    data of an INSERT (else more statement text); without, an INSERT's statement ends at the end
    of its first line and the data follows."""
    if query.strip():
        m = _INSERT.match(query.encode())
        if m and body:
            return m.group(1).decode(), body, m.group(2).decode()
        text = query + ("\n" + body.decode("utf-8", errors="replace") if body else "")
        return text, None, None
    line, nl, rest = body.partition(b"\n")
    m = _INSERT.match(line)
    if m and nl:
        return m.group(1).decode(), rest, m.group(2).decode()
    return body.decode("utf-8", errors="replace"), None, None


def _engine_error(e: BaseException) -> StoreError:
    text = " ".join(str(e).split()) if not str(e).startswith("Code:") else str(e).strip()
    code = _CODE.search(text)
    return StoreError(text, int(code.group(1)) if code else None)


def execute(path: str, database: str, statement: str, data: bytes | None, data_format: str | None,
            settings: Mapping[str, str], params: Mapping[str, str], out_format: str,
            limits: StoreLimits) -> bytes:
    """Run one request on a fresh engine session over the embedded database at `path`."""
    import chdb  # loaded already: this process holds the database

    try:
        conn = chdb.connect(path)  # type: ignore[no-untyped-call]
    except Exception as e:
        raise _engine_error(e) from None
    tmp = None
    try:
        def run(sql: str, fmt: str = "TSVRaw", bind: Mapping[str, str] | None = None) -> bytes:
            try:
                return bytes(conn.query(sql, fmt, params=dict(bind or {})).bytes())
            except Exception as e:  # chdb's errors carry ClickHouse's text
                raise _engine_error(e) from None

        if database:
            if not _NAME.match(database):
                raise StoreError(f"Code: 81. DB::Exception: Database {database!r} does not "
                                 "exist. (UNKNOWN_DATABASE)", 81, 404)
            run(f"USE `{database}`")
        merged = {**settings, **{k: str(v) for k, v in limits.settings().items()}}
        bad = [name for name in merged if not _NAME.match(name)]
        if bad:
            raise StoreError(f"Code: 115. DB::Exception: Unknown setting {bad[0]!r}. "
                             "(UNKNOWN_SETTING)", 115, 400)
        # one statement: the store's limits come last, so they win over the caller's
        run("SET " + ", ".join(f"{name} = {_quote(value)}" for name, value in merged.items()))
        if data is None:
            return run(statement, out_format, params)
        fd, tmp = tempfile.mkstemp(prefix="rankwatch-insert-", suffix=".bin")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return run(f"{statement} FROM INFILE {_quote(tmp)} FORMAT {data_format}", out_format,
                   params)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        conn.close()


class _Store:
    def __init__(self, path: str, database: str, token: str, limits: StoreLimits) -> None:
        self.path, self.database, self.token, self.limits = path, database, token, limits
        self.running = asyncio.Semaphore(limits.concurrency)
        self.requests = 0
        self.inserts = 0

    def allowed(self, request: web.Request) -> bool:
        given = request.headers.get("X-ClickHouse-Key", "")
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[7:].strip()
        elif auth.startswith("Basic "):
            try:
                given = b64decode(auth[6:]).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                given = ""
        elif "password" in request.query:
            given = request.query["password"]
        return bool(self.token) and hmac.compare_digest(given.encode(), self.token.encode())


STORE_KEY: web.AppKey[_Store] = web.AppKey("store", _Store)


def _error(e: StoreError) -> web.Response:
    headers = {"X-ClickHouse-Exception-Code": str(e.code or 1001)}
    return web.Response(status=e.status, text=e.message.rstrip("\n") + "\n", headers=headers,
                        content_type="text/plain", charset="utf-8")


async def _ping(request: web.Request) -> web.Response:
    return web.Response(text="Ok.\n", content_type="text/plain")


async def _request(request: web.Request) -> web.Response:
    store = request.app[STORE_KEY]
    if not store.allowed(request):
        return _error(StoreError("Code: 516. DB::Exception: rankwatch store: authentication "
                                 "failed (the stack's store token is required). "
                                 "(AUTHENTICATION_FAILED)", 516, 401))
    q: dict[str, str] = dict(request.query)
    body = b""
    if request.content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        # the query and its parameters as form fields (clickhouse-connect's choice when they
        # would make the URL too long)
        for name, value in (await request.post()).items():
            if not isinstance(value, str):
                return _error(StoreError("Code: 48. DB::Exception: rankwatch store: external "
                                         "data files are not supported. (NOT_IMPLEMENTED)", 48,
                                         400))
            q[name] = value
    elif request.can_read_body:
        body = await request.read()
    encoding = request.headers.get("Content-Encoding", "")
    if body and encoding and encoding != "identity":
        try:
            body = decompress_response(body, encoding)
        except Exception as e:
            return _error(StoreError(f"Code: 432. DB::Exception: cannot decompress the body "
                                     f"({encoding}): {e}. (UNKNOWN_CODEC)", 432, 400))
    statement, data, data_format = split_request(q.get("query", ""), body)
    if not statement.strip():
        return _error(StoreError("Code: 62. DB::Exception: Empty query. (SYNTAX_ERROR)", 62,
                                 400))
    settings = {k: v for k, v in q.items() if k not in TRANSPORT and not k.startswith("param_")}
    params = {k[6:]: v for k, v in q.items() if k.startswith("param_")}
    out_format = q.get("default_format") or "TabSeparated"
    database = q.get("database", store.database)
    async with store.running:
        try:
            out = await asyncio.to_thread(execute, store.path, database, statement, data,
                                          data_format, settings, params, out_format,
                                          store.limits)
        except StoreError as e:
            log.info("store: refused %r: %s", statement[:300], e.message[:300])
            return _error(e)
        except Exception as e:  # never a traceback to the caller; the log has it
            log.exception("store: request failed")
            return _error(StoreError(f"Code: 1001. DB::Exception: rankwatch store: "
                                     f"{type(e).__name__}: {e}", 1001))
    store.requests += 1
    store.inserts += data is not None
    return web.Response(body=out, headers={"X-ClickHouse-Format": out_format,
                                           "X-ClickHouse-Summary": "{}"},
                        content_type="application/octet-stream")


def make_app(path: str, database: str, token: str,
             limits: StoreLimits | None = None) -> web.Application:
    if not token:
        raise ValueError("the store endpoint requires a token")
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[STORE_KEY] = _Store(path, database, token, limits or StoreLimits())
    app.router.add_get("/ping", _ping)
    app.router.add_route("GET", "/", _request)
    app.router.add_route("POST", "/", _request)
    return app


async def start_store_endpoint(path: str, database: str, host: str, port: int, token: str,
                               limits: StoreLimits | None = None) -> web.AppRunner:
    """Serve the embedded database at `path` on host:port (loopback only) until the runner is
    cleaned up. Raises ValueError for a host beyond loopback or no token, OSError when the port
    is taken."""
    if not is_loopback(host):
        raise ValueError(f"the store endpoint serves this machine's workers only: bind it to "
                         f"loopback, not {host}")
    runner = web.AppRunner(make_app(path, database, token, limits), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
