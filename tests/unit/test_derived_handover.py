"""Handing jobs over between workers (streams/derived.py `restore_windows`, streams/ownership.py):
after an assignment the runner drops the jobs it lost, loads the checkpoints of those it gained
and keeps the live state of those it kept. The stored checkpoints come from a stand-in for the
`stream_state` query (pure bookkeeping under test; the real table is exercised by
tests/e2e/test_worker_takeover.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from ingest.batch import RecordBatch, decode_batch, encode_batch
from ingest.units import SECOND as SEC
from streams.db import Database
from streams.derived import DerivedRunner, ObservingStore
from streams.ownership import Ownership, job_partition
from streams.reports import decode_report
from streams.writer import ClickHouseWriter


class StoredState:
    """Answers the runner's `stream_state` read with fixed rows."""

    def __init__(self, rows: list[tuple[str, str, int, int]]) -> None:
        self.rows, self.reads = rows, 0
        #: the checkpoints stored since: (job, kind, next_start)
        self.stored: list[tuple[str, str, int]] = []

    async def ainsert(self, table: str, cols: dict[str, np.ndarray], settings: Any = None) -> None:
        assert table == "stream_state"
        self.stored += zip(cols["job_id"], cols["kind"], cols["next_start"].tolist(), strict=True)

    async def aquery_columns(self, sql: str, params: Any = None) -> dict[str, np.ndarray]:
        self.reads += 1
        cols = list(zip(*self.rows, strict=True)) if self.rows else [(), (), (), ()]
        return {"job_id": np.array(cols[0], object), "kind": np.array(cols[1], object),
                "next_start": np.array(cols[2], np.int64), "max_ns": np.array(cols[3], np.int64)}


async def _nothing(kind: str, job: str, data: bytes) -> None:
    return None


def jobs_on(partition: int, count: int, n: int) -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < n:
        if job_partition(f"job-{i}", count) == partition:
            out.append(f"job-{i}")
        i += 1
    return out


def test_a_rebalance_drops_lost_jobs_loads_gained_ones_and_keeps_the_rest() -> None:
    kept, = jobs_on(0, 2, 1)
    moved, = jobs_on(1, 2, 1)
    stored = StoredState([(kept, "progress", 100 * SEC, 105 * SEC),
                          (moved, "progress", 200 * SEC, 205 * SEC)])
    own = Ownership(standalone=False)
    runner = DerivedRunner(cast(Database, stored), _nothing, ownership=own)
    own.assign([0, 1], 2)  # owns both
    asyncio.run(runner.restore())
    assert set(runner.windows.jobs) == {kept, moved} and stored.reads == 1
    runner.windows.closed(kept, "progress", 100 * SEC)  # live progress past its checkpoint
    for job in (kept, moved):  # what the runner learned of each job between ticks
        runner.job_state(job).recent_step = 2 * SEC
    asyncio.run(runner.restore())
    assert stored.reads == 1  # unchanged ownership: nothing read

    own.assign([0], 2)  # the other partition went to another worker
    asyncio.run(runner.restore())
    assert set(runner.windows.jobs) == {kept}
    assert set(runner.jobs) == {kept}  # the lost job's state went with it, all of it
    assert runner.jobs[kept].recent_step == 2 * SEC
    assert runner.windows.jobs[kept].kinds["progress"].next_start == 101 * SEC  # live, kept

    own.assign([0, 1], 2)  # and came back: its stored checkpoint, not what was held before
    asyncio.run(runner.restore())
    assert set(runner.windows.jobs) == {kept, moved}
    assert runner.job_state(moved).recent_step is None  # learned again, not what it was
    assert runner.windows.jobs[moved].kinds["progress"].next_start == 200 * SEC
    assert runner.windows.jobs[kept].kinds["progress"].next_start == 101 * SEC



class SlowInsert:
    """A writer whose insert waits for `done`: a rebalance can land while a batch is stored."""

    def __init__(self, db: StoredState) -> None:
        self.db, self.done = db, asyncio.Event()

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]]) -> int:
        await self.done.wait()
        return sum(len(b.cols["rank"]) for b in batches)


