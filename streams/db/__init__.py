"""ClickHouse access: where it is, one client on one thread, user SQL, and migrations.

- `url`: the URLs rankwatch accepts (`chdb:///<dir>` embedded, `http(s)://` a server) and the
  client arguments they become;
- `client`: `Database`, the one client every writer and reader goes through, with sync methods
  and `a*` twins for the Faust worker's event loop;
- `user_sql`: how a statement from the SQL endpoint or `rankwatch sql` runs (a session of its
  own, `SqlLimits`, read-only, checked on the engine's canonical text);
- `migrations`: the numbered files in sql/, applied in order and recorded with checksums;
- `errors`: `ClickHouseError` and `EmbeddedDatabaseBusy`, carrying ClickHouse's own text.

The names below are the package's interface; import them from `streams.db`.
"""

from streams.db.client import Database, cluster_settings
from streams.db.errors import BUSY_HINT, ClickHouseError, EmbeddedDatabaseBusy
from streams.db.migrations import (
    MIGRATIONS_TABLE,
    Migration,
    MigrationError,
    applied_migrations,
    applied_statements,
    load_migrations,
    migrate,
    migrations_dir,
    split_statements,
)
from streams.db.url import Target, client_args, endpoint_target, parse_url
from streams.db.user_sql import SqlLimits, refusal, strip_sql, wants_format

__all__ = (
    "BUSY_HINT", "MIGRATIONS_TABLE", "ClickHouseError", "Database", "EmbeddedDatabaseBusy",
    "Migration", "MigrationError", "SqlLimits", "Target", "applied_migrations",
    "applied_statements", "client_args", "cluster_settings", "endpoint_target",
    "load_migrations", "migrate", "migrations_dir", "parse_url", "refusal", "split_statements",
    "strip_sql", "wants_format",
)
