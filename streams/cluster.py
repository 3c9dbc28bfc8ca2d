"""The schema on a ClickHouse cluster: each migration statement in its `ON CLUSTER` form.

One set of table definitions (sql/NNN_*.sql) serves every deployment. `statements(sql,
cluster=None, database=...)` returns a statement as it is for the embedded engine or a single
server, and with a cluster name (`RANKWATCH_CLICKHOUSE_CLUSTER`, a cluster of the server's
``remote_servers``) the statements that build the same table on every node:

- ``CREATE TABLE IF NOT EXISTS t (...) ENGINE = <X>MergeTree(args) ...`` becomes
  1. ``t_local ON CLUSTER c``: the same columns, indexes, keys, TTL and settings on
     ``Replicated<X>MergeTree('/clickhouse/tables/{shard}/<database>/t_local', '{replica}',
     args)`` (the server's ``{shard}`` and ``{replica}`` macros name the Keeper path and the
     replica), with ``non_replicated_deduplication_window`` as ``replicated_deduplication_window``
     (the same insert-token window, kept by Keeper);
  2. ``t ON CLUSTER c AS t_local``: a ``Distributed(c, <database>, t_local, <sharding key>)``
     table under the name the code reads and writes, so reads see every shard and no query
     changes.
- ``CREATE VIEW IF NOT EXISTS v AS ...`` gets ``ON CLUSTER c`` and reads the Distributed tables.
- ``ALTER TABLE t ADD|DROP|MODIFY|RENAME|COMMENT COLUMN ...`` is run on ``t_local`` and on ``t``
  (a Distributed table has columns too); every other ``ALTER TABLE t`` (indexes, TTL, settings)
  on ``t_local`` only, where the data is; one statement mixing the two is refused.
- Anything else has no cluster form: ClusterFormError names the statement, so a new kind of
  statement is thought through before it reaches a cluster.

**Sharding.** A stable hash of the job: ``cityHash64(job_id)`` for every table whose sorting key
has `job_id` (all job tables), else ``cityHash64(<the sorting key>)``. Stable, because a retried
insert must split into the same per-shard blocks for its deduplication token to match; by job (or
by sorting key), because rows that replace each other (ReplacingMergeTree, read with FINAL) must
meet on one shard, and one job's window queries then read one shard's rows per job.

The statements are text rewritten from our own migrations, which follow sql/README.md; each
cluster statement is checked with ClickHouse's own parser (`formatQuery`) in the tests.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


class ClusterFormError(ValueError):
    """A statement with no cluster form, or one this module cannot read."""


#: The suffix of the replicated table behind each Distributed table.
LOCAL = "_local"
ZK_ROOT = "/clickhouse/tables/{shard}"

_COMMENT = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|`(?:[^`\\]|\\.)*`|--[^\n]*"""
                      r"""|/\*.*?\*/""", re.S)
_CREATE_TABLE = re.compile(r"^CREATE\s+TABLE\s+IF\s+NOT\s+EXISTS\s+`?(\w+)`?\s*\(", re.I)
_CREATE_VIEW = re.compile(r"^(CREATE\s+VIEW\s+IF\s+NOT\s+EXISTS\s+`?\w+`?)\s+AS\b", re.I)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ALTER = re.compile(r"^ALTER\s+TABLE\s+`?(\w+)`?\s+", re.I)
_COLUMN_ALTER = re.compile(r"^(ADD|DROP|MODIFY|RENAME|COMMENT|CLEAR)\s+COLUMN\b", re.I)
#: What, besides columns, an ALTER may change (upper case, as sql/ writes keywords).
_OTHER_ALTER = re.compile(r"\b(INDEX|PROJECTION|TTL|SETTING|CONSTRAINT|ORDER BY|STATISTICS)\b")
_ENGINE = re.compile(r"^\s*ENGINE\s*=\s*(\w*)MergeTree\b", re.I)
_ORDER_BY = re.compile(r"\bORDER\s+BY\s+", re.I)


def _without_comments(sql: str) -> str:
    """`sql` with its comments removed (string literals and quoted names kept as they are)."""
    def keep(m: re.Match[str]) -> str:
        t = m.group(0)
        return t if t[0] in "'\"`" else " "
    return _COMMENT.sub(keep, sql).strip()


def _closing(text: str, open_at: int) -> int:
    """The index of the parenthesis closing the one at `open_at` (literals skipped)."""
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c in "'\"`":
            m = _COMMENT.match(text, i)
            i = m.end() if m else len(text)
            continue
        depth += (c == "(") - (c == ")")
        if depth == 0:
            return i
        i += 1
    raise ClusterFormError(f"unbalanced parentheses in: {text[:200]}")


