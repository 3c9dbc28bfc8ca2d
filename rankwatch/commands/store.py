"""`rankwatch store`: the process that owns the embedded ClickHouse when several workers run.

Opens the embedded database (one process may), applies migrations, serves it to the workers
over ClickHouse's HTTP interface on loopback (`store_port`, token `store_token`:
streams/store_server.py) and serves the public read-only SQL endpoint (`sql_port`) for
`rankwatch sql`. Runs until SIGTERM or SIGINT. `rankwatch up --workers N` starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from rankwatch.settings import Settings
from rankwatch.stack import display_url
from streams.db import ClickHouseError, Database, MigrationError, migrate, parse_url
from streams.sql_endpoint import start_sql_endpoint, stop_sql_endpoint
from streams.store_server import start_store_endpoint

log = logging.getLogger("rankwatch.store")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("store", help="serve the embedded ClickHouse to several local workers")
    p.add_argument("--loglevel", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


async def serve(settings: Settings, db: Database) -> None:
    token = settings.store_token.get_secret_value()
    store = await start_store_endpoint(db.target.path, settings.clickhouse_database,
                                       "127.0.0.1", settings.store_port, token)
    from rankwatch.commands.worker import sql_limits  # the worker's endpoint, same limits

    sql = await start_sql_endpoint(db, settings.bind_host, settings.sql_port,
                                   writable=settings.sql_writable,
                                   token=settings.sql_token.get_secret_value(),
                                   limits=sql_limits(settings))
    log.info("store: ClickHouse for workers on http://127.0.0.1:%d; SQL on http://%s:%d",
             settings.store_port, settings.bind_host, settings.sql_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await stop_sql_endpoint(sql)
        await store.cleanup()


def run(args: argparse.Namespace, settings: Settings) -> int:
    logging.basicConfig(level=args.loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not parse_url(settings.clickhouse).embedded:
        print(f"rankwatch store: {display_url(settings.clickhouse)} is a server; workers "
              "connect to it directly (the store serves an embedded database only)",
              file=sys.stderr)
        return 2
    if not settings.store_token.get_secret_value():
        print("rankwatch store: no RANKWATCH_STORE_TOKEN: the workers' endpoint requires one "
              "(`rankwatch up --workers N` makes it)", file=sys.stderr)
        return 2
    try:
        db = Database(settings.clickhouse, settings.clickhouse_database)
    except ClickHouseError as e:
        print(f"rankwatch store: cannot open ClickHouse at {display_url(settings.clickhouse)}: "
              f"{e.message}", file=sys.stderr)
        return 1
    try:
        applied = migrate(db)
        if applied:
            log.info("applied migrations: %s", ", ".join(m.name for m in applied))
        asyncio.run(serve(settings, db))
    except (MigrationError, ClickHouseError) as e:
        print(f"rankwatch store: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"rankwatch store: cannot serve: {e}", file=sys.stderr)
        return 78
    finally:
        db.close()
    return 0
