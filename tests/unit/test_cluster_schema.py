"""streams.cluster: the ON CLUSTER form of every migration, from the same table definitions.
Pure text here; tests/integration/test_clickhouse_cluster.py has ClickHouse parse and create
every statement."""

from __future__ import annotations

import re
from typing import cast

import pytest
from clickhouse_connect.driver.client import Client

from rankwatch.settings import Settings, SettingsError
from streams.cluster import ClusterFormError, create_database, statements
from streams.db import MIGRATIONS_TABLE, Database, cluster_settings, load_migrations, parse_url

ALL = [MIGRATIONS_TABLE] + [st for m in load_migrations() for st in m.statements]
CREATES = [st for st in ALL if re.search(r"^CREATE TABLE", st, re.M)]


def _bare(sql: str) -> str:
    """A migration statement without its comment lines (ours have no comment after code)."""
    return "\n".join(ln for ln in sql.splitlines() if not ln.lstrip().startswith("--"))


def _columns(sql: str) -> str:
    """The column list of a CREATE TABLE, blanks normalised."""
    body = sql[sql.index("(", sql.index("CREATE TABLE")):]
    depth = 0
    for i, c in enumerate(body):
        depth += (c == "(") - (c == ")")
        if depth == 0:
            return " ".join(body[:i + 1].split())
    raise AssertionError(sql)


def _name(sql: str) -> str:
    return re.search(r"CREATE TABLE IF NOT EXISTS (\w+)", sql).group(1)  # type: ignore[union-attr]


def test_without_a_cluster_every_statement_runs_as_written() -> None:
    for st in ALL:
        assert statements(st) == [st]
        assert statements(st, "", "rankwatch") == [st]
    assert create_database("rankwatch") == "CREATE DATABASE IF NOT EXISTS `rankwatch`"


@pytest.mark.parametrize("sql", CREATES, ids=[_name(s) for s in CREATES])
def test_a_table_becomes_a_replicated_local_table_behind_a_distributed_one(sql: str) -> None:
    name = _name(sql)
    local, dist = statements(sql, "rw", "rankwatch")
    sql = _bare(sql)
    # the same definition: columns, indexes, keys and TTL unchanged
    assert local.startswith(f"CREATE TABLE IF NOT EXISTS {name}_local ON CLUSTER rw\n")
    assert _columns(local) == _columns(sql)
    engine = re.search(r"ENGINE = (\w*)MergeTree(\(([^)]*)\))?", sql)
    assert engine is not None
    want = (f"ENGINE = Replicated{engine.group(1)}MergeTree("
            f"'/clickhouse/tables/{{shard}}/rankwatch/{name}_local', '{{replica}}'"
            + (f", {engine.group(3)}" if engine.group(3) else "") + ")")
    assert want in local
    for clause in ("PARTITION BY", "ORDER BY", "TTL"):
        orig = re.search(rf"\b{clause} .*$", sql, re.M)
        assert (orig is None) == (re.search(rf"\b{clause} ", local) is None)
        if orig:
            assert orig.group(0) in local
    assert "non_replicated_deduplication_window" not in local
    if "non_replicated_deduplication_window = 10000" in sql:
        assert "replicated_deduplication_window = 10000" in local
    # the Distributed table under the name the code uses, sharded by job
    key = re.search(r"\bORDER BY \(?([\w, ]+)\)?", sql).group(1)  # type: ignore[union-attr]
    shard_by = "job_id" if "job_id" in key.split(", ") else key
    assert dist == (f"CREATE TABLE IF NOT EXISTS {name} ON CLUSTER rw AS {name}_local\n"
                    f"ENGINE = Distributed(rw, rankwatch, {name}_local, cityHash64({shard_by}))")


def test_every_job_table_is_sharded_by_its_job() -> None:
    for sql in CREATES:
        dist = statements(sql, "rw", "rankwatch")[1]
        if re.search(r"^\s+job_id\s", sql, re.M):
            assert dist.endswith("cityHash64(job_id))"), dist
    assert statements(MIGRATIONS_TABLE, "rw", "db")[1].endswith("cityHash64(version))")


def test_alters_and_views() -> None:
    add_index = "ALTER TABLE ops ADD INDEX IF NOT EXISTS i t_end TYPE minmax GRANULARITY 1"
    assert statements(add_index, "rw", "db") == [
        "ALTER TABLE ops_local ON CLUSTER rw ADD INDEX IF NOT EXISTS i t_end TYPE minmax "
        "GRANULARITY 1"]
    add_col = "-- why\nALTER TABLE beats ADD COLUMN IF NOT EXISTS step Int64 DEFAULT -1 AFTER x"
    assert statements(add_col, "rw", "db") == [
        "ALTER TABLE beats_local ON CLUSTER rw ADD COLUMN IF NOT EXISTS step Int64 DEFAULT -1 "
        "AFTER x",
        "ALTER TABLE beats ON CLUSTER rw ADD COLUMN IF NOT EXISTS step Int64 DEFAULT -1 AFTER x"]
    view = "CREATE VIEW IF NOT EXISTS v AS SELECT 1 -- note\nFROM iterations FINAL"
    assert statements(view, "rw", "db") == [
        "CREATE VIEW IF NOT EXISTS v ON CLUSTER rw AS SELECT 1  \nFROM iterations FINAL"]
    assert create_database("db", "rw") == "CREATE DATABASE IF NOT EXISTS `db` ON CLUSTER rw"


