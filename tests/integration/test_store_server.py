"""The store endpoint (streams/store_server.py): clickhouse-connect, through streams.db with an
http:// URL, talks to the embedded database as to a ClickHouse server — Native inserts
(compressed or not) with deduplication tokens, bound parameters, errors with ClickHouse's own
text — and only with the stack's token, only on loopback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import clickhouse_connect
import numpy as np
import pytest

from streams.db import ClickHouseError, Database
from streams.sql_endpoint import bound_port
from streams.store_server import start_store_endpoint

TOKEN = "s3cret-token"


@pytest.fixture
def store(clickhouse_db: Database) -> Iterator[int]:
    if not clickhouse_db.target.embedded:
        pytest.skip("the store serves an embedded database")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="store", daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(start_store_endpoint(
        clickhouse_db.target.path, clickhouse_db.database, "127.0.0.1", 0, TOKEN), loop).result(30)
    try:
        yield bound_port(runner)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def summaries(n: int, first: int = 0) -> dict[str, np.ndarray]:
    return {"job_id": np.array(["j"] * n, object),
            "window_start": (np.arange(first, first + n, dtype=np.int64) + 1_700_000_000)
            * 1_000_000_000,
            "kernel": np.array([f"k{i % 3}" for i in range(n)], object),
            "rank": np.arange(first, first + n, dtype=np.int32), "stream": np.zeros(n, np.int64),
            "cluster": np.zeros(n, np.int32), "count": np.full(n, 7, np.int64),
            "p50_ns": np.ones(n, np.int64), "p99_ns": np.ones(n, np.int64)}


@pytest.mark.parametrize("compress", ["false", "lz4", "gzip"])
def test_a_worker_writes_and_reads_through_the_store(clickhouse_db: Database, store: int,
                                                     compress: str) -> None:
    url = f"http://rankwatch:{TOKEN}@127.0.0.1:{store}/?compress={compress}"
    with Database(url, clickhouse_db.database, create=False) as w:
        w.insert_columns("kernel_summaries", summaries(5000), {"insert_deduplication_token": "a"})
        w.insert_columns("kernel_summaries", summaries(5000), {"insert_deduplication_token": "a"})
        w.insert_columns("kernel_summaries", summaries(10, 9000),
                         {"insert_deduplication_token": "b"})
        # the rows are in the embedded database itself, once per token
        n = clickhouse_db.query("SELECT count(), sum(count) FROM kernel_summaries").result_rows
        assert n == [(5010, 5010 * 7)]
        got = w.query_columns("SELECT rank, kernel FROM kernel_summaries WHERE rank < {r:Int32} "
                              "ORDER BY rank", {"r": 3})
        assert got["rank"].tolist() == [0, 1, 2] and got["kernel"].tolist() == ["k0", "k1", "k2"]
        w.command("INSERT INTO diagnoses (job_id, incident_id, version, detected_ns, json) "
                  "FORMAT JSONEachRow\n{\"job_id\": \"j\", \"incident_id\": \"i\", "
                  f"\"version\": 1, \"detected_ns\": {time.time_ns()}, \"json\": \"{{}}\"}}")
        assert w.query("SELECT incident_id FROM diagnoses").result_rows == [("i",)]
        # parameters too long for a URL: clickhouse-connect sends a multipart form instead
        ids = [f"comm-{i:06d}-" + "x" * 40 for i in range(4000)]
        got = w.query_columns("SELECT length({ids:Array(String)}) AS n, "
                              "indexOf({ids:Array(String)}, {last:String}) AS at",
                              {"ids": ids, "last": ids[-1]})
        assert (int(got["n"][0]), int(got["at"][0])) == (4000, 4000)
        with pytest.raises(ClickHouseError) as e:
            w.query("SELECT * FROM no_such_table")
        assert e.value.code == 60 and "no_such_table" in e.value.message


def test_the_store_refuses_callers_without_the_token(clickhouse_db: Database,
                                                     store: int) -> None:
    for auth in ("rankwatch:wrong@", ""):
        with pytest.raises(ClickHouseError) as e:
            Database(f"http://{auth}127.0.0.1:{store}", clickhouse_db.database, create=False)
        assert "AUTHENTICATION_FAILED" in e.value.message


def test_the_store_serves_loopback_only(clickhouse_db: Database) -> None:
    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(start_store_endpoint(clickhouse_db.target.path, clickhouse_db.database,
                                         "0.0.0.0", 0, TOKEN))
    with pytest.raises(ValueError, match="token"):
        asyncio.run(start_store_endpoint(clickhouse_db.target.path, clickhouse_db.database,
                                         "127.0.0.1", 0, ""))


def test_a_request_cannot_lift_the_stores_limits(clickhouse_db: Database, store: int) -> None:
    """The store's settings are set after the caller's: a URL setting cannot raise the memory
    bound, and chdb's python() table function stays off."""
    client = clickhouse_connect.get_client(
        host="127.0.0.1", port=store, username="rankwatch", password=TOKEN,
        database=clickhouse_db.database, autogenerate_session_id=False)
    try:
        got = client.query("SELECT getSetting('allow_python_table_function'), "
                           "getSetting('max_memory_usage')",
                           settings={"max_memory_usage": 1 << 40}).result_rows
        assert [tuple(int(v) for v in r) for r in got] == [(0, 4 << 30)]
    finally:
        client.close()
