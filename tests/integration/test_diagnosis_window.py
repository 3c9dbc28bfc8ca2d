"""The root-cause agent's read of a job's window from ClickHouse (diagnosis.agents.read_window).

A small simulated job is stored through the worker's writer; the window read back must hold the
same rows as the simulator produced, with LowCardinality string columns (comm_id, op, kernel)
arriving dictionary-encoded and their factorization (`columns.codes`) already known.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import numpy as np
import pytest

from diagnosis.agents import read_topology
from diagnosis.columns import _CODES_MEMO, codes
from diagnosis.window import Window
from diagnosis.window_reader import WindowCache, read_window
from ingest.batch import RecordBatch, decode_batch
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect
from streams.db import Database
from streams.writer import ClickHouseWriter, dedup_token


def _store(db: Database, sim: Simulation) -> None:
    writer = ClickHouseWriter(db)
    by_kind: dict[str, list[Any]] = {}
    topos = []
    for _, kind, data in sim.batches():
        if kind == "jobs":
            continue
        by_kind.setdefault(kind, []).append(decode_batch(data))
    topos.append(sim.topology())

    async def go() -> None:
        await writer.write_topologies(topos, "topo:test")
        for i, (kind, batches) in enumerate(sorted(by_kind.items())):
            await writer.write(kind, batches, dedup_token(f"rw.{kind}", 0, i, i))

    asyncio.run(go())


def test_window_strings_arrive_coded_and_equal_the_records(clickhouse_db: Database) -> None:
    cfg = JobConfig(job_id="win-coded", tp=2, pp=2, dp=2, microbatches=2, steps=4,
                    kernel_every=1)
    sim = Simulation(cfg, [])
    _store(clickhouse_db, sim)
    want = collect(Simulation(cfg, []).batches())

    topo = read_topology(clickhouse_db, "win-coded")
    assert topo is not None and topo.world_size == 8
    now = int(want["ops"]["t_end"].max())
    w = read_window(clickhouse_db, topo, 0, now)

    ops = w.get("ops")
    assert ops is not None and len(ops["rank"]) > 0
    # the same multiset of (rank, comm_id, op_seq, op) rows as the simulator published
    got_rows = sorted(zip(ops["rank"].tolist(), ops["comm_id"].tolist(),
                          ops["op_seq"].tolist(), ops["op"].tolist(), strict=True))
    src = want["ops"]
    keep = src["t_start"] <= now
    want_rows = sorted(zip(src["rank"][keep].tolist(), [str(c) for c in src["comm_id"][keep]],
                           src["op_seq"][keep].tolist(), [str(o) for o in src["op"][keep]],
                           strict=True))
    assert got_rows == want_rows
    kernels = w.get("kernels")
    assert kernels is not None
    for column in (kernels["kernel"],):
        assert column.dtype == object
        assert id(column) in _CODES_MEMO  # coded by the reader, not re-factorized
        uniq, inv = codes(column)
        ref_u, ref_i = np.unique(column.astype(str), return_inverse=True)
        np.testing.assert_array_equal(uniq, ref_u)
        np.testing.assert_array_equal(inv, ref_i.reshape(-1))


# -- WindowCache: the window topped up by ingest_ts equals a full read ------------------------


def _canonical(w: Window) -> dict[str, list[tuple[object, ...]]]:
    """Every kind's rows as a sorted list of tuples (strings as str): row order aside, equal."""
    out = {}
    for kind, cols in w.tables.items():
        names = sorted(cols)
        columns = [[str(x) for x in cols[n]] if cols[n].dtype == object else cols[n].tolist()
                   for n in names]
        out[kind] = sorted(zip(*columns, strict=True))
    return out


def _in_flight_copy(b: RecordBatch) -> RecordBatch:
    """The same ops as `b`, published while in flight (t_end unknown)."""
    return dataclasses.replace(b, cols={**b.cols, "t_end": np.zeros_like(b.cols["t_end"])})


