"""The worker's SQL endpoint (streams.sql_endpoint) and `rankwatch sql`, against the embedded
ClickHouse this test process owns: other processes can query only through the endpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from rankwatch.commands import sql as sql_command
from rankwatch.settings import Settings
from streams.db import BUSY_HINT, Database

QUERY = "SELECT rank, comm_id FROM beats ORDER BY rank"


def http(url: str, sql: str | None = None, **params: str) -> tuple[int, str]:
    """(status, body) of a GET (sql None) or POST to the endpoint."""
    full = f"{url}?{urllib.parse.urlencode(params)}" if params else url
    req = urllib.request.Request(full, data=None if sql is None else sql.encode(),
                                 method="GET" if sql is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def beats(clickhouse_db: Database) -> Database:
    clickhouse_db.insert_columns("beats", {
        "job_id": np.array(["j1", "j1"], dtype=object),
        "rank": np.array([0, 1], np.int32),
        "ts": np.array([1, 2], np.int64) + time.time_ns(),
        "comm_id": np.array(["dp0", "tp'1"], dtype=object),
    })
    return clickhouse_db


def test_ping(sql_endpoint) -> None:
    assert http(f"{sql_endpoint.url}ping") == (200, "Ok.\n")


@pytest.mark.parametrize("fmt", ["PrettyCompact", "Pretty", "TSV", "TSVWithNames", "CSV",
                                 "CSVWithNames", "JSONEachRow"])
def test_select_in_clickhouse_formats(sql_endpoint, beats: Database, fmt: str) -> None:
    status, body = http(sql_endpoint.url, QUERY, default_format=fmt)
    assert status == 200
    assert body == beats.query(QUERY, fmt=fmt).decode()  # exactly ClickHouse's own output


def test_json_format_and_get_with_query_param(sql_endpoint, beats: Database) -> None:
    status, body = http(sql_endpoint.url, QUERY, format="JSON")
    assert status == 200
    doc = json.loads(body)
    assert doc["data"] == [{"rank": 0, "comm_id": "dp0"}, {"rank": 1, "comm_id": "tp'1"}]
    assert [m["name"] for m in doc["meta"]] == ["rank", "comm_id"]
    assert http(sql_endpoint.url, query="SELECT count() FROM beats") == (200, "2\n")
    assert http(sql_endpoint.url, "SELECT 1 AS x FORMAT JSONEachRow",
                default_format="CSV") == (200, '{"x":1}\n')


@pytest.mark.parametrize("sql", [
    "INSERT INTO beats (rank, ts) VALUES (9, 9)",
    "DROP TABLE beats",
    "CREATE TABLE x (a Int8) ENGINE = Memory",
    "TRUNCATE TABLE beats",
    "SELECT 1 SETTINGS readonly = 0",
])
def test_read_only_refuses_writes_with_clickhouse_message(sql_endpoint, beats: Database,
                                                          sql: str) -> None:
    status, body = http(sql_endpoint.url, sql)
    assert status == 400
    assert body.startswith("Code: 164. DB::Exception:") and "(READONLY)" in body
    assert "Traceback" not in body
    assert beats.query("SELECT count() FROM beats").result_rows == [(2,)]


def test_read_only_refuses_file_writes(sql_endpoint, tmp_path: Path) -> None:
    target = tmp_path / "out.csv"
    for sql in (f"SELECT 1 INTO OUTFILE '{target}'",
                f"INSERT INTO FUNCTION file('{target}', 'CSV') SELECT 1"):
        status, body = http(sql_endpoint.url, sql)
        assert status == 400 and ("(READONLY)" in body or "(INTO_OUTFILE_NOT_ALLOWED)" in body)
    assert not target.exists()


def test_errors_are_400_with_clickhouse_message(sql_endpoint) -> None:
    status, body = http(sql_endpoint.url, "SELEC 1")
    assert status == 400 and body.startswith("Code: 62. DB::Exception: Syntax error")
    status, body = http(sql_endpoint.url, "SELECT * FROM no_such_table")
    assert status == 400 and "(UNKNOWN_TABLE)" in body
    status, body = http(sql_endpoint.url, "SELECT 1", default_format="Parquet")
    assert status == 400 and "UNKNOWN_FORMAT" in body
    assert http(sql_endpoint.url, "  ")[0] == 400


def test_writable_endpoint_allows_inserts(writable_sql_endpoint) -> None:
    status, body = http(writable_sql_endpoint.url, "INSERT INTO beats (rank, ts) VALUES (3, 3)")
    assert (status, body) == (200, "")
    assert writable_sql_endpoint.db.query("SELECT rank FROM beats").result_rows == [(3,)]


# ---------------------------------------------------------------------------------------------
# `rankwatch sql`


def _settings(tmp_path: Path, url: str, db: Database, port: int) -> Settings:
    return Settings.load(env={}, home=tmp_path, clickhouse_url=url,
                         clickhouse_database=db.database, sql_port=port)


def _env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKWATCH_")}
    env.update(RANKWATCH_HOME=str(settings.home), RANKWATCH_CLICKHOUSE_URL=settings.clickhouse,
               RANKWATCH_CLICKHOUSE_DATABASE=settings.clickhouse_database,
               RANKWATCH_SQL_PORT=str(settings.sql_port))
    return env


def _embedded(url: str) -> None:
    if not url.startswith("chdb://"):
        pytest.skip("runs against the embedded engine only")


def test_rankwatch_sql_goes_through_the_endpoint(sql_endpoint, beats: Database,
                                                 clickhouse_url: str, tmp_path: Path) -> None:
    _embedded(clickhouse_url)
    settings = _settings(tmp_path, clickhouse_url, beats, sql_endpoint.port)
    assert sql_command.execute(settings, QUERY, "CSV") == b'0,"dp0"\n1,"tp\'1"\n'
    # another process cannot open the engine this one holds: the answer came through the endpoint
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "sql", "-", "-f", "JSONEachRow"],
                         input=QUERY, capture_output=True, text=True, env=_env(settings),
                         timeout=120)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == '{"rank":0,"comm_id":"dp0"}\n{"rank":1,"comm_id":"tp\'1"}\n'
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "sql", "DROP TABLE beats"],
                         capture_output=True, text=True, env=_env(settings), timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("Code: 164. DB::Exception:")


def test_rankwatch_sql_without_a_worker_explains_the_held_database(
        clickhouse_db: Database, clickhouse_url: str, tmp_path: Path) -> None:
    _embedded(clickhouse_url)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        settings = _settings(tmp_path, clickhouse_url, clickhouse_db, s.getsockname()[1])
        out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "sql", "SELECT 1"],
                             capture_output=True, text=True, env=_env(settings), timeout=120)
    assert out.returncode == 1
    # chdb itself prints "Cannot lock file .../status. Another server instance ..." first
    assert BUSY_HINT in out.stderr
    assert "Traceback" not in out.stderr


def test_rankwatch_sql_opens_the_database_itself_when_free(clickhouse_db: Database,
                                                           clickhouse_url: str,
                                                           tmp_path: Path) -> None:
    """With no worker, the command opens the embedded database (here: this process's engine)."""
    _embedded(clickhouse_url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        settings = _settings(tmp_path, clickhouse_url, clickhouse_db, s.getsockname()[1])
        assert sql_command.execute(settings, "SELECT count() FROM beats", "TSV") == b"0\n"
