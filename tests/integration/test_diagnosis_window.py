"""The root-cause agent's read of a job's window from ClickHouse (diagnosis.agents.read_window).

A small simulated job is stored through the worker's writer; the window read back must hold the
same rows as the simulator produced, with LowCardinality string columns (comm_id, op, kernel)
arriving dictionary-encoded and their factorization (`columns.codes`) already known.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np

from diagnosis.agents import read_topology, read_window
from diagnosis.columns import _CODES_MEMO, codes
from ingest.batch import decode_batch
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


def test_a_window_of_some_kinds_reads_only_those(clickhouse_db: Database) -> None:
    """A sweep asks for the kinds its rules use (diagnosis.analyst.SWEEP_KINDS)."""
    cfg = JobConfig(job_id="win-kinds", tp=2, pp=2, dp=1, microbatches=2, steps=3,
                    kernel_every=1)
    _store(clickhouse_db, Simulation(cfg, []))
    topo = read_topology(clickhouse_db, "win-kinds")
    assert topo is not None
    every = read_window(clickhouse_db, topo, 0, 2**62)
    assert {"ops", "flows", "stages", "beats"} <= set(every.tables)
    some = read_window(clickhouse_db, topo, 0, 2**62, ("stages", "ops"))
    assert set(some.tables) == {"stages", "ops"}
    for kind in some.tables:
        assert len(some.tables[kind]["rank"]) == len(every.tables[kind]["rank"])


def test_a_call_that_completed_before_the_window_is_not_read_as_stuck(
        clickhouse_db: Database) -> None:
    """Rank 0's AllReduce was stored in flight during a 100 s stall (the host agent's row) and
    again when it completed; rank 1's never completed. A window starting after the stall reads
    both in-flight rows (in-flight calls are read from an hour back) but not rank 0's completed
    row (it started before the window): rank 0 completed later calls on that communicator, so
    its row is superseded; only rank 1 is stuck."""
    from diagnosis.hang_rca import stuck_ranks
    from ingest.batch import encode_batch

    s, t = 1_000_000_000, 1_700_000_000 * 1_000_000_000
    job = "win-stale"
    rows = [(0, 5, t, 0), (1, 5, t, 0), (0, 5, t, t + 100 * s)]
    rows += [(0, 6 + i, t + (101 + i) * s, t + (101 + i) * s + 1000) for i in range(100)]
    batch = decode_batch(encode_batch("ops", job, {
        "rank": [r[0] for r in rows], "comm_id": ["dp:0"] * len(rows),
        "op_seq": [r[1] for r in rows], "op": ["AllReduce"] * len(rows),
        "bytes": [1 << 20] * len(rows), "t_enqueue": [r[2] for r in rows],
        "t_start": [r[2] for r in rows], "t_end": [r[3] for r in rows]}))
    asyncio.run(ClickHouseWriter(clickhouse_db).write("ops", [batch], "stale:0"))
    cfg = JobConfig(job_id=job, tp=1, pp=1, dp=2)
    topo = Simulation(cfg, []).topology()

    now = t + 200 * s
    w = read_window(clickhouse_db, topo, now - 90 * s, now)
    ops = w.get("ops")
    waiting = ops["t_end"] == 0
    assert sorted(ops["rank"][waiting].tolist()) == [1]
    assert stuck_ranks(w, now).tolist() == [1]
    # judged during the stall (its end is after that moment), both were stuck
    during = read_window(clickhouse_db, topo, t - 10 * s, t + 50 * s)
    assert stuck_ranks(during, t + 50 * s).tolist() == [0, 1]


def test_window_beats_carry_the_ranks_position(clickhouse_db: Database) -> None:
    """Beats stored through the writer come back in the window with step, stage and stage_ts
    (ns), and `current_stage` reads a hung rank's stage from them; a beat of an old producer
    (no position columns) reads as unknown."""
    from diagnosis.position import current_stage
    from ingest.batch import encode_batch

    s, t = 1_000_000_000, 1_700_000_000 * 1_000_000_000
    job = "win-beats"
    new = decode_batch(encode_batch("beats", job, {
        "rank": [0, 1, 1], "ts": [t, t, t + s], "comm_id": ["world"] * 3,
        "last_op_seq": [9, 8, 8], "step": [12, 12, 12],
        "stage": ["optim.step", "model.backward", "model.backward"],
        "stage_ts": [t - 5, t - 300 * 1_000_000, t - 300 * 1_000_000]}))
    old = decode_batch(encode_batch("beats", job, {"rank": [2], "ts": [t]}))
    asyncio.run(ClickHouseWriter(clickhouse_db).write("beats", [new, old], "beats:0"))
    topo = Simulation(JobConfig(job_id=job, tp=1, pp=1, dp=4), []).topology()
    w = read_window(clickhouse_db, topo, t - 10 * s, t + 10 * s, ("beats",))
    b = w.get("beats")
    order = np.lexsort((b["ts"], b["rank"]))
    assert b["step"][order].tolist() == [12, 12, 12, -1]
    assert [str(x) for x in b["stage"][order]] == ["optim.step", "model.backward",
                                                    "model.backward", ""]
    assert b["stage_ts"][order].tolist() == [t - 5, t - 300 * 1_000_000, t - 300 * 1_000_000, 0]
    assert current_stage(b, 1) == (12, "model.backward", t - 300 * 1_000_000)
    assert current_stage(b, 0) == (12, "optim.step", t - 5)
    assert current_stage(b, 2) is None
    # the README's query: each rank's newest beat, its stage and for how long
    rows = sorted(tuple(r) for r in clickhouse_db.query(
        "SELECT rank, step, stage, toFloat64(ts - stage_ts) AS for_s FROM beats "
        "WHERE job_id = 'win-beats' ORDER BY ts DESC LIMIT 1 BY rank").result_rows)
    assert [(r, s_, st) for r, s_, st, _ in rows] == [(0, 12, "optim.step"),
                                                      (1, 12, "model.backward"), (2, -1, "")]
    assert abs(rows[1][3] - 1.3) < 1e-6  # entered 0.3 s before its first beat, 1 s before
    readme = clickhouse_db.query(
        "SELECT rank, step, stage, now64(9) - stage_ts AS for_s FROM beats "
        "WHERE job_id = 'win-beats' ORDER BY ts DESC LIMIT 1 BY rank").result_rows
    assert sorted(tuple(r[:3]) for r in readme) == [r[:3] for r in rows]


def test_the_agents_read_a_jobs_newest_topology(clickhouse_db: Database) -> None:
    """A job publishes its topology again when a communicator is created after the first
    step: the root-cause read uses the newest, not the one seen first (a desync on a group
    created later had no members to wait for) — from `TOPOLOGY_TTL_S` after the last look-up
    on, the reads before then (a slowdown try's two or three) sharing one look-up."""
    from diagnosis.agents import TOPOLOGY_TTL_S, DiagnosisAgents
    from diagnosis.stage_rows import StageRows
    from ingest.records import Communicator, JobTopology

    first = JobTopology(job_id="late-group", ts=1_000, world_size=2, dp=2, hosts=["h", "h"],
                        communicators=[Communicator(comm_id="world", kind="world",
                                                    members=[0, 1])])
    later = first.model_copy(update={"ts": 2_000, "communicators": [
        *first.communicators, Communicator(comm_id="pg1", kind="dp", members=[0, 1])]})
    writer = ClickHouseWriter(clickhouse_db)
    asyncio.run(writer.write_topologies([first], "topo:late:1"))
    agents = DiagnosisAgents.__new__(DiagnosisAgents)  # only its read path: no app, no topics
    agents.db, agents.topos, agents.topo_read = clickhouse_db, {}, {}
    agents.stage_rows = StageRows()
    w = agents._read("late-group", 0, 10_000)
    assert w is not None and [c.comm_id for c in w.topo.communicators] == ["world"]
    asyncio.run(writer.write_topologies([later], "topo:late:2"))
    w = agents._read("late-group", 0, 10_000)  # looked up just now: not again
    assert w is not None and [c.comm_id for c in w.topo.communicators] == ["world"]
    agents.topo_read["late-group"] -= TOPOLOGY_TTL_S  # the look-up is as old as its TTL
    w = agents._read("late-group", 0, 10_000)
    assert w is not None and [c.comm_id for c in w.topo.communicators] == ["world", "pg1"]


def test_the_agents_stage_reads_from_the_stored_batches_equal_the_tables(
        clickhouse_db: Database) -> None:
    """The analyst's stage reads come from the copy the stored batches keep
    (diagnosis/stage_rows.py) after one query: whatever the window, they return the rows the
    stages query returns; stage records another worker reports stored (a rebalance) are
    queried again."""
    from diagnosis.agents import DiagnosisAgents
    from diagnosis.analyst import Analyst
    from diagnosis.stage_rows import StageRows

    cfg = JobConfig(job_id="win-stage-copy", tp=1, pp=2, dp=2, microbatches=2, steps=12)
    sim = Simulation(cfg, [])
    stage_batches = [decode_batch(d) for _, k, d in sim.batches() if k == "stages"]
    assert len(stage_batches) >= 4
    writer = ClickHouseWriter(clickhouse_db)
    asyncio.run(writer.write_topologies([sim.topology()], "topo:copy"))
    topo = read_topology(clickhouse_db, "win-stage-copy")
    assert topo is not None
    agents = DiagnosisAgents.__new__(DiagnosisAgents)  # its read path and stored listener
    agents.db, agents.topos, agents.topo_read = clickhouse_db, {}, {}
    agents.stage_rows = StageRows()
    agents.analyst = Analyst(agents._read)
    agents._stored = asyncio.Queue(maxsize=1 << 10)  # for the step trigger: not read here

    def store(i: int, b: Any, listen: bool = True) -> None:
        asyncio.run(writer.write("stages", [b], dedup_token("rw.stages", 0, i, i)))
        if listen:
            agents.on_stored("stages", b)

    def key(t: Mapping[str, np.ndarray]) -> list[tuple[int, ...]]:
        names = sorted(t)
        return sorted(zip(*(np.asarray(t[k]).tolist() for k in names), strict=True))

    first = min(int(np.min(b.cols["t_start"])) for b in stage_batches)

    def check() -> None:
        # the analyst's reads start 90 s before the moment they read to: from the job's
        # first step on here (its steps span less than the copy keeps before a read's start)
        t = np.concatenate([np.asarray(b.cols["t_start"]) for b in stage_batches[:stored]])
        mid = int(np.median(t))
        for lo, hi in ((first, 2**62), (mid, 2**62), (first, int(t.max())), (mid, mid + 1)):
            got = agents._read("win-stage-copy", lo, hi, ("stages",))
            want = read_window(clickhouse_db, topo, lo, hi, ("stages",))
            assert got is not None
            assert key(got.get("stages")) == key(want.get("stages")), (lo, hi)
            every = agents._read("win-stage-copy", lo, hi)
            assert every is not None and key(every.get("stages")) == key(want.get("stages"))

    stored = 0
    for i in range(2):
        store(i, stage_batches[i])
        stored += 1
    check()  # anchors the copy
    queries = agents.stage_rows.anchors
    for i in range(2, len(stage_batches) - 1):
        store(i, stage_batches[i])
        stored += 1
        check()
    assert agents.stage_rows.anchors == queries  # served from memory since
    # a batch another worker stored, and reported: queried again
    store(len(stage_batches) - 1, stage_batches[-1], listen=False)
    stored += 1
    b = stage_batches[-1]
    agents.on_stored_ends("win-stage-copy", "stages", np.asarray(b.cols["rank"]),
                          np.asarray(b.cols["t_start"]))
    check()
    assert agents.stage_rows.anchors == queries + 1
