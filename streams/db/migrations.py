"""Migrations: the numbered files in sql/ (see sql/README.md), applied in order.

Each applied file is recorded in `schema_migrations` with its checksum; editing an applied file
is an error. Statements use unqualified table names and land in the database the `Database` was
opened on. With a cluster, each statement runs in its ON CLUSTER form (streams.cluster), so the
code reads and writes the same tables either way.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streams import cluster
from streams.db.client import Database
from streams.db.user_sql import strip_sql

_MIGRATION_NAME = re.compile(r"^(\d{3,})_([a-z0-9_]+)\.sql$")
#: Where applied migrations are recorded (created before the first migration runs).
MIGRATIONS_TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations (
    version UInt32, name String, checksum String, applied_at DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree(applied_at) ORDER BY version"""


class MigrationError(RuntimeError):
    """A migration file is malformed, or changed after it was applied."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str  # file name without .sql, e.g. "001_raw"
    checksum: str  # sha256 of the file's bytes
    statements: tuple[str, ...]


def migrations_dir() -> Path:
    """sql/ beside the packages (source tree, editable install), else a copy inside streams/."""
    streams_dir = Path(__file__).resolve().parent.parent
    for candidate in (streams_dir.parent / "sql", streams_dir / "sql"):
        if candidate.is_dir():
            return candidate
    raise MigrationError(f"no sql/ directory found beside {streams_dir}")


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
    for statement in applied_statements(db, MIGRATIONS_TABLE):
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
