"""Grafana's files stay valid and their queries run: the provisioned ClickHouse data source,
the two dashboards docker-compose.yml mounts, and every panel's (and variable's) SQL executed
against the real ClickHouse engine on a migrated database holding a little of every table, with
the ClickHouse plugin's macros expanded as the plugin does. Grafana itself cannot run here."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from diagnosis.agents import diagnosis_row
from diagnosis.page.data import literal
from streams.db import Database
from tests.unit.notify_fixtures import version

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
JOB = "grafana-job"


def expand(sql: str) -> str:
    """The ClickHouse plugin's macros, for the dashboards' last hour and a 10 s interval."""
    now = int(time.time())  # at run time: the seeded rows are stamped now
    from_s, to_s = now - 3600, now + 60
    sql = re.sub(r"\$__timeFilter\((\w+)\)",
                 rf"(\1 >= toDateTime({from_s}) AND \1 <= toDateTime({to_s}))", sql)
    sql = re.sub(r"\$__timeInterval\((\w+)\)", r"toStartOfInterval(\1, INTERVAL 10 second)", sql)
    sql = sql.replace("$__interval_s", "10").replace("${job:sqlstring}", literal(JOB))
    assert "$" not in sql, f"an unexpanded macro or variable: {sql}"
    return sql


def seed(db: Database) -> None:
    now = time.time_ns()
    db.command("INSERT INTO ingest_metrics VALUES "
               "(now64(3), 'worker-1', 'rw.ops', 0, 1200, 3, 12.5, 80.0)")
    db.command("INSERT INTO dlq VALUES (now64(9), 'rw.ops', 0, 7, 'rank', 3, 'negative', 'x')")
    db.command("INSERT INTO progress (job_id, window_end, rank, comm_id, last_op_seq, "
               "completed_ops, bytes_per_s, op_interval_ns, inflight_ops, "
               "oldest_inflight_age_ns, last_beat_ts, last_record_ts) VALUES "
               f"({literal(JOB)}, now64(9), 3, 'dp:world', 10, 4, 1000, 5000000, 1, 200000000, "
               "now64(9), now64(9))")
    for step in range(3):
        db.command("INSERT INTO iterations (job_id, rank, step, source, t_start, t_end, step_ns, "
                   "data_next_wait, model_fwd_loss, model_backward, callbacks, optim_step, "
                   f"step_other) VALUES ({literal(JOB)}, 3, {step}, 'stages', "
                   f"now64(9) - {3 - step}, now64(9) - {2 - step}, 900000000, 1, 2, 3, 4, 5, 6)")
    db.command("INSERT INTO kernel_summaries (job_id, window_start, rank, stream, kernel, "
               f"cluster, count, p50_ns, p99_ns) VALUES ({literal(JOB)}, now64(9), 3, 7, "
               "'sgemm', 0, 100, 40000, 90000)")
    d = version(f"{JOB}:hang:abc", 1, "open", job_id=JOB, detected_ns=now)
    db.command("INSERT INTO diagnoses FORMAT JSONEachRow " + diagnosis_row(d).decode())


def test_compose_mounts_the_provisioning_and_the_dashboards() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    g = compose["services"]["grafana"]
    assert "grafana-clickhouse-datasource" in g["environment"]["GF_INSTALL_PLUGINS"]
    for vol in g["volumes"]:
        src = vol.split(":")[0]
        if src.startswith("./"):
            assert (ROOT / src).exists(), vol
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/clickhouse.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "grafana-clickhouse-datasource"
    assert source["jsonData"]["defaultDatabase"] == "rankwatch"
    prov = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/rankwatch.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/rankwatch"
    assert len(DASHBOARDS) == 2
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids) and d["uid"].startswith("rankwatch-")
        for p in d["panels"]:
            assert p["datasource"]["uid"] == source["uid"], (path.name, p["title"])
            assert {"x", "y", "w", "h"} <= set(p["gridPos"])
            assert p["targets"] and all(t["rawSql"].strip() for t in p["targets"])


def _queries() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        out += [(path.name, p["title"], t["rawSql"]) for p in d["panels"] for t in p["targets"]]
        out += [(path.name, f"variable {v['name']}", v["query"])
                for v in d["templating"]["list"] if v["type"] == "query"]
    return out


@pytest.fixture
def seeded(clickhouse_db: Database) -> Database:
    seed(clickhouse_db)
    return clickhouse_db


@pytest.mark.parametrize(("dashboard", "title", "sql"), _queries(),
                         ids=[f"{d}:{t}" for d, t, _s in _queries()])
def test_every_dashboard_query_runs_on_clickhouse_and_finds_the_seeded_rows(
        seeded: Database, dashboard: str, title: str, sql: str) -> None:
    result: Any = seeded.query(expand(sql))
    assert result.result_rows, f"{dashboard} / {title}: no rows"
