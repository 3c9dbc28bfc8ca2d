"""The example queries in sql/queries/ against derived tables built from simulated jobs, and the
derived runner in process: a hung job, a job of one rank, windows that survive a restart."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ingest.batch import TIME_COLUMN, RecordBatch, decode_batch
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation
from ingest.units import SECOND as SEC
from streams.db import Database
from streams.derived import DerivedConfig, DerivedRunner, ObservingStore
from streams.kernel_summaries import KernelParams, KernelSummarizer
from streams.writer import ClickHouseWriter

QUERIES = Path(__file__).parents[2] / "sql" / "queries"


def config() -> DerivedConfig:
    return DerivedConfig(lateness_ns=SEC, iteration_window_ns=5 * SEC,
                         kernels=KernelParams(window_ns=10 * SEC))


async def _nothing(kind: str, job: str, data: bytes) -> None:
    decode_batch(data)  # what is published is a valid batch of the derived kind


class Clock:
    """The runner's wall clock: batches here arrive as fast as ClickHouse stores them, so time
    is advanced by hand (50 ms a batch, then a pause in which every source falls quiet). One
    clock for every runner, so checkpoints of a later runner are newer (`stream_state`)."""

    def __init__(self) -> None:
        self.ns = time.time_ns()

    def __call__(self) -> int:
        return self.ns

    def pause(self, s: float) -> None:
        self.ns += int(s * SEC)


CLOCK = Clock()


async def load(db: Database, cfg: JobConfig, faults: list[str] = (),  # type: ignore[assignment]
               runner: DerivedRunner | None = None, upto: float = 1.0,
               kinds: frozenset[str] | None = None, topology: bool = True,
               in_flight_first: bool = False) -> DerivedRunner:
    """Store a simulated job through the raw store and run its derived windows. With
    `in_flight_first` every ops batch is stored first as the host agent stores calls running
    over 2 s — in flight, t_end = 0 — and then completed."""
    clock = CLOCK
    runner = runner or DerivedRunner(db, _nothing, config(), clock=clock)
    await runner.restore()
    store = ObservingStore(ClickHouseWriter(db), runner.windows, runner.kernels.buffer)
    batches = list(Simulation(cfg, faults).batches(kinds=kinds))
    stop = int(len(batches) * upto)
    for i, (_, kind, data) in enumerate(batches[:stop]):
        b = decode_batch(data)
        if kind == "jobs":
            if topology:
                await store.write_topologies(b.topologies, f"jobs:{cfg.job_id}:{i}")
        else:
            if in_flight_first and kind == "ops":
                running = dataclasses.replace(b, cols={**b.cols,
                                                       "t_end": np.zeros_like(b.cols["t_end"])})
                await store.write(kind, [running], f"{cfg.job_id}:{i}:running",
                                  sources=[(1, i)])
            await store.write(kind, [b], f"{cfg.job_id}:{i}", sources=[(0, i)])
        clock.pause(0.05)
        if i % 20 == 0:
            await runner.tick()
    if upto == 1.0:  # the job ended: once its sources are quiet its last windows close
        clock.pause(60)
    while await runner.tick():
        pass
    return runner


def query(db: Database, name: str, **params: object) -> list[Sequence[Any]]:
    return list(db.query((QUERIES / f"{name}.sql").read_text(), params).result_rows)


def test_example_queries_answer_on_a_hung_job(clickhouse_db: Database) -> None:
    cfg = JobConfig(job_id="hung", tp=2, pp=2, dp=2, steps=30, microbatches=4, seed=1,
                    hang_tail_s=20)
    asyncio.run(load(clickhouse_db, cfg, ["hang rank=5 stage=bwd mb=1 at=4s"]))
    slow = query(clickhouse_db, "slowest_ranks_last_10m", job="hung")
    assert 1 <= len(slow) <= 8
    vec = query(clickhouse_db, "rank_stage_vector", job="hung", rank=5)
    assert vec and all(r[2] == "stages" for r in vec)
    assert [r[0] for r in vec] == sorted(r[0] for r in vec)
    kern = query(clickhouse_db, "kernel_across_ranks", job="hung", kernel="flash_fwd_kernel")
    assert kern and all(len(r[3]) >= 1 for r in kern)
    stuck = query(clickhouse_db, "inflight_older_than_10s", job="hung")
    ranks = {int(r[1]) for r in stuck}
    assert 5 in ranks or 4 in ranks  # the hung rank's TP group waits in a call for > 10 s
    assert all(float(r[5]) > 10 for r in stuck)


def test_one_rank_job_and_a_wide_job(clickhouse_db: Database) -> None:
    one = JobConfig(job_id="solo", tp=1, pp=1, dp=1, steps=100, microbatches=2, seed=2)
    asyncio.run(load(clickhouse_db, one))
    n = clickhouse_db.query("SELECT count(), uniqExact(rank) FROM iterations FINAL "
                            "WHERE job_id = 'solo'").result_rows[0]
    assert n[0] >= 10 and n[1] == 1
    assert clickhouse_db.query("SELECT count() FROM kernel_summaries "
                               "WHERE job_id = 'solo'").result_rows[0][0] > 0
    wide = JobConfig(job_id="wide", tp=8, pp=4, dp=64, steps=4, microbatches=4, seed=2,
                     kernel_every=2)
    asyncio.run(load(clickhouse_db, wide))
    got = clickhouse_db.query("SELECT uniqExact(rank), count() FROM progress "
                              "WHERE job_id = 'wide'").result_rows[0]
    assert got[0] == 2048 and got[1] >= 2048 * 3


@pytest.mark.parametrize("cut", [0.3, 0.6])
def test_windows_survive_a_restart_without_loss_or_duplicates(clickhouse_db: Database,
                                                              cut: float) -> None:
    job = f"restart{int(cut * 10)}"
    cfg = JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=30, microbatches=4, seed=4)
    asyncio.run(load(clickhouse_db, cfg, upto=cut))  # first worker dies here; state is dropped
    resumed = asyncio.run(_resume(clickhouse_db, cfg, cut))
    # the window open at the crash lacks, in the new worker's memory, what the old one stored:
    # its fingerprint differs and it is read back from the raw table
    assert resumed.kernels.buffer.misses >= 1
    ref = f"{job}_ref"
    asyncio.run(load(clickhouse_db, JobConfig(**{**cfg.__dict__, "job_id": ref})))
    assert_same_as_reference(clickhouse_db, job, ref)



def assert_same_as_reference(db: Database, job: str, ref: str) -> None:
    """The derived tables of `job` (a run cut by a crash) hold the rows of `ref` (the same job
    run without one), each once."""
    for table, key in (("progress", "window_end, rank, comm_id"),
                       ("iterations", "rank, step"),
                       ("kernel_summaries", "window_start, rank, stream, kernel, cluster")):
        a = db.query(f"SELECT count(), uniqExact({key}) FROM {table} FINAL "
                     f"WHERE job_id = '{job}'").result_rows[0]
        b = db.query(f"SELECT count(), uniqExact({key}) FROM {table} FINAL "
                     f"WHERE job_id = '{ref}'").result_rows[0]
        assert a == b, table
        assert db.query(f"SELECT count() - uniqExact({key}) FROM {table} "
                        f"WHERE job_id = '{job}'").result_rows[0][0] == 0, table

async def _resume(db: Database, cfg: JobConfig, cut: float) -> DerivedRunner:
    """A new worker: fresh runner restored from stream_state; the raw rows stored before the
    'crash' are not delivered again (the raw sink skips them), the rest are."""
    clock = CLOCK
    runner = DerivedRunner(db, _nothing, config(), clock=clock)
    await runner.restore()
    store = ObservingStore(ClickHouseWriter(db), runner.windows, runner.kernels.buffer)
    batches = list(Simulation(cfg).batches())
    start = int(len(batches) * cut)
    for i, (_, kind, data) in enumerate(batches[start:], start):
        b = decode_batch(data)
        if kind != "jobs":
            await store.write(kind, [b], f"{cfg.job_id}:{i}", sources=[(0, i)])
        clock.pause(0.05)
        if i % 20 == 0:
            await runner.tick()
    clock.pause(60)
    while await runner.tick():
        pass
    return runner


def test_kernel_summaries_from_memory_are_those_read_back(clickhouse_db: Database) -> None:
    """Windows summarized from the kernel events kept in memory as they were stored give the
    rows a summary read back from the raw table gives (streams/kernel_summaries.py)."""
    db = clickhouse_db
    cfg = JobConfig(job_id="kmem", tp=2, pp=2, dp=2, steps=40, microbatches=4, seed=6)
    runner = asyncio.run(load(db, cfg))
    buf = runner.kernels.buffer
    assert buf.hits >= 2 and buf.misses == 0
    assert not buf.jobs["kmem"].windows  # every window taken: nothing left in memory
    cols = "window_start, rank, stream, kernel, cluster, count, p50_ns, p99_ns"
    windows = [int(r[0]) for r in db.query(
        "SELECT toUnixTimestamp64Nano(window_start) FROM kernel_windows WHERE job_id = 'kmem' "
        "ORDER BY 1").result_rows]
    assert len(windows) == buf.hits
    fresh = KernelSummarizer(db, config().kernels)  # an empty buffer: reads the raw table
    for ws in windows:
        again, window = asyncio.run(fresh.compute("kmem", ws, offload=False))
        stored = db.query(f"SELECT {cols} FROM kernel_summaries FINAL WHERE job_id = 'kmem' "
                          "AND window_start = fromUnixTimestamp64Nano({ws:Int64}, 'UTC') "
                          "ORDER BY rank, stream, kernel, cluster", {"ws": ws}).result_rows
        order = np.lexsort((again["cluster"], again["kernel"].astype(str), again["stream"],
                            again["rank"]))
        read_back = list(zip(again["rank"][order], again["stream"][order],
                             again["kernel"][order], again["cluster"][order],
                             again["count"][order], again["p50_ns"][order],
                             again["p99_ns"][order], strict=True))
        assert [tuple(r[1:]) for r in stored] == [tuple(x.item() if hasattr(x, "item") else x
                                                        for x in r) for r in read_back]
        assert fresh.buffer.misses and int(window["events"][0]) == sum(r[5] for r in stored)


def test_a_crash_before_the_first_checkpoint_loses_no_window(clickhouse_db: Database) -> None:
    """The first worker stores (and commits) a job's first batches and dies before it closed
    and checkpointed any of the job's windows (a busy worker: its derived tick had not run).
    The restarted worker is not given those batches again; the windows they fall in are
    computed all the same, from the start checkpointed when the first batch was stored."""
    job, ref = "nockpt", "nockpt_ref"
    cfg = JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=30, microbatches=4, seed=4)
    db = clickhouse_db

    async def store_only(upto: float) -> None:  # the first worker: no derived tick ran
        runner = DerivedRunner(db, _nothing, config(), clock=CLOCK)
        store = ObservingStore(ClickHouseWriter(db), runner.windows, runner.kernels.buffer)
        every = list(Simulation(cfg).batches())
        for i, (_, kind, data) in enumerate(every[:int(len(every) * upto)]):
            if kind != "jobs":
                await store.write(kind, [decode_batch(data)], f"{job}:{i}", sources=[(0, i)])
            CLOCK.pause(0.05)

    asyncio.run(store_only(0.3))
    assert db.query(f"SELECT count() FROM progress WHERE job_id = '{job}'").result_rows == [(0,)]
    asyncio.run(_resume(db, cfg, 0.3))
    asyncio.run(load(db, JobConfig(**{**cfg.__dict__, "job_id": ref})))
    assert_same_as_reference(db, job, ref)


def test_batches_stored_before_the_restore_do_not_lose_windows(clickhouse_db: Database) -> None:
    """A restarted worker's raw sinks store batches before the derived runner's first tick has
    read the checkpoints (Faust starts the agents and the timers together). Here the first batch
    stored is a few seconds ahead and the next one is late for the iteration window that batch
    opened: a late mark, whose checkpoint must not record the not yet restored windows as the
    job's state (that checkpoint, newest, was what the restore read: the progress windows
    between the last one closed before the crash and the first batch after it were skipped).
    Every progress window from the first to the last is stored once, as without the crash."""
    job, ref = "early", "early_ref"
    cfg = JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=30, microbatches=4, seed=4)
    db = clickhouse_db
    asyncio.run(load(db, cfg, upto=0.4))  # the first worker dies here
    before = int(db.query("SELECT max(toUnixTimestamp64Nano(window_end)) FROM progress "
                          "WHERE job_id = 'early'").result_rows[0][0])
    asyncio.run(_resume_early(db, cfg, 0.4))
    asyncio.run(load(db, JobConfig(**{**cfg.__dict__, "job_id": ref})))

    def windows(j: str) -> list[int]:
        return [int(r[0]) for r in db.query(
            "SELECT DISTINCT toUnixTimestamp64Nano(window_end) AS w FROM progress "
            "WHERE job_id = {j:String} ORDER BY w", {"j": j}).result_rows]

    got, want = windows(job), windows(ref)
    assert got and got[0] < before < got[-1]  # the crash cut the run
    assert np.all(np.diff(got) == SEC), "progress windows missing after the restart"
    assert got == want
    assert_same_as_reference(db, job, ref)


async def _resume_early(db: Database, cfg: JobConfig, cut: float) -> None:
    """A new worker whose raw sinks store two batches before the runner's first tick (restore,
    then tick: the worker's timer): the first one in the next iteration window (5 s) after the
    first batch not stored yet, then that one (late for the window the first opened); then the
    rest, in order."""
    clock = CLOCK
    runner = DerivedRunner(db, _nothing, config(), clock=clock)
    store = ObservingStore(ClickHouseWriter(db), runner.windows, runner.kernels.buffer)
    every = list(Simulation(cfg).batches())
    batches = [(i, kind, decode_batch(data)) for i, (_, kind, data) in enumerate(every)
               if kind != "jobs" and i >= int(len(every) * cut)]

    def t_min(b: RecordBatch) -> int:
        t = b.cols[TIME_COLUMN[b.kind]]
        return int(t[t > 0].min())

    first = t_min(batches[0][2])
    ahead = next(n for n, (_, _, b) in enumerate(batches)
                 if t_min(b) >= (first // (5 * SEC) + 1) * 5 * SEC)
    order = [batches[ahead], *batches[:ahead], *batches[ahead + 1:]]
    for n, (i, kind, b) in enumerate(order):
        await store.write(kind, [b], f"{cfg.job_id}:{i}", sources=[(0, i)])
        clock.pause(0.05)
        if n == 1 or (n and n % 20 == 0):  # the first tick (restore, tick), then every 20
            await runner.restore()
            await runner.tick()
    clock.pause(60)
    while await runner.tick():
        pass


def _dp_calls(job: str, rows: list[tuple[int, int, int]], nbytes: int = 1 << 20
              ) -> RecordBatch:
    """Rank 0's AllReduce calls on dp:0, one per (op_seq, t_start, t_end)."""
    from ingest.batch import encode_batch

    return decode_batch(encode_batch("ops", job, {
        "rank": [0] * len(rows), "comm_id": ["dp:0"] * len(rows),
        "op_seq": [r[0] for r in rows], "op": ["AllReduce"] * len(rows),
        "bytes": [nbytes] * len(rows), "t_enqueue": [r[1] for r in rows],
        "t_start": [r[1] for r in rows], "t_end": [r[2] for r in rows]}))


