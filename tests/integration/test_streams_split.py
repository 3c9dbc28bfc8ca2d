"""One job stored by two workers (ingest/keys.py, streams/reports.py), on the real engine.

The simulated job's spread kinds (calls, flows, chunks, work requests) are stored by a worker
that does not own the job, which reports each insert to the owner; the owner stores the rest
and closes every window. The derived rows must be those of the same job stored and windowed by
one worker — every row, every value — and the worker that does not own the job derives
nothing of it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ingest.batch import decode_batch
from ingest.keys import SPREAD_KINDS, batch_key
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation
from streams.db import Database
from streams.derived import DerivedRunner, ObservingStore
from streams.ownership import Ownership, job_partition
from streams.reports import decode_report
from streams.writer import ClickHouseWriter
from tests.integration.test_streams_queries import CLOCK, _nothing, config, load


def job_on(partition: int, count: int, prefix: str) -> str:
    i = 0
    while job_partition(f"{prefix}-{i}", count) != partition:
        i += 1
    return f"{prefix}-{i}"


class Outbox:
    """What a worker would publish on the stored topic: (job, report) in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def report(self, job: str, data: bytes) -> None:
        self.sent.append((job, data))

    def reports(self) -> list[bytes]:
        return [d for _, d in self.sent]


def worker(db: Database, partitions: Sequence[int], report: Any = None
           ) -> tuple[DerivedRunner, ObservingStore]:
    own = Ownership(standalone=False)
    own.assign(partitions, 2)
    runner = DerivedRunner(db, _nothing, config(), clock=CLOCK, ownership=own)
    store = ObservingStore(ClickHouseWriter(db), runner.windows, runner.kernels.buffer,
                           ownership=own, report=report)
    return runner, store


async def split_load(db: Database, cfg: JobConfig) -> tuple[ObservingStore, ObservingStore,
                                                            DerivedRunner, dict[str, int]]:
    out = Outbox()
    sent = out.sent
    runner, owner = worker(db, [0])
    other_runner, other = worker(db, [1], out.report)
    await runner.restore()
    await other_runner.restore()
    keys: dict[str, int] = {}
    for i, (_, kind, producer, data) in enumerate(Simulation(cfg).uploads()):
        b = decode_batch(data)
        if kind == "jobs":
            await owner.write_topologies(b.topologies, f"jobs:{cfg.job_id}:{i}")
            continue
        key = batch_key(kind, cfg.job_id, producer)
        keys[key] = keys.get(key, 0) + 1
        store = other if kind in SPREAD_KINDS else owner
        await store.write(kind, [b], f"{cfg.job_id}:{i}", sources=[(0, i)])
        if sent:  # what the owner's reports agent reads
            assert {j for j, _ in sent} == {cfg.job_id}
            await owner.fold_reports([decode_report(d) for _, d in sent])
            sent.clear()
        CLOCK.pause(0.05)
        if i % 20 == 0:
            await runner.tick()
            await other_runner.tick()
    CLOCK.pause(60)
    while await runner.tick():
        pass
    await other_runner.tick()
    return owner, other, other_runner, keys


def rows(db: Database, table: str, job: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in db.query(
        f"SELECT * EXCEPT (job_id, ingest_ts) FROM {table} FINAL WHERE job_id = {{j:String}} "
        "ORDER BY ALL", {"j": job}).result_rows]


def test_a_job_stored_by_two_workers_derives_what_one_worker_derives(
        clickhouse_db: Database) -> None:
    db = clickhouse_db
    job = job_on(0, 2, "split")
    cfg = JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=30, microbatches=4, seed=5,
                    ranks_per_host=2, uploaders=2)
    owner, other, other_runner, keys = asyncio.run(split_load(db, cfg))
    ref = f"{job}-ref"
    asyncio.run(load(db, cfg.with_(job_id=ref)))

    # the spread kinds came as two producers, under keys other than the job's
    assert {k for k in keys if k != job} == {f"{job}/sim/{job}/0", f"{job}/sim/{job}/1"}
    assert other.reports_sent > 0 and owner.reports_folded == other.reports_sent
    assert owner.reports_not_owned == 0
    assert job not in other_runner.windows.jobs  # stored, not windowed: not its job
    for kind in ("ops", "flows", "chunks", "wr", "stages", "kernels", "beats"):
        n = db.query(f"SELECT count() FROM {kind} WHERE job_id = {{j:String}}",
                     {"j": job}).result_rows[0][0]
        m = db.query(f"SELECT count() FROM {kind} WHERE job_id = {{j:String}}",
                     {"j": ref}).result_rows[0][0]
        assert n == m > 0, kind
    for table in ("progress", "iterations", "kernel_summaries"):
        got, want = rows(db, table, job), rows(db, table, ref)
        assert want, table
        assert got == want, f"{table}: {len(got)} rows split, {len(want)} by one worker"


def test_reports_of_a_job_owned_elsewhere_are_counted_not_folded(
        clickhouse_db: Database) -> None:
    """A report read during a rebalance, for a job this worker does not own (any more)."""
    db = clickhouse_db
    job = job_on(1, 2, "notmine")
    cfg = JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=3, microbatches=4, seed=5)
    out = Outbox()

    async def go() -> tuple[ObservingStore, ObservingStore]:
        runner, here = worker(db, [0])
        _, other = worker(db, [0], out.report)  # neither owns the job: other reports it
        await runner.restore()
        for i, (_, kind, data) in enumerate(Simulation(cfg).batches()):
            if kind == "ops":
                await other.write(kind, [decode_batch(data)], f"{job}:{i}", sources=[(0, i)])
        await here.fold_reports([decode_report(d) for d in out.reports()])
        return here, other

    here, other = asyncio.run(go())
    sent = out.reports()
    assert sent and other.reports_sent == len(sent)
    assert here.reports_not_owned == len(sent) and here.reports_folded == 0
    assert job not in here.windows.jobs


def test_a_batch_skipped_as_stored_is_reported_again_but_not_listened_to_twice(
        clickhouse_db: Database) -> None:
    """A redelivered batch the raw sink skips (`ObservingStore.skipped`): its owner may never
    have heard of it, so it is reported again; the listeners (the triggers) had it already."""
    db = clickhouse_db
    job = job_on(1, 2, "again")
    cfg = JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=3, microbatches=4, seed=5)
    out = Outbox()

    async def go() -> tuple[int, int, int]:
        _, owner = worker(db, [1])
        _, other = worker(db, [0], out.report)
        heard: list[str] = []
        owner.listeners.append(lambda kind, b: heard.append(kind))
        every = {kind: decode_batch(data) for _, kind, data in Simulation(cfg).batches()}
        await owner.write("stages", [every["stages"]], f"{job}:s", sources=[(1, 0)])
        await owner.skipped("stages", [every["stages"]])
        await other.write("ops", [every["ops"]], f"{job}:o", sources=[(0, 0)])
        await other.skipped("ops", [every["ops"]])
        return len(heard), other.reports_sent, len(out.sent)

    heard, reports, published = asyncio.run(go())
    sent = out.reports()
    assert heard == 1
    assert reports == published == 2
    assert decode_report(sent[0])[0].segments == decode_report(sent[1])[0].segments