@pytest.mark.parametrize("margin_s", [0.0, 30.0])
def test_topped_up_window_equals_a_full_read_while_rows_arrive(clickhouse_db: Database,
                                                               margin_s: float) -> None:
    """A live sequence: batches arrive in rounds — some late (event times long before the
    previous read's window end), ops first in flight and completed a round later — and the
    window slides (kernels read only their last 40 s). After every round the cache's top-up
    holds exactly the rows a full `read_window` reads. With no margin it read fewer rows than
    the full reads; with a margin longer than the test every top-up re-reads every kept row
    (none may be counted twice)."""
    cfg = JobConfig(job_id="win-cache", tp=2, pp=2, dp=2, microbatches=2, steps=24,
                    kernel_every=1)
    sim = Simulation(cfg, [])
    batches = [(kind, decode_batch(data)) for _, kind, data in sim.batches() if kind != "jobs"]
    writer = ClickHouseWriter(clickhouse_db)
    rounds: list[list[tuple[str, RecordBatch]]] = [[] for _ in range(8)]
    rng = np.random.default_rng(7)
    for i, (kind, b) in enumerate(batches):
        r = min(7, i * 8 // len(batches))
        if kind == "ops" and r < 7 and rng.random() < 0.3:
            rounds[r].append((kind, _in_flight_copy(b)))  # in flight now, completed next round
            r += 1
        elif r > 0 and rng.random() < 0.15:
            r = min(7, r + 2)  # late: stored two rounds after its neighbours
        rounds[r].append((kind, b))
    assert sum(len(r) for r in rounds) > len(batches)

    t_all = np.concatenate([b.cols["t_start"] for k, b in batches if "t_start" in b.cols])
    t0, t1 = int(t_all.min()), int(t_all.max())
    span = t1 - t0
    topo = sim.topology()
    asyncio.run(writer.write_topologies([topo], "topo:win-cache"))
    cache = WindowCache(clickhouse_db, topo, margin_s=margin_s)
    full_rows = 0
    for i, group in enumerate(rounds):
        async def store(group: list[tuple[str, RecordBatch]] = group, i: int = i) -> None:
            for j, (kind, b) in enumerate(group):
                await writer.write(kind, [b], dedup_token(f"rw.{kind}", i, j, j))

        asyncio.run(store())
        now = t0 + span * (i + 1) // len(rounds)
        start = max(t0, now - span // 3)
        got, want = cache.read(start, now), read_window(clickhouse_db, topo, start, now)
        full_rows += sum(len(next(iter(c.values()))) for c in want.tables.values())
        assert _canonical(got) == _canonical(want), f"round {i}"
        assert set(got.tables) == set(want.tables)
    assert cache.full_reads == 1 and cache.top_ups == len(rounds) - 1
    assert 0 < cache.rows_read < full_rows or margin_s > 0


def test_rows_of_an_insert_still_running_at_the_read_are_not_lost(
        clickhouse_db: Database) -> None:
    """A row stamped (`ingest_ts`) before a top-up but committed after it — its insert queued
    behind other work on the database thread — is picked up by the next top-up: the cut goes
    back to the start of the oldest insert still running. Without that marker the same row
    would fall before the cut and be lost to every later top-up (checked: the second cache)."""
    cfg = JobConfig(job_id="win-race", tp=2, pp=1, dp=1, microbatches=1, steps=6)
    sim = Simulation(cfg, [])
    ops = [decode_batch(data) for _, kind, data in sim.batches() if kind == "ops"]
    topo = sim.topology()
    t_end = int(max(int(b.cols["t_end"].max()) for b in ops))
    first, late = ops[: len(ops) // 2], ops[len(ops) // 2:]
    asyncio.run(ClickHouseWriter(clickhouse_db).write("ops", first, "first"))

    marked = WindowCache(clickhouse_db, topo, margin_s=0.2)
    unmarked = WindowCache(clickhouse_db, topo, margin_s=0.2)
    marked.read(0, t_end)
    unmarked.read(0, t_end)
    stamped = time.time_ns()
    with clickhouse_db.inserting():  # an insert that began at `stamped`, still queued
        time.sleep(0.5)
        marked.read(0, t_end)  # its cut is before `stamped`
    unmarked.read(0, t_end)  # no insert running: its cut is 0.2 s before now, after `stamped`
    asyncio.run(ClickHouseWriter(clickhouse_db, clock=lambda: stamped).write("ops", late, "late"))

    want = _canonical(read_window(clickhouse_db, topo, 0, t_end))
    assert _canonical(marked.read(0, t_end)) == want
    assert _canonical(unmarked.read(0, t_end)) != want  # the race this marker closes
