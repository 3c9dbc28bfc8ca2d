"""The SQL endpoint against the requests an operator probed it with: files written and read,
URLs and other servers reached, limits raised, session state left behind, the engine's own
operations, several statements in one request. Each must be refused by the engine (readonly=1 on
a fresh session, the engine's parser), the writer must keep its pace under heavy queries, and
anywhere but loopback a token is required. The probes go both to an endpoint started in this
process and through a real worker's endpoint (`rankwatch up`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ingest.batch import encode_batch
from rankwatch import stack
from rankwatch.commands import sql as sql_command
from streams.db import Database, SqlLimits
from streams.sql_endpoint import start_sql_endpoint, stop_sql_endpoint
from tests.integration.conftest import SqlEndpoint, serve_sql
from tests.integration.test_ingest_pipeline import Pipeline, pipeline  # noqa: F401 (a fixture)
from tests.integration.test_sql_endpoint import http
from tests.unit.test_poison_decode import valid_columns

HEAVY = "SELECT count() FROM system.numbers WHERE sipHash64(number) = 0"


def probes(d: Path, port: int) -> list[tuple[str, str]]:
    """(request, the ClickHouse error name expected)."""
    f = d / "f"
    heredoc = "SELECT replaceAll($$'$$,'''','') || 'text' AS x INTO OUTFILE '" + str(f) + "' --'"
    return [
        # files written (a guard that strips strings and comments by hand misread these two)
        (heredoc, "INTO_OUTFILE_NOT_ALLOWED"),
        ("/* /* */ ' */ INSERT INTO FUNCTION file('" + str(f) + "','TSV','x String') "
         "VALUES ('x')", "READONLY"),
        (f"SELECT 1 INTO OUTFILE '{f}' FORMAT CSV", "INTO_OUTFILE_NOT_ALLOWED"),
        (f"SHOW TABLES INTO OUTFILE '{f}'", "INTO_OUTFILE_NOT_ALLOWED"),
        # files, URLs, other servers and programs
        ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "READONLY"),
        (f"SELECT * FROM url('http://127.0.0.1:{port}/ping', 'LineAsString')", "READONLY"),
        ("SELECT * FROM s3('http://127.0.0.1:1/bucket/key.csv', 'CSV')", "READONLY"),
        ("SELECT * FROM remote('127.0.0.1:1', 'system.one')", "READONLY"),
        ("SELECT * FROM executable('x.sh', 'TSV', 'x String')", "READONLY"),
        ("SELECT * FROM sqlite('/etc/passwd', 't')", "READONLY"),
        ("SELECT * FROM python('sys')", "FUNCTION_NOT_ALLOWED"),
        # limits a caller may not raise
        ("SELECT 1 SETTINGS max_execution_time = 0", "READONLY"),
        ("SELECT 1 SETTINGS max_memory_usage = 0", "READONLY"),
        ("SET max_result_rows = 1", "READONLY"),
        # state left for later callers, the engine's operations, several statements
        ("KILL QUERY WHERE 0; USE system", "SYNTAX_ERROR"),
        ("SELECT 1; SET max_execution_time = 0", "SYNTAX_ERROR"),
        ("USE system", "READONLY"),
        ("KILL QUERY WHERE 0", "READONLY"),
        ("SYSTEM STOP MERGES", "READONLY"),
        ("SYSTEM STOP TTL MERGES", "READONLY"),
        ("SYSTEM STOP MOVES", "READONLY"),
    ]


def test_hostile_probes_are_refused(sql_endpoint: SqlEndpoint, tmp_path: Path) -> None:
    db: Database = sql_endpoint.db
    db.insert_columns("beats", {"rank": np.array([0], np.int32),
                                "ts": np.array([time.time_ns()])})
    for sql, code in probes(tmp_path, sql_endpoint.port):
        status, body = http(sql_endpoint.url, sql)
        assert status == 400 and f"({code})" in body, (sql, status, body)
        assert "Traceback" not in body
    assert not any(tmp_path.iterdir())  # no file written
    # nothing persisted into a later caller's session
    assert http(sql_endpoint.url, "SELECT currentDatabase() = 'system', "
                "getSetting('max_result_rows'), getSetting('readonly')") == (
                    200, "0\t10000000\t1\n")
    assert http(sql_endpoint.url, "SELECT count() FROM beats") == (200, "1\n")


def test_hostile_probes_are_refused_by_a_real_worker(pipeline: Pipeline,  # noqa: F811
                                                     tmp_path: Path) -> None:
    """The same probes through the SQL endpoint of a worker `rankwatch up` started, with its
    own database and default settings: each refused, no file written, nothing left in the
    session, and the worker unharmed (same process, healthy, still storing)."""
    s = pipeline.settings
    pid = stack.worker_daemon(s).pid()
    assert pid is not None
    url = stack.sql_endpoint(s) + "/"
    for sql, code in probes(tmp_path, s.sql_port):  # url() aims at the worker's own endpoint
        status, body = http(url, sql)
        assert status == 400 and f"({code})" in body, (sql, status, body)
        assert "Traceback" not in body
    assert not any(tmp_path.iterdir())  # no file written
    assert not list(s.home.rglob("f"))  # nor beside the worker (its working directory)
    assert http(url, "SELECT currentDatabase() = 'system', getSetting('readonly')") == (
        200, "0\t1\n")
    pub = pipeline.publisher()
    pub.publish("ops", encode_batch("ops", "after-probes",
                                    valid_columns("ops", 100, time.time_ns())))
    assert pub.flush(30) == 0
    assert pipeline.wait_count("ops", 100, "job_id = 'after-probes'") == 100
    assert stack.worker_daemon(s).pid() == pid
    assert http(url + "ping") == (200, "Ok.\n")


def test_memory_and_result_limits_hold(clickhouse_db: Database) -> None:
    with serve_sql(clickhouse_db, limits=SqlLimits(max_memory_bytes=256 << 20,
                                                   max_result_rows=1000)) as ep:
        status, body = http(ep.url, "SELECT length(groupArray(number)) FROM numbers(200000000)")
        assert status == 400 and "(MEMORY_LIMIT_EXCEEDED)" in body
        status, body = http(ep.url, "SELECT number FROM system.numbers LIMIT 5000")
        assert status == 400 and "(TOO_MANY_ROWS_OR_BYTES)" in body
        assert http(ep.url, "SELECT count() FROM numbers(5000)") == (200, "5000\n")


def test_heavy_queries_stop_at_their_limit_and_do_not_hold_up_inserts(
        clickhouse_db: Database) -> None:
    """Queries run on threads of their own: while two heavy ones run to their time limit (and a
    third waits or is refused), the writer's inserts on the database thread keep going."""
    limits = SqlLimits(max_execution_time_s=3, concurrency=2, queue=0)
    with serve_sql(clickhouse_db, limits=limits) as ep:
        results: list[tuple[int, str]] = []
        threads = [threading.Thread(target=lambda: results.append(http(ep.url, HEAVY)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert http(ep.url, "SELECT 1")[0] == 503  # both slots taken, no queue
        inserts, worst, t0 = 0, 0.0, time.monotonic()
        while any(t.is_alive() for t in threads):
            t1 = time.monotonic()
            clickhouse_db.insert_columns("beats", {"rank": np.array([inserts], np.int32),
                                                   "ts": np.array([time.time_ns()])})
            worst = max(worst, time.monotonic() - t1)
            inserts += 1
        for t in threads:
            t.join()
        print(f"\n{inserts} inserts in {time.monotonic() - t0:.1f} s while two queries ran to "
              f"their {limits.max_execution_time_s} s limit; slowest insert "
              f"{worst * 1000:.0f} ms")
        assert sorted(s for s, _ in results) == [400, 400]
        assert all("(TIMEOUT_EXCEEDED)" in b for _, b in results)
        assert inserts >= 10
        assert clickhouse_db.query("SELECT count() FROM beats").result_rows == [(inserts,)]
        assert http(ep.url, "SELECT 1") == (200, "1\n")


def test_beyond_loopback_a_token_is_required(clickhouse_db: Database) -> None:
    with pytest.raises(ValueError, match="RANKWATCH_SQL_TOKEN"):
        asyncio.run(start_sql_endpoint(clickhouse_db, "0.0.0.0", 0))
    with serve_sql(clickhouse_db, token="s3cret") as ep:
        status, body = http(ep.url, "SELECT 1")
        assert status == 401 and "(AUTHENTICATION_FAILED)" in body
        req = urllib.request.Request(ep.url, data=b"SELECT 1", method="POST",
                                     headers={"Authorization": "Bearer wrong"})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(req, timeout=30)
        assert sql_command.query_endpoint(ep.url, "SELECT 2", "TSV", token="s3cret") == b"2\n"
        assert http(f"{ep.url}ping") == (200, "Ok.\n")  # health needs no token


def test_beyond_loopback_the_endpoint_warns_and_names_a_writable_one(
        clickhouse_db: Database, caplog: pytest.LogCaptureFixture) -> None:
    """An endpoint bound beyond loopback (with its token) says so in the worker's log, and says
    WRITABLE when it is."""

    async def start_stop(writable: bool) -> None:
        await stop_sql_endpoint(await start_sql_endpoint(clickhouse_db, "0.0.0.0", 0,
                                                         writable=writable, token="s3cret"))

    caplog.set_level(logging.WARNING, logger="streams.sql_endpoint")
    for writable in (False, True):
        caplog.clear()
        asyncio.run(start_stop(writable))
        (w,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert w.startswith("SQL endpoint bound to 0.0.0.0 (beyond loopback)"), w
        assert "requests need the token" in w and "s3cret" not in w, w
        assert ("WRITABLE" in w) == writable, w