def _progress_of(db: Database, job: str, batches: list[RecordBatch]
                 ) -> dict[int, tuple[int, int, int]]:
    """Store `batches` one write each, close every window; per window end of rank 0 on dp:0:
    (completed_ops, inflight_ops, last_op_seq)."""
    runner = DerivedRunner(db, _nothing, config(), clock=CLOCK)
    store = ObservingStore(ClickHouseWriter(db), runner.windows, runner.kernels.buffer)

    async def run() -> None:
        for i, b in enumerate(batches):
            await store.write("ops", [b], f"{job}:{i}", sources=[(0, i)])
        CLOCK.pause(60)
        while await runner.tick():
            pass

    asyncio.run(run())
    rows = db.query("SELECT toUnixTimestamp64Nano(window_end), completed_ops, inflight_ops, "
                    "last_op_seq FROM progress FINAL WHERE job_id = {j:String} "
                    "ORDER BY window_end", {"j": job}).result_rows
    return {int(we): (int(c), int(n), int(s)) for we, c, n, s in rows}


def test_a_call_longer_than_the_lookback_counts_in_the_window_where_it_ends(
        clickhouse_db: Database) -> None:
    """Progress: an 8 s AllReduce (op_lookback is 5 s) is in flight while it runs and completed
    in the window where it ends, read through the in-flight query by its t_end."""
    job, t0 = "longcall", 1_700_000_100 * SEC
    short = [(i, t0 + i * SEC // 10, t0 + i * SEC // 10 + 1000) for i in range(5)]
    # op 5 starts at t0 + 1 s and ends 8 s later; the batch carries it once it completed
    done = [(5, t0 + SEC, t0 + 9 * SEC + SEC // 2), (6, t0 + 12 * SEC, t0 + 12 * SEC + 10)]
    by_end = _progress_of(clickhouse_db, job, [_dp_calls(job, short), _dp_calls(job, done)])
    completed, _, seq = by_end[t0 + 10 * SEC]
    assert (completed, seq) == (1, 5)  # [t0+9 s, t0+10 s): the long call ends here


def test_bytes_the_contract_allows_saturate_instead_of_wrapping(clickhouse_db: Database) -> None:
    """Three calls of 2^62 bytes (the contract allows any int64) ending in one window: the
    window's byte sum saturates at int64's end instead of wrapping to a negative rate."""
    from streams.progress import per_second

    job, t0 = "hugebytes", 1_700_000_150 * SEC
    calls = [(i, t0 + i * SEC // 10, t0 + i * SEC // 10 + 1000) for i in range(3)]
    _progress_of(clickhouse_db, job, [_dp_calls(job, calls, nbytes=1 << 62)])
    rates = clickhouse_db.query(
        "SELECT bytes_per_s FROM progress FINAL WHERE job_id = {j:String} AND completed_ops > 0",
        {"j": job}).result_rows
    width = config().progress.window_ns
    want = int(per_second(np.array([2**63 - 1]), width)[0])
    assert want > 0 and rates and all(int(r[0]) == want for r in rates), rates


def test_a_call_stored_in_flight_then_completed_leaves_the_feed_when_it_completes(
        clickhouse_db: Database) -> None:
    """Progress: the host agent stores a call that runs over 2 s in flight (t_end = 0) and again
    once it completed. While it runs it is one call in flight; from the window where it ends
    on it is not in flight — not for the hour the in-flight row stays in the lookback."""
    job, t0 = "twins", 1_700_000_200 * SEC
    short = [(i, t0 + i * SEC // 10, t0 + i * SEC // 10 + 1000) for i in range(5)]
    # op 5 starts at t0 + 1 s and runs 20 s: in flight first, then completed
    later = [(6 + i, t0 + 22 * SEC + i * SEC, t0 + 22 * SEC + i * SEC + 1000) for i in range(10)]
    by_end = _progress_of(clickhouse_db, job, [
        _dp_calls(job, [*short, (5, t0 + SEC, 0)]),
        _dp_calls(job, [(5, t0 + SEC, t0 + 21 * SEC), *later])])
    assert by_end[t0 + 10 * SEC][1:] == (1, 4)  # running: counted once, though stored twice
    assert by_end[t0 + 22 * SEC][1:] == (0, 5)  # it ended at t0 + 21 s
    assert all(n == 0 for we, (_, n, _) in by_end.items() if we > t0 + 21 * SEC)


def test_calls_stored_in_flight_first_change_no_iteration_or_progress_row(
        clickhouse_db: Database) -> None:
    """The same simulated job twice: once as the simulator publishes it, once with every call
    also stored in flight before its completed row (as the host agent does for calls over 2 s).
    The iteration rows (exposed communication per kind, op counts) and the progress rows are
    the same: the in-flight rows are superseded (ingest.inflight)."""
    db = clickhouse_db
    base = dict(tp=2, pp=2, dp=2, steps=8, microbatches=2, seed=5)
    asyncio.run(load(db, JobConfig(job_id="plain", **base)))  # type: ignore[arg-type]
    asyncio.run(load(db, JobConfig(job_id="twice", **base),  # type: ignore[arg-type]
                     in_flight_first=True))
    assert db.query("SELECT count() FROM ops WHERE job_id = 'twice' AND "
                    "toUnixTimestamp64Nano(t_end) = 0").result_rows[0][0] > 500

    def rows(table: str, job: str, order: str) -> list[Sequence[Any]]:
        cols = [c for c in db.query(f"SELECT * FROM {table} LIMIT 0").column_names
                if c not in ("job_id", "ingest_ts")]
        return list(db.query(f"SELECT {', '.join(cols)} FROM {table} FINAL WHERE job_id = "
                             f"{{j:String}} ORDER BY {order}", {"j": job}).result_rows)

    it = rows("iterations", "plain", "rank, step")
    assert len(it) == 8 * 8
    assert rows("iterations", "twice", "rank, step") == it
    prog = rows("progress", "plain", "window_end, rank, comm_id")
    assert len(prog) > 20
    assert rows("progress", "twice", "window_end, rank, comm_id") == prog


def test_a_late_mark_survives_a_crash_before_the_recomputation(clickhouse_db: Database) -> None:
    """The stage records of one step arrive after its iterations window closed; the worker dies
    before recomputing it. The mark was stored with the batch, so the next worker recomputes."""
    cfg = JobConfig(job_id="latemark", tp=2, pp=2, dp=2, steps=30, microbatches=4, seed=6)
    batches = list(Simulation(cfg).batches())
    late = [b for b in batches if b[1] == "stages" and 4 in decode_batch(b[2]).cols["step"]]

    async def first() -> None:
        runner = DerivedRunner(clickhouse_db, _nothing, config(), clock=CLOCK)
        store = ObservingStore(ClickHouseWriter(clickhouse_db), runner.windows,
                               runner.kernels.buffer)
        for i, (_, kind, data) in enumerate(b for b in batches if b not in late):
            b = decode_batch(data)
            if kind == "jobs":
                await store.write_topologies(b.topologies, f"jobs:latemark:{i}")
            else:
                await store.write(kind, [b], f"latemark:{i}", sources=[(0, i)])
            CLOCK.pause(0.05)
            if i % 20 == 0:
                await runner.tick()
        while await runner.tick():
            pass
        for j, (_, kind, data) in enumerate(late):  # stored and marked; no tick: the crash
            await store.write(kind, [decode_batch(data)], f"latemark:late:{j}",
                              sources=[(1, j)])

    async def second() -> None:
        runner = DerivedRunner(clickhouse_db, _nothing, config(), clock=CLOCK)
        await runner.restore()
        assert runner.windows.late("latemark", "iterations")
        while await runner.tick():
            pass
        assert not runner.windows.late("latemark", "iterations")

    def step4() -> tuple[int, int]:
        n, st = clickhouse_db.query("SELECT count(), countIf(source = 'stages') FROM iterations "
                                    "FINAL WHERE job_id = 'latemark' AND step = 4").result_rows[0]
        return int(n), int(st)

    asyncio.run(first())
    assert step4() == (8, 0)  # inferred from the DP collective while the stage records were out
    asyncio.run(second())
    assert step4() == (8, 8)


@pytest.mark.parametrize("kinds", [None, frozenset({"ops", "beats"})],
                         ids=["stage records", "steps from the DP collective"])
def test_short_iteration_frames_give_the_rows_of_full_frames(clickhouse_db: Database,
                                                             kinds: frozenset[str] | None) -> None:
    """Iteration windows are read from a frame reaching twice the recent step time back, not
    max_step_ns (60 s), when that gives the same rows: every stored window equals its full-frame
    recomputation, with a slowdown and a hang in the job (steps longer than the reach fall back)."""
    job = "frames" if kinds is None else "frames-dp"
    cfg = JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=40, microbatches=4, seed=4,
                    hang_tail_s=15)
    faults = ["gpu_slow rank=3 factor=4.0 at=6s", "hang rank=6 stage=bwd mb=2 at=14s"]
    runner = asyncio.run(load(clickhouse_db, cfg, faults, kinds=kinds))
    assert runner.stats.short_frames >= 2 and runner.stats.full_frames >= 1
    names = ("rank", "step", "source", "t_start", "t_end", "step_ns", "compute_ns",
             "tp_comm_ns", "pp_comm_ns", "dp_comm_ns", "ops", "op_bytes")
    select = ", ".join(f"toUnixTimestamp64Nano({n})" if n in ("t_start", "t_end") else n
                       for n in names)
    width = 5 * SEC
    windows = sorted({int(r[0]) // width * width for r in clickhouse_db.query(
        f"SELECT toUnixTimestamp64Nano(t_end) FROM iterations WHERE job_id = '{job}'"
    ).result_rows})
    assert len(windows) >= 3
    for ws in windows:
        full = asyncio.run(runner._iterations(job, ws))
        order = np.lexsort((full["step"], full["rank"]))
        want = [tuple(full[n][i].item() if isinstance(full[n][i], np.generic) else full[n][i]
                      for n in names) for i in order]
        got = clickhouse_db.query(
            f"SELECT {select} FROM iterations FINAL WHERE job_id = '{job}' "
            "AND toUnixTimestamp64Nano(t_end) >= {ws:Int64} "
            "AND toUnixTimestamp64Nano(t_end) < {we:Int64} ORDER BY rank, step",
            {"ws": ws, "we": ws + width}).result_rows
        assert [tuple(r) for r in got] == want, ws


@pytest.mark.parametrize("topology", [True, False], ids=["topology", "comm names only"])
def test_previews_publish_exact_step_rows_before_their_window(clickhouse_db: Database,
                                                             topology: bool) -> None:
    """Every tick previews the open iterations window (after a count says a step can have
    ended): previewed rows are published before their window closes, and their bounds are
    the stored rows'. Without the job's topology, communicators are told by name, as in the
    window's own read."""
    job = f"previews-{topology}"
    published: list[RecordBatch] = []

    async def capture(kind: str, job_id: str, data: bytes) -> None:
        if kind == "iterations":
            published.append(decode_batch(data))

    runner = DerivedRunner(clickhouse_db, capture, config(), clock=CLOCK)
    cfg = JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=30, microbatches=4, seed=5)
    asyncio.run(load(clickhouse_db, cfg, runner=runner, kinds=frozenset({"ops", "beats"}),
                     topology=topology))
    assert runner.stats.previews >= 2
    # frames from the ranks' last known step ends, once a window closed (`_bounds`)
    assert runner.stats.prior_frames >= 1
    names = ("t_start", "t_end", "step_ns", "compute_ns", "tp_comm_ns", "pp_comm_ns",
             "dp_comm_ns", "ops", "op_bytes")
    select = ", ".join(f"toUnixTimestamp64Nano({n})" if n in ("t_start", "t_end") else n
                       for n in names)
    stored = {(int(r[0]), int(r[1])): tuple(int(x) for x in r[2:]) for r in clickhouse_db.query(
        f"SELECT rank, step, {select} FROM iterations FINAL WHERE job_id = '{job}'"
    ).result_rows}
    rows = [((int(batch.cols["rank"][i]), int(batch.cols["step"][i])),
             tuple(int(batch.cols[n][i]) for n in names))
            for batch in published for i in range(len(batch.cols["rank"]))]
    assert len(rows) > len(stored)  # previews, then every window's rows again
    assert all(stored[k] == v for k, v in rows)  # the simulator's records come in order


def test_progress_rows_are_their_definition_over_the_raw_records(clickhouse_db: Database) -> None:
    """Every stored progress row of a job with a hang (calls in flight for many windows) equals
    the definition in ingest.records.Progress computed by brute force over the job's raw ops and
    beats: the feed's window queries (which read only the calls still running or ending in the
    window) and its carried state lose nothing."""
    db = clickhouse_db
    cfg = JobConfig(job_id="prog", tp=2, pp=2, dp=2, steps=16, microbatches=4, seed=3,
                    hang_tail_s=12)
    asyncio.run(load(db, cfg, ["hang rank=3 stage=bwd mb=2 at=3s"]))
    ops = db.query_columns(
        "SELECT rank, toString(comm_id) AS comm, op_seq, bytes, toUnixTimestamp64Nano(t_start) "
        "AS t0, toUnixTimestamp64Nano(t_end) AS t1 FROM ops WHERE job_id = 'prog'")
    beats = db.query_columns(
        "SELECT rank, toString(comm_id) AS comm, toUnixTimestamp64Nano(ts) AS ts FROM beats "
        "WHERE job_id = 'prog'")
    rows = db.query_columns(
        "SELECT toUnixTimestamp64Nano(window_end) AS we, rank, toString(comm_id) AS comm, "
        "last_op_seq, completed_ops, bytes_per_s, op_interval_ns, inflight_ops, "
        "oldest_inflight_age_ns, toUnixTimestamp64Nano(last_beat_ts) AS beat, "
        "toUnixTimestamp64Nano(last_record_ts) AS rec FROM progress FINAL "
        "WHERE job_id = 'prog' ORDER BY we, rank, comm")
    assert (ops["t1"] == 0).any(), "the hang left no call in flight"
    width = config().progress.window_ns
    windows = np.unique(rows["we"])
    assert len(windows) >= 10 and np.all(np.diff(windows) == width)
    got = {(int(we), int(r), str(c)): tuple(int(rows[k][i]) for k in (
        "last_op_seq", "completed_ops", "bytes_per_s", "op_interval_ns", "inflight_ops",
        "oldest_inflight_age_ns", "beat", "rec"))
        for i, (we, r, c) in enumerate(zip(rows["we"], rows["rank"], rows["comm"], strict=True))}
    want: dict[tuple[int, int, str], tuple[int, ...]] = {}
    keys = sorted({(int(r), str(c)) for r, c in zip(ops["rank"], ops["comm"], strict=True)}
                  | {(int(r), str(c)) for r, c in zip(beats["rank"], beats["comm"], strict=True)})
    for we in windows.tolist():
        ws = we - width
        for r, c in keys:
            o = (ops["rank"] == r) & (ops["comm"] == c)
            b = (beats["rank"] == r) & (beats["comm"] == c) & (beats["ts"] < we)
            t0, t1, seq, nbytes = ops["t0"][o], ops["t1"][o], ops["op_seq"][o], ops["bytes"][o]
            started = t0 < we
            if not started.any() and not b.any():
                continue  # not seen yet
            done = (t1 > 0) & (t1 < we)
            inside = (t1 >= ws) & (t1 < we)
            running = started & ((t1 == 0) | (t1 >= we))
            n = int(inside.sum())
            ends = np.sort(t1[inside])
            want[(we, r, c)] = (
                int(seq[done].max()) if done.any() else -1, n,
                int(nbytes[inside].sum()) * 1_000_000_000 // width,
                int(ends[-1] - ends[0]) // (n - 1) if n > 1 else -1,
                int(running.sum()), we - int(t0[running].min()) if running.any() else 0,
                int(beats["ts"][b].max()) if b.any() else 0,
                max(int(t0[started].max()) if started.any() else 0,
                    int(beats["ts"][b].max()) if b.any() else 0))
    assert set(got) == set(want)
    bad = [(k, got[k], want[k]) for k in sorted(want) if got[k] != want[k]]
    assert not bad, bad[:5]


def test_a_progress_window_closed_again_is_computed_from_the_stored_rows(
        clickhouse_db: Database) -> None:
    """A window the feed computes again (a rebalance restored an older checkpoint) or anew
    before its first stored one (a job's windows moved back) is what the stored rows say, not
    what this worker's state carried past it: its `last_op_seq` is the one stored for it, and
    no later window's completions reach an earlier one (a series that falls from one window
    to the next)."""
    db = clickhouse_db
    job, t0 = "reclose", 1_700_000_300 * SEC
    calls = [(i, t0 + i * SEC // 4, t0 + i * SEC // 4 + 1000) for i in range(40)]  # 10 s
    by_end = _progress_of(db, job, [_dp_calls(job, calls)])
    ends = sorted(by_end)
    assert len(ends) >= 8 and [by_end[e][2] for e in ends] == sorted(by_end[e][2] for e in ends)
    feed = DerivedRunner(db, _nothing, config(), clock=CLOCK).progress
    width = config().progress.window_ns

    def seq_of(rows: dict[str, np.ndarray]) -> int:
        hit = (rows["rank"] == 0) & (rows["comm_id"] == "dp:0")
        return int(rows["last_op_seq"][hit][0]) if hit.any() else -1  # -1: no row

    async def again() -> tuple[int, int, int, int]:
        last = await feed.compute(job, ends[-1] - width)  # the job's newest window first
        early = await feed.compute(job, ends[2] - width)  # then an earlier one, closed again
        nxt = await feed.compute(job, ends[3] - width)  # and on from there
        before = await feed.compute(job, ends[0] - 2 * width)  # before the first stored one
        return seq_of(last), seq_of(early), seq_of(nxt), seq_of(before)

    last, early, nxt, before = asyncio.run(again())
    assert last == by_end[ends[-1]][2] == 39
    assert (early, nxt) == (by_end[ends[2]][2], by_end[ends[3]][2])
    assert before <= by_end[ends[0]][2]
