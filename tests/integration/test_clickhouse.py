"""streams.db and streams.writer against the real embedded ClickHouse (chdb): migrations, the
schema against the record contract, numpy inserts, deduplication, topologies, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from ingest.batch import TIME_COLUMN, Coded, decode_batch, encode_batch
from ingest.records import COLUMNS, MODELS, Communicator, JobTopology
from streams.db import (
    ClickHouseError,
    Database,
    MigrationError,
    SqlLimits,
    applied_migrations,
    load_migrations,
    migrate,
)
from streams.writer import (
    ClickHouseWriter,
    DlqRow,
    IngestMetric,
    dedup_token,
    insert_settings,
    raw_columns,
)

#: An hour ago, in whole seconds (ns). Raw rows are kept a day after max(record time, ingest time).
T0 = (time.time_ns() // 1_000_000_000 - 3600) * 1_000_000_000


def ops_columns(n: int, t0: int = T0) -> dict[str, object]:
    i = np.arange(n)
    return {
        "rank": (i % 7).astype(np.int32),
        "comm_id": (i % 3, ["dp0", "tp1", "pp2"]),
        "op_seq": i // 7,
        "op": (i % 2, ["AllReduce", "Send"]),
        "bytes": 1_000 + i,
        "peer": np.where(i % 2 == 1, (i + 1) % 7, -1),
        "t_enqueue": t0 + i * 1_000 + 1,
        "t_start": t0 + i * 1_000 + 7,
        "t_end": np.where(i % 5 == 4, 0, t0 + i * 1_000 + 999),
        "step": i // 70,
    }


def ops_batch(job_id: str, n: int, t0: int = T0, seq: int = 0):
    return decode_batch(encode_batch("ops", job_id, ops_columns(n, t0), producer="h0", seq=seq))


def count(db: Database, table: str) -> int:
    return int(db.query(f"SELECT count() FROM {table}").result_rows[0][0])


# ---------------------------------------------------------------------------------------------
# Migrations


def test_migrations_apply_once(clickhouse_empty_db: Database) -> None:
    db = clickhouse_empty_db
    applied = migrate(db)
    assert [m.name for m in applied] == [m.name for m in load_migrations()]
    assert migrate(db) == []
    recorded = applied_migrations(db)
    assert {v: c for v, (_, c) in recorded.items()} == {m.version: m.checksum for m in applied}
    tables = {r[0] for r in db.query("SHOW TABLES").result_rows}
    assert {*COLUMNS, "jobs", "dlq", "ingest_metrics", "schema_migrations"} <= tables


def test_migrations_catch_checksum_drift(clickhouse_empty_db: Database, tmp_path: Path) -> None:
    db = clickhouse_empty_db
    first = tmp_path / "001_first.sql"
    first.write_text("CREATE TABLE IF NOT EXISTS a (x Int8) ENGINE = MergeTree ORDER BY x;\n")
    assert [m.name for m in migrate(db, tmp_path)] == ["001_first"]
    (tmp_path / "002_second.sql").write_text(
        "CREATE TABLE IF NOT EXISTS b (y Int8) ENGINE = MergeTree ORDER BY y;\n"
        "INSERT INTO b VALUES (1);\n")
    assert [m.name for m in migrate(db, tmp_path)] == ["002_second"]
    assert count(db, "b") == 1  # applied once: the second run did not insert again
    first.write_text(first.read_text().replace("Int8", "Int16"))
    with pytest.raises(MigrationError, match=r"001_first\.sql changed after it was applied"):
        migrate(db, tmp_path)


def test_a_failing_migration_is_not_recorded(clickhouse_empty_db: Database,
                                             tmp_path: Path) -> None:
    db = clickhouse_empty_db
    (tmp_path / "001_bad.sql").write_text(
        "CREATE TABLE IF NOT EXISTS a (x Int8) ENGINE = MergeTree ORDER BY x;\nSELEC 1;\n")
    with pytest.raises(ClickHouseError, match="SYNTAX_ERROR"):
        migrate(db, tmp_path)
    assert applied_migrations(db) == {}


def test_raw_tables_follow_the_record_contract(clickhouse_db: Database) -> None:
    for kind in MODELS:  # raw kinds; derived kinds' tables are tested in test_streams_tables
        spec = COLUMNS[kind]
        rows = clickhouse_db.query(f"DESCRIBE TABLE {kind}").result_rows
        types = {r[0]: r[1] for r in rows}
        assert list(types) == ["job_id", *(c.name for c in spec), "src_partition", "src_offset",
                               "ingest_ts"], kind
        for c in spec:
            if c.kind == "str":
                assert types[c.name] == "LowCardinality(String)", (kind, c.name)
            elif c.name in ("t_enqueue", "t_start", "t_end", "ts", "stage_ts"):
                assert types[c.name] == "DateTime64(9, 'UTC')", (kind, c.name)
            else:
                assert types[c.name] == ("Int32" if c.dtype == np.int32 else "Int64"), c.name
        sorting = clickhouse_db.query(
            "SELECT sorting_key FROM system.tables WHERE database = currentDatabase() "
            "AND name = {t:String}", {"t": kind}).result_rows[0][0]
        assert sorting == f"job_id, {TIME_COLUMN[kind]}, rank"


# ---------------------------------------------------------------------------------------------
# Writes


def test_ops_batches_round_trip(clickhouse_db: Database) -> None:
    writer = ClickHouseWriter(clickhouse_db, clock=lambda: T0 + 2_000_000_000)
    batches = [ops_batch("job-a", 50), ops_batch("job-b", 20, seq=1)]
    n = asyncio.run(writer.write("ops", batches, dedup_token("rw.ops", 3, 100, 101),
                                 sources=[(3, 100), (3, 101)]))
    assert n == 70
    got = clickhouse_db.query_columns(
        "SELECT * FROM ops ORDER BY job_id, t_start, rank")
    want = raw_columns("ops", batches, T0 + 2_000_000_000, [(3, 100), (3, 101)])
    assert list(got) == list(want)
    for name, values in want.items():
        stored = got[name]
        if stored.dtype.kind == "M":  # DateTime64(9) comes back as datetime64[ns]: same ticks
            stored = stored.view(np.int64)
        np.testing.assert_array_equal(stored, values, err_msg=name)
    assert got["t_end"].view(np.int64).min() == 0  # in-flight ops keep t_end = 0
    lag = writer.last_lag["ops"]
    assert lag.rows == 70 and lag.max_ms == pytest.approx(2_000 - 7e-6)


def test_same_token_is_stored_once(clickhouse_db: Database) -> None:
    writer = ClickHouseWriter(clickhouse_db)
    batch = ops_batch("job-d", 40)
    token = dedup_token("rw.ops", 0, 5, 5)

    async def go() -> None:
        await writer.write("ops", [batch], token)
        await writer.write("ops", [batch], token)  # a retry: ingest_ts differs, token does not
        assert count(clickhouse_db, "ops") == 40
        await writer.write("ops", [batch], dedup_token("rw.ops", 0, 6, 6))
        assert count(clickhouse_db, "ops") == 80

    asyncio.run(go())


def test_insert_columns_dedup_and_errors(clickhouse_db: Database) -> None:
    cols = raw_columns("beats", [decode_batch(encode_batch(
        "beats", "job-e", {"rank": np.arange(4), "ts": T0 + np.arange(4)}))], T0)
    for _ in range(2):
        assert clickhouse_db.insert_columns("beats", cols, insert_settings("tok-1")) == 4
    assert count(clickhouse_db, "beats") == 4
    with pytest.raises(ValueError, match="no column"):
        clickhouse_db.insert_columns("beats", {"nope": np.arange(3)})
    with pytest.raises(ValueError, match="unequal lengths"):
        clickhouse_db.insert_columns("beats", {"rank": np.arange(3), "ts": np.arange(2)})
    with pytest.raises(ClickHouseError, match="UNKNOWN_TABLE"):
        clickhouse_db.insert_columns("no_such_table", {"x": np.arange(3)})


def test_async_calls_share_one_thread(clickhouse_db: Database) -> None:
    writer = ClickHouseWriter(clickhouse_db)
    threads: set[str] = set()

    async def one(i: int) -> int:
        n = await writer.write("ops", [ops_batch(f"job-{i}", 10)], f"tok-{i}")
        threads.add(await clickhouse_db._acall(lambda: threading.current_thread().name))
        return n

    async def go() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(go()) == [10] * 8
    assert count(clickhouse_db, "ops") == 80
    assert len(threads) == 1


def test_busy_counts_a_threads_calls_not_their_wait_in_the_queue(
        clickhouse_db: Database) -> None:
    """`busy_s` bills each calling thread the time its calls ran on the database thread: a
    query queued behind another thread's long call waited for it, and is billed only its own
    run (the analyst paces its tries by this; the process's CPU would bill it the other's)."""
    started = threading.Event()

    def hold() -> None:
        started.set()
        time.sleep(0.5)

    def long_call() -> float:
        b0 = clickhouse_db.busy_s()
        clickhouse_db._call(hold)
        return clickhouse_db.busy_s() - b0

    other: list[float] = []
    t = threading.Thread(target=lambda: other.append(long_call()))
    t.start()
    assert started.wait(10)
    b0, w0 = clickhouse_db.busy_s(), time.perf_counter()
    clickhouse_db.query("SELECT 1")  # queued behind the 0.5 s call
    waited, billed = time.perf_counter() - w0, clickhouse_db.busy_s() - b0
    t.join()
    assert other[0] >= 0.5  # the long call is billed to its own thread
    assert billed > 0  # the query ran, and is billed to this thread
    assert waited - billed >= 0.3  # ... without the time it queued behind the other call


def test_cpu_s_bills_the_calling_thread_the_database_threads_cpu(
        clickhouse_db: Database) -> None:
    """`cpu_s` bills each calling thread the database thread's CPU on its calls (what a
    diagnosis's reads cost the worker: `rankwatch_analysis_cpu_seconds_total`): a query's
    decoding is billed to the thread that asked, never more than the time it ran, and a call
    that sleeps there is billed its time (`busy_s`) but almost no CPU."""
    def spin() -> None:
        t = time.thread_time()
        while time.thread_time() - t < 0.2:
            pass

    c0, b0 = clickhouse_db.cpu_s(), clickhouse_db.busy_s()
    clickhouse_db._call(spin)
    cpu, busy = clickhouse_db.cpu_s() - c0, clickhouse_db.busy_s() - b0
    assert 0.2 <= cpu <= busy + 0.01  # (the two clocks are read a few ns apart)
    other: list[float] = []
    t = threading.Thread(target=lambda: other.append(clickhouse_db.cpu_s()))
    t.start()
    t.join()
    assert other == [0.0]  # another thread was billed none of it
    c0, b0 = clickhouse_db.cpu_s(), clickhouse_db.busy_s()
    clickhouse_db._call(time.sleep, 0.3)
    assert clickhouse_db.busy_s() - b0 >= 0.3 and clickhouse_db.cpu_s() - c0 < 0.1
    c0 = clickhouse_db.cpu_s()
    rows = clickhouse_db.query("SELECT number FROM numbers(200000)").result_rows
    assert len(rows) == 200_000 and clickhouse_db.cpu_s() > c0


def test_urgent_calls_go_ahead_of_the_queued_ones(clickhouse_db: Database) -> None:
    """A call inside `urgent()` (the analyst's reads) runs before the calls already waiting
    for the database thread (the ingest's inserts), after the one running; the others keep
    their order. Without it the analyst's read queued behind every insert."""
    order: list[str] = []
    started = threading.Event()
    release = threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)
        order.append("running")

    def call(name: str, urgent: bool = False) -> threading.Thread:
        def run() -> None:
            with clickhouse_db.urgent() if urgent else contextlib.nullcontext():
                clickhouse_db._call(order.append, name)
        t = threading.Thread(target=run)
        t.start()
        return t

    threads = [threading.Thread(target=clickhouse_db._call, args=(hold,))]
    threads[0].start()
    assert started.wait(10)
    queue = clickhouse_db._executor

    def queued(n: int) -> None:
        deadline = time.monotonic() + 10
        while len(queue._normal) + len(queue._urgent) < n and time.monotonic() < deadline:
            time.sleep(0.005)

    for i in range(3):  # queued behind the running call, in this order
        threads.append(call(f"insert-{i}"))
        queued(i + 1)
    threads.append(call("read", urgent=True))
    queued(4)
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["running", "read", "insert-0", "insert-1", "insert-2"]
    assert clickhouse_db.query("SELECT 1").result_rows == [(1,)]  # the thread still serves


def test_an_urgent_command_goes_ahead_of_the_queued_inserts(clickhouse_db: Database) -> None:
    """`acommand(..., urgent=True)` (a diagnosis's version, stored before it is announced)
    runs before the calls the event loop queued for the database thread ahead of it (the
    raw sinks' inserts); without it, it waited behind every one of them."""
    started = threading.Event()
    release = threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    holder = threading.Thread(target=clickhouse_db._call, args=(hold,))
    holder.start()
    assert started.wait(10)
    done: list[str] = []

    async def run() -> None:
        async def one(name: str, urgent: bool) -> None:
            await clickhouse_db.acommand(f"SELECT '{name}'", urgent=urgent)
            done.append(name)

        tasks = [asyncio.create_task(one(f"insert-{i}", False)) for i in range(3)]
        tasks.append(asyncio.create_task(one("diagnosis", True)))
        queue = clickhouse_db._executor
        while len(queue._normal) + len(queue._urgent) < 4:
            await asyncio.sleep(0.005)
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

    asyncio.run(run())
    holder.join(10)
    assert done == ["diagnosis", "insert-0", "insert-1", "insert-2"]


def test_query_parameters_and_empty_results(clickhouse_db: Database) -> None:
    asyncio.run(ClickHouseWriter(clickhouse_db).write("ops", [ops_batch("job-p", 14)], "t"))
    got = clickhouse_db.query_columns(
        "SELECT rank, t_start FROM ops WHERE job_id = {job:String} AND rank < {r:Int32}",
        {"job": "job-p", "r": 2})
    assert sorted(got["rank"].tolist()) == [0, 0, 1, 1]
    empty = clickhouse_db.query_columns("SELECT rank, comm_id, t_start FROM ops WHERE 0")
    assert {k: v.dtype for k, v in empty.items()} == {
        "rank": np.dtype(np.int32), "comm_id": np.dtype(object),
        "t_start": np.dtype("datetime64[ns]")}


def test_coded_strings_round_trip_through_native_inserts(clickhouse_db: Database) -> None:
    """Dictionary-encoded columns (UInt8 and UInt16 LowCardinality indexes, non-ASCII, an
    unused blanked dictionary entry) and several batches with their own dictionaries."""
    rng = np.random.default_rng(7)
    n = 3_000
    kernels = [f"gemm_{i}_ü" for i in range(300)]  # > 256 distinct: UInt16 indexes
    cols: dict[str, Any] = {"rank": rng.integers(0, 64, n), "stream": rng.integers(0, 4, n),
            "kernel": (rng.integers(0, 300, n), kernels),
            "t_start": T0 + np.arange(n), "duration": rng.integers(1, 10**6, n)}
    doc = orjson.loads(encode_batch("kernels", "job-k", cols))
    doc["cols"]["kernel"]["d"].append("x" * 1000)  # unused and too long: harmless
    first = decode_batch(orjson.dumps(doc), coded=True)
    second = decode_batch(encode_batch("kernels", "job-k2", {
        **{k: v[:10] for k, v in cols.items() if k != "kernel"}, "kernel": ["ñ"] * 10}),
        coded=True)
    writer = ClickHouseWriter(clickhouse_db, clock=lambda: T0)
    assert asyncio.run(writer.write("kernels", [first, second], "k:0:0-1",
                                    sources=[(0, 0), (0, 1)])) == n + 10
    got = clickhouse_db.query_columns(
        "SELECT job_id, kernel, rank, src_offset FROM kernels ORDER BY job_id, t_start, rank")
    want = raw_columns("kernels", [first, second], T0, [(0, 0), (0, 1)])
    order = np.lexsort((want["rank"], want["t_start"], want["job_id"].astype(str)))
    for name in ("job_id", "kernel", "rank", "src_offset"):
        np.testing.assert_array_equal(got[name], want[name][order], err_msg=name)
    assert got["kernel"][-1] == "ñ" and "gemm_299_ü" in set(got["kernel"])


def test_native_reader_agrees_with_clickhouse_connect(clickhouse_db: Database) -> None:
    """query_columns reads Native output itself; same names, dtypes and values as
    clickhouse-connect's numpy results. Types it does not read (Nullable) still work."""
    sql = """SELECT toInt32(number) AS a, toUInt64(number) AS b, toFloat64(number) / 3 AS c,
        toString(number) AS s, toLowCardinality(toString(number % 300)) AS lc,
        toDateTime64(number, 9, 'UTC') AS t9, toDateTime64(number, 3, 'UTC') AS t3,
        toInt8(number) AS i8, number % 2 = 0 AS flag, toDateTime(number, 'UTC') AS dt,
        toDate(number) AS d FROM numbers({n:UInt32})"""
    got = clickhouse_db.query_columns(sql, {"n": 70_000})
    ctx = clickhouse_db._client.create_query_context(query=sql, parameters={"n": 70_000},
                                                     use_numpy=True)
    # clickhouse-connect sets np_result on numpy queries; its QueryResult type does not declare it
    reference = clickhouse_db._client.query(context=ctx).np_result  # type: ignore[attr-defined]
    assert list(got) == list(reference.dtype.names)
    for name in got:
        assert got[name].dtype == reference[name].dtype, name
        np.testing.assert_array_equal(got[name], reference[name], err_msg=name)
    coded = clickhouse_db.query_coded(sql, {"n": 70_000})
    lc = coded["lc"]
    assert isinstance(lc, Coded) and len(lc.values) <= 301  # the dictionary, not 70,000 rows
    np.testing.assert_array_equal(lc.strings(), reference["lc"])
    np.testing.assert_array_equal(coded["a"], reference["a"])
    for _ in range(2):  # the second time straight to the generic reader
        nullable = clickhouse_db.query_columns(
            "SELECT number AS n, if(number = 1, NULL, number) AS m FROM numbers(3)")
        assert nullable["n"].tolist() == [0, 1, 2] and nullable["m"][1] is None


def test_topologies_round_trip(clickhouse_db: Database) -> None:
    topo = JobTopology(job_id="job-t", ts=T0, world_size=4, tp=2, dp=2,
                       hosts=["h0", "h0", "h1", "h1"],
                       communicators=[Communicator(comm_id="tp0", kind="tp", members=[0, 1]),
                                      Communicator(comm_id="dp0", kind="dp", members=[0, 2])])
    newer = topo.model_copy(update={"ts": T0 + 1, "microbatches": 8})
    writer = ClickHouseWriter(clickhouse_db)
    asyncio.run(writer.write_topologies([topo], "jobs:0:0-0"))
    asyncio.run(writer.write_topologies([newer], "jobs:0:1-1"))
    rows = clickhouse_db.query(
        "SELECT topology, hosts[3], comm_members[2], microbatches FROM jobs FINAL").result_rows
    assert len(rows) == 1
    stored, host_of_rank_2, dp_members, microbatches = rows[0]
    assert JobTopology.model_validate_json(stored) == newer
    assert (host_of_rank_2, dp_members, microbatches) == ("h1", [0, 2], 8)


def test_dead_letters_and_metrics(clickhouse_db: Database) -> None:
    writer = ClickHouseWriter(clickhouse_db)
    bad = DlqRow(T0, "rw.ops", 2, 17, "rank", 3, "-1 is below the minimum 0",
                 b'{"v": 1, "kind": "ops"}\xff')
    assert asyncio.run(writer.write_dlq([bad], dedup_token("rw.dlq", 0, 9, 9))) == 1
    assert asyncio.run(writer.write_dlq([bad], dedup_token("rw.dlq", 0, 9, 9))) == 1
    rows = clickhouse_db.query("SELECT topic, partition, offset, field, row, reason, payload "
                               "FROM dlq").result_rows
    assert len(rows) == 1
    assert rows[0][:6] == ("rw.ops", 2, 17, "rank", 3, "-1 is below the minimum 0")
    payload = clickhouse_db.query("SELECT hex(payload) FROM dlq").result_rows[0][0]
    assert bytes.fromhex(payload) == bad.payload
    metric = IngestMetric(T0, "worker-1", "rw.ops", 2, 70, 2, 12.5, 40.0)
    assert asyncio.run(writer.write_metrics([metric])) == 1
    assert clickhouse_db.query("SELECT worker, rows, lag_p50_ms, toUnixTimestamp64Milli(ts) "
                               "FROM ingest_metrics").result_rows == [
        ("worker-1", 70, 12.5, T0 // 1_000_000)]


def test_writer_rejects_mixed_kinds(clickhouse_db: Database) -> None:
    beats = decode_batch(encode_batch("beats", "j", {"rank": [0], "ts": [T0]}))
    with pytest.raises(ValueError, match="a 'beats' batch"):
        asyncio.run(ClickHouseWriter(clickhouse_db).write("ops", [beats], "t"))
    assert asyncio.run(ClickHouseWriter(clickhouse_db).write("ops", [], "t")) == 0


# ---------------------------------------------------------------------------------------------
# The SQL path (sessions, read-only)


def test_execute_sql_sessions_do_not_leak(clickhouse_db: Database) -> None:
    db = clickhouse_db
    assert db.execute_sql("SELECT currentDatabase()", "TSV") == f"{db.database}\n".encode()
    db.execute_sql("USE system", "TSV", readonly=False)
    db.execute_sql("SET max_threads = 1", "TSV", readonly=False)
    assert db.execute_sql("SELECT currentDatabase(), getSetting('max_threads') = 1",
                          "TSV") == f"{db.database}\t0\n".encode()
    with pytest.raises(ClickHouseError, match="READONLY") as e:
        db.execute_sql("INSERT INTO beats (rank, ts) VALUES (1, 1)", "TSV")
    assert e.value.code == 164
    # the writer's own connection is not read-only after the endpoint's query
    db.insert_columns("beats", {"rank": np.array([1], np.int32), "ts": np.array([T0])})
    assert db.execute_sql("SELECT count() FROM beats", "TSV") == b"1\n"
    assert db.execute_sql("INSERT INTO beats (rank, ts) VALUES (2, 2)", "TSV",
                          readonly=False) == b""
    assert count(db, "beats") == 2


def test_every_call_gets_a_fresh_read_only_session_with_limits_it_cannot_raise(
        clickhouse_db: Database) -> None:
    """A read-only call's session has the limits and readonly=1; SET, USE and SETTINGS
    cannot change them, and nothing carries over to the next call or the writer."""
    db = clickhouse_db
    limits = SqlLimits(max_execution_time_s=7, max_memory_bytes=300 << 20)
    assert db.execute_sql("SELECT getSetting('readonly'), getSetting('max_execution_time'), "
                          "getSetting('max_memory_usage')", "TSV", limits=limits
                          ) == f"1\t7\t{300 << 20}\n".encode()
    for sql in ("SET max_execution_time = 0", "SELECT 1 SETTINGS max_memory_usage = 0",
                "SELECT 1 SETTINGS readonly = 0", "USE system"):
        with pytest.raises(ClickHouseError, match="READONLY"):
            db.execute_sql(sql, "TSV", limits=limits)
    with pytest.raises(ClickHouseError, match="MEMORY_LIMIT_EXCEEDED"):
        db.execute_sql("SELECT length(groupArray(number)) FROM numbers(200000000)", "TSV",
                       limits=limits)
    with pytest.raises(ClickHouseError, match="TIMEOUT_EXCEEDED"):
        db.execute_sql("SELECT count() FROM system.numbers WHERE sipHash64(number) = 0", "TSV",
                       limits=SqlLimits(max_execution_time_s=1))
    with pytest.raises(ClickHouseError, match="Multi-statements are not allowed"):
        db.execute_sql("SELECT 1; SELECT 2", "TSV")
    db.insert_columns("beats", {"rank": np.array([1], np.int32), "ts": np.array([T0])})
    assert count(db, "beats") == 1


def test_execute_sql_format_rules(clickhouse_db: Database) -> None:
    db = clickhouse_db
    assert db.execute_sql("SELECT 1 AS x", "JSONEachRow") == b'{"x":1}\n'
    assert db.execute_sql("SELECT 1 AS x FORMAT CSVWithNames", "JSONEachRow") == b'"x"\n1\n'
    assert db.execute_sql("SELECT 1 AS x;", "TSVWithNames") == b"x\n1\n"
    with pytest.raises(ClickHouseError, match="UNKNOWN_FORMAT"):
        db.execute_sql("SELECT 1", "TSV; DROP TABLE ops")


def test_closed_database_says_so(clickhouse_url: str) -> None:
    db = Database(clickhouse_url, "t_closed")
    db.command("DROP DATABASE t_closed")
    db.close()
    with pytest.raises(ClickHouseError, match="closed"):
        db.query("SELECT 1")


def test_old_records_are_kept_a_day_after_they_are_stored(clickhouse_db: Database) -> None:
    """TTL is greatest(record time, ingest_ts) + 1 day: an imported trace from last month stays;
    rows both recorded and stored long ago go at the next TTL merge."""
    month_ago = T0 - 30 * 86_400 * 1_000_000_000
    batch = ops_batch("job-old", 10, month_ago)
    asyncio.run(ClickHouseWriter(clickhouse_db).write("ops", [batch], "fresh"))
    asyncio.run(ClickHouseWriter(clickhouse_db, clock=lambda: month_ago + 1).write(
        "ops", [ops_batch("job-gone", 10, month_ago)], "stale"))
    clickhouse_db.command("OPTIMIZE TABLE ops FINAL")
    assert clickhouse_db.query("SELECT job_id, count() FROM ops GROUP BY job_id").result_rows \
        == [("job-old", 10)]