def ops_batch(job: str, at_ns: int) -> RecordBatch:
    n = 4
    return decode_batch(encode_batch("ops", job, {
        "rank": np.arange(n), "comm_id": ["dp"] * n, "op_seq": np.arange(n),
        "op": ["AllReduce"] * n, "bytes": np.full(n, 64), "t_enqueue": np.full(n, at_ns),
        "t_start": np.full(n, at_ns), "t_end": np.full(n, at_ns + SEC // 10)}))


def test_a_batch_stored_while_its_job_is_handed_over_waits_for_the_jobs_checkpoints() -> None:
    """The survivor of a takeover is storing a batch of the job (a spread kind it stored and
    reported before) when the rebalance hands it the job: the batch must not open the job's
    windows at its own time — the previous owner's checkpoint says where they stand."""
    gained, = jobs_on(1, 2, 1)
    stored = StoredState([(gained, "iterations:open", 100 * SEC, 112 * SEC),
                          (gained, "progress", 111 * SEC, 112 * SEC)])
    own = Ownership(standalone=False)
    own.assign([0], 2)
    runner = DerivedRunner(cast(Database, stored), _nothing, ownership=own)
    writer = SlowInsert(stored)
    sent: list[tuple[str, bytes]] = []

    async def report(job: str, data: bytes) -> None:
        sent.append((job, data))

    store = ObservingStore(cast(ClickHouseWriter, writer), runner.windows, ownership=own,
                           report=report)

    async def main() -> None:
        await runner.restore()
        assert gained not in runner.windows.jobs
        write = asyncio.create_task(store.write("ops", [ops_batch(gained, 125 * SEC)], "t",
                                                sources=[(0, 0)]))
        await asyncio.sleep(0)  # the insert is under way
        own.assign([0, 1], 2)  # the owner died: its partition is this worker's now
        writer.done.set()
        await write

    asyncio.run(main())
    kinds = runner.windows.jobs[gained].kinds
    assert kinds["iterations"].next_start == 100 * SEC  # the checkpoint's, not 120 s
    assert not kinds["iterations"].fixed  # stored open: it may still move back
    assert kinds["progress"].next_start == 111 * SEC
    assert stored.stored == []  # nothing moved: the stored checkpoint stands
    assert sent == []  # owned by the time it was observed: nothing to report


def test_a_batch_whose_job_is_handed_away_meanwhile_is_reported_to_its_new_owner() -> None:
    mine, = jobs_on(1, 2, 1)
    stored = StoredState([(mine, "iterations", 100 * SEC, 112 * SEC)])
    own = Ownership(standalone=False)
    own.assign([0, 1], 2)
    runner = DerivedRunner(cast(Database, stored), _nothing, ownership=own)
    writer = SlowInsert(stored)
    sent: list[tuple[str, bytes]] = []

    async def report(job: str, data: bytes) -> None:
        if not sent:  # the rebalance lands while the first report is published
            own.assign([0], 2)
        sent.append((job, data))

    other, = jobs_on(0, 2, 1)
    assert other != mine
    store = ObservingStore(cast(ClickHouseWriter, writer), runner.windows, ownership=own,
                           report=report)

    async def main() -> None:
        await runner.restore()
        own.assign([1], 2)  # `other` is someone else's: its batch is reported first
        await runner.restore()
        writer.done.set()
        await store.write("ops", [ops_batch(other, 120 * SEC), ops_batch(mine, 120 * SEC)], "t",
                          sources=[(0, 0)])

    asyncio.run(main())
    assert mine not in runner.windows.jobs  # lost before it was observed: not windowed here
    assert [j for j, _ in sent] == [other, mine]  # but its new owner hears of it
    ext, = decode_report(sent[1][1])
    assert (ext.job, ext.kind, ext.lo) == (mine, "ops", 120 * SEC)