@pytest.mark.parametrize("sql", [
    "INSERT INTO ops VALUES (1)",
    "CREATE TABLE IF NOT EXISTS m (a Int8) ENGINE = Memory",
    "CREATE TABLE m (a Int8) ENGINE = MergeTree ORDER BY a",  # not idempotent
    "CREATE TABLE IF NOT EXISTS m (a Int8) ENGINE = MergeTree PRIMARY KEY a",
    "DROP TABLE ops",
    "ALTER TABLE beats ADD COLUMN IF NOT EXISTS s Int8, ADD INDEX IF NOT EXISTS i s TYPE minmax",
])
def test_a_statement_with_no_cluster_form_is_refused(sql: str) -> None:
    with pytest.raises(ClusterFormError):
        statements(sql, "rw", "db")


@pytest.mark.parametrize(("cluster", "database"), [("r w", "db"), ("rw", "d;b"), ("rw", "")])
def test_names_are_identifiers(cluster: str, database: str) -> None:
    with pytest.raises(ClusterFormError):
        statements(ALL[1], cluster, database)


def test_a_literal_or_comment_with_parentheses_does_not_confuse_the_column_list() -> None:
    sql = ("CREATE TABLE IF NOT EXISTS t\n(\n    job_id String DEFAULT ')(',  -- a ) here\n"
           "    x Int8\n)\nENGINE = MergeTree\nORDER BY (job_id, x)")
    local, dist = statements(sql, "rw", "db")
    assert "DEFAULT ')('" in local and "a ) here" not in local
    assert dist.endswith("cityHash64(job_id))")


def test_reads_see_the_writes_on_every_replica() -> None:
    assert cluster_settings(2) == {"distributed_foreground_insert": 1, "insert_quorum": 2}
    assert cluster_settings(1) == {"distributed_foreground_insert": 1}


def test_a_cluster_needs_a_server() -> None:
    with pytest.raises(SettingsError, match="needs a ClickHouse server"):
        Settings.load(env={"RANKWATCH_CLICKHOUSE_CLUSTER": "rw"})
    with pytest.raises(SettingsError, match="RANKWATCH_CLICKHOUSE_CLUSTER"):
        Settings.load(env={"RANKWATCH_CLICKHOUSE_CLUSTER": "rw; DROP",
                           "RANKWATCH_CLICKHOUSE_URL": "http://ch:8123"})
    s = Settings.load(env={"RANKWATCH_CLICKHOUSE_CLUSTER": "rw",
                           "RANKWATCH_CLICKHOUSE_URL": "http://ch:8123"})
    assert s.clickhouse_cluster == "rw"
    with pytest.raises(ValueError, match="needs a ClickHouse server"):
        Database("chdb://memory", "db", cluster="rw")


class _RecordingDb:
    """What `migrate` uses of a Database, recording the SQL it is sent (no ClickHouse)."""

    def __init__(self, cluster: str) -> None:
        self.cluster, self.database = cluster, "rankwatch"
        self.commands: list[str] = []
        self.inserted: list[str] = []

    def command(self, sql: str) -> None:
        self.commands.append(sql)

    def query(self, sql: str) -> object:
        return type("Result", (), {"result_rows": []})()

    def insert_columns(self, table: str, columns: object) -> None:
        self.inserted.append(table)


@pytest.mark.parametrize("cluster", ["", "rw"])
def test_migrate_sends_each_statement_in_its_form_for_the_deployment(cluster: str) -> None:
    from streams.db import migrate

    db = _RecordingDb(cluster)
    applied = migrate(db)  # type: ignore[arg-type]
    assert [m.name for m in applied] == [m.name for m in load_migrations()]
    want = [s for st in ALL for s in statements(st, cluster or None, "rankwatch")]
    assert db.commands == want
    assert all(("ON CLUSTER rw" in s) == bool(cluster) for s in db.commands)
    assert db.inserted == ["schema_migrations"] * len(applied)  # the Distributed table


class _FakeClient:
    """The clickhouse-connect calls `Database._open` makes, answered from `shards`."""

    def __init__(self, shards: list[tuple[int, int]]) -> None:
        self.shards, self.settings, self.commands = shards, {}, []  # type: ignore[var-annotated]
        self.database = ""

    def query(self, sql: str, parameters: dict[str, str]) -> object:
        assert "system.clusters" in sql and parameters == {"c": "rw"}
        return type("Result", (), {"result_rows": self.shards})()

    def set_client_setting(self, key: str, value: object) -> None:
        self.settings[key] = value

    def command(self, sql: str) -> None:
        self.commands.append(sql)

    def close(self) -> None:
        pass


def _open(shards: list[tuple[int, int]]) -> tuple[Database, _FakeClient]:
    db = object.__new__(Database)
    db.target, db.database, db.cluster = parse_url("http://ch:8123"), "rankwatch", "rw"
    db._cluster_settings = {}
    client = _FakeClient(shards)
    # the fake answers the few Client calls `_open` makes
    db._connect = lambda settings=None: cast(Client, client)  # type: ignore[method-assign]
    db._open(True)
    return db, client


def test_opening_on_a_cluster_sets_quorum_from_its_replicas_and_creates_on_cluster() -> None:
    db, client = _open([(1, 2), (2, 2)])
    assert client.settings == {"distributed_foreground_insert": 1, "insert_quorum": 2}
    assert db._cluster_settings == client.settings  # and on the endpoint's own clients
    assert client.commands == ["CREATE DATABASE IF NOT EXISTS `rankwatch` ON CLUSTER rw",
                               "SELECT 1"]
    assert client.database == "rankwatch"


@pytest.mark.parametrize(("shards", "why"), [
    ([], "not in the remote_servers"),
    ([(1, 2), (2, 3)], r"shards with \[2, 3\] replicas"),
])
def test_a_cluster_the_server_lacks_or_uneven_shards_are_refused(
        shards: list[tuple[int, int]], why: str) -> None:
    from streams.db import ClickHouseError

    with pytest.raises(ClickHouseError, match=why):
        _open(shards)
