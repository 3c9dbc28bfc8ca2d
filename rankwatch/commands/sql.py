"""`rankwatch sql "SELECT ..." [--format F]`: query rankwatch's ClickHouse database.

Where the query goes:
- embedded (`chdb://`): to the worker's SQL endpoint, http://<bind_host>:<sql_port>; when no worker
  answers, the embedded database is opened directly, which works only while no other process
  holds it;
- a server (`http(s)://`): straight to the server.

Read-only unless RANKWATCH_SQL_WRITABLE is set (the worker's endpoint follows its own setting).
Errors print ClickHouse's message to stderr and exit 1.
"""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from typing import Any

from rankwatch import http
from rankwatch.settings import Settings

#: Wait at most this long for the worker to accept the connection; the query itself may run for
#: up to the endpoint's max_execution_time.
CONNECT_TIMEOUT_S = 600.0


class NoEndpoint(Exception):
    """Nothing answers at the worker's SQL address."""


def register(sub: Any) -> None:
    p = sub.add_parser("sql", help="run SQL on rankwatch's ClickHouse database",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("query", help='the SQL, or "-" to read it from stdin')
    p.add_argument("--format", "-f", dest="fmt", default=None,
                   help="output format: PrettyCompact (default on a terminal), TSV (default "
                        "otherwise), TSVWithNames, CSV, CSVWithNames, JSONEachRow, JSON, Pretty, "
                        "Vertical, ...")
    p.set_defaults(func=run)


def endpoint_url(settings: Settings) -> str:
    """The worker's SQL endpoint as seen from this machine (a wildcard bind means loopback)."""
    host = settings.bind_host
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.sql_port}/"


def query_endpoint(url: str, sql: str, fmt: str, timeout: float = CONNECT_TIMEOUT_S,
                   token: str = "") -> bytes:
    """POST `sql` to a SQL endpoint (with `token` when it needs one). Raises NoEndpoint when
    nothing listens, RuntimeError with the server's message when the query fails."""
    headers = {"Content-Type": "text/plain; charset=utf-8"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        return http.post(f"{url}?{urllib.parse.urlencode({'default_format': fmt})}",
                         sql.encode(), headers=headers, timeout=timeout).body
    except http.StatusError as e:
        raise RuntimeError(e.body.decode(errors="replace").strip() or str(e)) from None
    except http.Unreachable as e:
        if isinstance(e.reason, ConnectionRefusedError | FileNotFoundError):
            raise NoEndpoint(f"{url}: {e.reason}") from None
        raise RuntimeError(f"{url}: {e.reason}") from None


def query_direct(settings: Settings, sql: str, fmt: str) -> bytes:
    """Open the database in this process and run `sql` (embedded: only if nobody holds it)."""
    from streams.db import Database  # imports the ClickHouse engine: only on this path

    with Database(settings.clickhouse, settings.clickhouse_database, create=False,
                  cluster=settings.clickhouse_cluster,
                  sql_user=settings.sql_clickhouse_user,
                  sql_password=settings.sql_clickhouse_password.get_secret_value()) as db:
        return db.execute_sql(sql, fmt, readonly=not settings.sql_writable)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from streams.db import ClickHouseError  # the ClickHouse client loads only when a command runs

    sql = sys.stdin.read() if args.query == "-" else args.query
    if not sql.strip():
        print("rankwatch sql: empty query", file=sys.stderr)
        return 1
    fmt = args.fmt or ("PrettyCompact" if sys.stdout.isatty() else "TSV")
    try:
        out = execute(settings, sql, fmt)
    except (ClickHouseError, RuntimeError) as e:
        print(str(e).rstrip(), file=sys.stderr)
        return 1
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()
    return 0


def execute(settings: Settings, sql: str, fmt: str) -> bytes:
    """The query's formatted output, through the worker when there is one (see module doc)."""
    if not settings.clickhouse.startswith("chdb://"):
        return query_direct(settings, sql, fmt)
    try:
        return query_endpoint(endpoint_url(settings), sql, fmt,
                              token=settings.sql_token.get_secret_value())
    except NoEndpoint:
        return query_direct(settings, sql, fmt)
