"""`rankwatch db migrate`: apply the numbered migrations in sql/ (idempotent).

The worker applies them at start-up too. On the embedded database this command works only while
no other process (the worker) holds it; for a server URL it always runs directly.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rankwatch.settings import Settings


def register(sub: Any) -> None:
    p = sub.add_parser("db", help="manage rankwatch's ClickHouse schema", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    dsub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    m = dsub.add_parser("migrate", help="apply the migrations the database lacks (idempotent)")
    m.set_defaults(func=migrate_command)


def migrate_command(args: argparse.Namespace, settings: Settings) -> int:
    from streams.db import (
        ClickHouseError,
        Database,
        EmbeddedDatabaseBusy,
        MigrationError,
        load_migrations,
        migrate,
    )

    try:
        with Database(settings.clickhouse, settings.clickhouse_database,
                      cluster=settings.clickhouse_cluster) as db:
            applied = migrate(db)
            where = f"database {db.database} at {db.target.display()}"
    except EmbeddedDatabaseBusy:
        print("rankwatch db migrate: the embedded database is held by another process (the "
              "worker, which applies migrations when it starts); stop it (`rankwatch down`) to "
              "run this command", file=sys.stderr)
        return 1
    except (ClickHouseError, MigrationError) as e:
        print(f"rankwatch db migrate: {e}", file=sys.stderr)
        return 1
    for mig in applied:
        print(f"applied {mig.name}")
    if applied:
        print(f"{where}: {len(applied)} migration(s) applied")
    else:
        print(f"{where}: up to date ({len(load_migrations())} migration(s))")
    return 0