def _sorting_key(rest: str, table: str) -> list[str]:
    """The expressions of the ORDER BY clause in the part of a CREATE after the column list."""
    m = _ORDER_BY.search(rest)
    if not m:
        raise ClusterFormError(f"table {table}: no ORDER BY to shard by")
    at = m.end()
    if rest[at] == "(":
        inner = rest[at + 1:_closing(rest, at)]
    else:
        inner = re.match(r"[\w.]+", rest[at:]).group(0)  # type: ignore[union-attr]
    parts, depth, cur = [], 0, ""
    for c in inner:
        if c == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += (c == "(") - (c == ")")
        cur += c
    parts.append(cur.strip())
    return [p for p in parts if p]


def sharding_key(rest: str, table: str) -> str:
    """``cityHash64(job_id)`` when the sorting key has job_id, else the whole sorting key's."""
    key = _sorting_key(rest, table)
    return "cityHash64(job_id)" if "job_id" in key else f"cityHash64({', '.join(key)})"


def _create_table(sql: str, table: str, cluster: str, database: str) -> list[str]:
    open_at = sql.index("(", _CREATE_TABLE.match(sql).end() - 1)  # type: ignore[union-attr]
    close = _closing(sql, open_at)
    columns, rest = sql[open_at:close + 1], sql[close + 1:]
    engine = _ENGINE.match(rest)
    if not engine:
        raise ClusterFormError(f"table {table}: only MergeTree-family tables have a cluster "
                               f"form (replicated, behind a Distributed table): "
                               f"{rest.strip()[:120]}")
    after = rest[engine.end():]
    args = ""
    if after.lstrip().startswith("("):
        at = len(after) - len(after.lstrip())
        end = _closing(after, at)
        args, after = after[at + 1:end].strip(), after[end + 1:]
    local = f"{table}{LOCAL}"
    path = f"'{ZK_ROOT}/{database}/{local}'"
    engine_args = ", ".join(a for a in (path, "'{replica}'", args) if a)
    settings = re.sub(r"\bnon_replicated_deduplication_window\b", "replicated_deduplication_window",
                      after)
    return [
        f"CREATE TABLE IF NOT EXISTS {local} ON CLUSTER {cluster}\n{columns}\n"
        f"ENGINE = Replicated{engine.group(1)}MergeTree({engine_args}){settings}",
        f"CREATE TABLE IF NOT EXISTS {table} ON CLUSTER {cluster} AS {local}\n"
        f"ENGINE = Distributed({cluster}, {database}, {local}, {sharding_key(after, table)})",
    ]


def statements(sql: str, cluster: str | None = None, database: str = "") -> list[str]:
    """The statements that apply one migration statement: itself without a cluster, else its
    cluster form (module doc). `database` is where the Distributed tables find the local ones."""
    if not cluster:
        return [sql]
    for name, what in ((cluster, "cluster"), (database, "database")):
        if not _IDENT.match(name):
            raise ClusterFormError(f"{what} {name!r}: expected letters, digits and underscores")
    bare = _without_comments(sql)
    if m := _CREATE_TABLE.match(bare):
        return _create_table(bare, m.group(1), cluster, database)
    if m := _CREATE_VIEW.match(bare):
        return [f"{m.group(1)} ON CLUSTER {cluster}{bare[m.end(1):]}"]
    if m := _ALTER.match(bare):
        table, action = m.group(1), bare[m.end():]
        local = f"ALTER TABLE {table}{LOCAL} ON CLUSTER {cluster} {action}"
        if _COLUMN_ALTER.match(action):
            if _OTHER_ALTER.search(_COMMENT.sub(" ", action)):
                raise ClusterFormError(f"ALTER TABLE {table}: a column change mixed with other "
                                       "changes runs on different tables on a cluster; make "
                                       "them separate statements")
            return [local, f"ALTER TABLE {table} ON CLUSTER {cluster} {action}"]
        return [local]
    raise ClusterFormError(f"no cluster form for this statement (CREATE TABLE|VIEW IF NOT "
                           f"EXISTS and ALTER TABLE have one): {' '.join(bare.split())[:160]}")


def create_database(database: str, cluster: str | None = None) -> str:
    """The statement creating `database` (on every node of `cluster`)."""
    on = f" ON CLUSTER {cluster}" if cluster else ""
    return f"CREATE DATABASE IF NOT EXISTS `{database}`{on}"


__all__: Sequence[str] = (
    "LOCAL", "ClusterFormError", "create_database", "sharding_key", "statements")
