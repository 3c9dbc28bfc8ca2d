"""The cluster schema (streams/cluster.py) checked by the ClickHouse engine itself, without a
ClickHouse cluster (none runs here):

- every ON CLUSTER statement goes through the engine's parser (`formatQuery`), which keeps its
  ON CLUSTER clause, and its canonical text parses to itself;
- the engine, configured with docker-compose.cluster.yml's own cluster.xml and one server's
  macros, executes every statement on one node (ON CLUSTER removed: chdb has no DDL queue;
  Keeper replaced by ClickHouse's in-process test Keeper): the replicated tables take the
  macros' Keeper path and replica, the Distributed tables their cluster and sharding key, the
  view compiles over them. ALTERs of a replicated table need a live Keeper: they are the only
  statements allowed to fail here, and only with TABLE_IS_READ_ONLY;
- every setting a cluster connection sends exists in the engine.
What is not run: ON CLUSTER execution through a DDL queue, replication, Distributed inserts and
reads across servers, quorum inserts (docs/architecture.md, "ClickHouse cluster").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from streams.cluster import create_database, statements
from streams.db import MIGRATIONS_TABLE, Database, cluster_settings, load_migrations

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "rankwatch"  # deploy/clickhouse/cluster.xml
READ_ONLY = "TABLE_IS_READ_ONLY"


def cluster_statements(database: str = "rankwatch") -> list[str]:
    return [create_database(database, CLUSTER), *statements(MIGRATIONS_TABLE, CLUSTER, database),
            *(s for m in load_migrations() for st in m.statements
              for s in statements(st, CLUSTER, database))]


def format_query(db: Database, sql: str) -> str:
    return str(db.query("SELECT formatQuery({q:String})", {"q": sql}).result_rows[0][0])


def test_the_engines_parser_takes_every_cluster_statement(clickhouse_db: Database) -> None:
    sqls = cluster_statements()
    assert len(sqls) > 40
    for sql in sqls:
        canonical = format_query(clickhouse_db, sql)  # raises ClickHouse's syntax error
        assert f"ON CLUSTER {CLUSTER}" in canonical, canonical
        assert format_query(clickhouse_db, canonical) == canonical


def test_a_broken_statement_is_refused_by_the_parser(clickhouse_db: Database) -> None:
    from streams.db import ClickHouseError

    with pytest.raises(ClickHouseError, match="Syntax error"):
        format_query(clickhouse_db, "CREATE TABLE t ON CLUSTER rankwatch (a Int8) ENGINE =")


def test_cluster_settings_are_the_engines(clickhouse_db: Database) -> None:
    wanted = cluster_settings(2)
    rows = clickhouse_db.query("SELECT name FROM system.settings WHERE name IN {n:Array(String)}",
                               {"n": list(wanted)}).result_rows
    assert {r[0] for r in rows} == set(wanted)


def _config(tmp: Path, macros: str) -> Path:
    """The compose's cluster.xml and one server's macros in one file, Keeper swapped for the
    engine's in-process test Keeper."""
    root = ET.Element("clickhouse")
    for path in (ROOT / "deploy/clickhouse/cluster.xml", ROOT / "deploy/clickhouse/macros" /
                 f"{macros}.xml"):
        for child in ET.parse(path).getroot():
            if child.tag == "zookeeper":
                child = ET.fromstring(
                    "<zookeeper><implementation>testkeeper</implementation></zookeeper>")
            root.append(child)
    out = tmp / "config.xml"
    ET.ElementTree(root).write(out)
    return out


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("cluster-engine")
    env = {**os.environ, "CLICKHOUSE_USER": "rankwatch", "CLICKHOUSE_PASSWORD": "secret"}
    res = subprocess.run(
        [sys.executable, "-m", "tests.integration.cluster_engine_check",
         str(_config(tmp, "clickhouse-3")), str(tmp / "data"), CLUSTER, "rankwatch"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def test_the_engine_reads_the_compose_cluster_config(engine_run: dict[str, Any]) -> None:
    assert sorted(engine_run["clusters"]) == [
        [CLUSTER, 1, 1, "clickhouse-1"], [CLUSTER, 1, 2, "clickhouse-2"],
        [CLUSTER, 2, 1, "clickhouse-3"], [CLUSTER, 2, 2, "clickhouse-4"]]
    assert engine_run["macros"] == [["replica", "clickhouse-3"], ["shard", "02"]]


def test_the_engine_executes_every_cluster_statement(engine_run: dict[str, Any]) -> None:
    failed = [(sql, err) for sql, err in engine_run["results"] if err]
    assert failed, "ALTERs of replicated tables cannot succeed without a live Keeper"
    refused: set[str] = set()
    for sql, err in failed:  # only ALTERs of replicated tables, only for want of Keeper
        assert sql.startswith("ALTER TABLE ") and "_local ON CLUSTER" in sql, (sql, err)
        table = sql.split()[2]
        # ... or an ALTER placing a column AFTER one an earlier refused ALTER would have added
        assert READ_ONLY in err or (table in refused and "NO_SUCH_COLUMN" in err), (sql, err)
        refused.add(table)
    ok = [sql for sql, err in engine_run["results"] if not err]
    assert any(s.startswith("CREATE VIEW") for s in ok)
    assert any(s.startswith("ALTER TABLE beats ON CLUSTER") for s in ok)  # the Distributed one


def test_replicated_tables_behind_distributed_ones_sharded_by_job(
        engine_run: dict[str, Any]) -> None:
    tables = {name: (engine, full) for name, engine, full in engine_run["tables"]}
    locals_ = sorted(n for n in tables if n.endswith("_local"))
    assert len(locals_) == 17  # 16 tables of sql/ and schema_migrations
    for local in locals_:
        name = local.removesuffix("_local")
        assert tables[local][0].startswith("Replicated"), tables[local]
        engine, full = tables[name]
        assert engine == "Distributed"
        want = f"Distributed('{CLUSTER}', 'rankwatch', '{local}', cityHash64("
        assert full.startswith(want), full
        if name not in ("dlq", "ingest_metrics", "schema_migrations"):
            assert "cityHash64(job_id)" in full, full
    assert tables["job_minute"][0] == "View"
    replicas = {t: (p, r) for t, p, r in engine_run["replicas"]}
    assert set(replicas) == set(locals_)
    for t, (path, replica) in replicas.items():  # the macros of clickhouse-3 (shard 02)
        assert (path, replica) == (f"/clickhouse/tables/02/rankwatch/{t}", "clickhouse-3")
