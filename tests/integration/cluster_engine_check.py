"""Run as a process of its own by test_clickhouse_cluster.py (chdb opens one engine per process):
the embedded engine, started with CONFIG, executes every cluster statement of the migrations
and prints what it did as JSON.

chdb has no queue for ON CLUSTER DDL (it answers "Replicated DDL queries are disabled"), so each
statement runs with its ON CLUSTER clause removed, on this one node; and no Keeper, so the
replicated tables attach read-only and ALTERs of them fail with TABLE_IS_READ_ONLY.

usage: python -m tests.integration.cluster_engine_check CONFIG DATA_DIR CLUSTER DATABASE
"""

from __future__ import annotations

import json
import os
import sys

import chdb

from streams.cluster import statements
from streams.db import MIGRATIONS_TABLE, load_migrations


def main() -> None:
    config, path, cluster, database = sys.argv[1:5]
    conn = chdb.connect(f"file:{path}?config-file={config}")  # type: ignore[no-untyped-call]

    def run(sql: str, fmt: str = "TSV") -> tuple[str, str]:
        try:
            return str(conn.query(sql, fmt)), ""
        except Exception as e:  # chdb raises RuntimeError carrying ClickHouse's message
            return "", str(e)[:400]

    run(f"CREATE DATABASE IF NOT EXISTS {database}")
    run(f"USE {database}")
    sqls = statements(MIGRATIONS_TABLE, cluster, database) + [
        s for m in load_migrations() for st in m.statements
        for s in statements(st, cluster, database)]
    out: dict[str, object] = {
        "results": [[sql, run(sql.replace(f" ON CLUSTER {cluster}", "", 1))[1]] for sql in sqls]}
    for name, sql in {
        "tables": f"SELECT name, engine, engine_full FROM system.tables "
                  f"WHERE database = '{database}' ORDER BY name",
        "replicas": "SELECT table, zookeeper_path, replica_name FROM system.replicas "
                    "ORDER BY table",
        "clusters": "SELECT cluster, shard_num, replica_num, host_name FROM system.clusters",
        "macros": "SELECT macro, substitution FROM system.macros ORDER BY macro",
        "columns": f"SELECT table, groupArray(name) FROM system.columns "
                   f"WHERE database = '{database}' GROUP BY table",
    }.items():
        text, err = run(sql, "JSONCompact")
        out[name] = json.loads(text)["data"] if text else err
    print(json.dumps(out), flush=True)
    os._exit(0)  # read-only replicated tables keep threads that hang an orderly exit


if __name__ == "__main__":
    main()
