"""Handing jobs over between workers (streams/derived.py `restore_windows`, streams/ownership.py):
after an assignment the runner drops the jobs it lost, loads the checkpoints of those it gained
and keeps the live state of those it kept. The stored checkpoints come from a stand-in for the
`stream_state` query (pure bookkeeping under test; the real table is exercised by
tests/e2e/test_worker_takeover.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import numpy as np

from ingest.units import SECOND as SEC
from streams.db import Database
from streams.derived import DerivedRunner
from streams.ownership import Ownership, job_partition


class StoredState:
    """Answers the runner's `stream_state` read with fixed rows."""

    def __init__(self, rows: list[tuple[str, str, int, int]]) -> None:
        self.rows, self.reads = rows, 0

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

