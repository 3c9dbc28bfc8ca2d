"""RawSink's pure logic against an in-memory store: grouping, skipping, dead letters, retries.

The real store is exercised by tests/integration/test_ingest_pipeline.py; this fake only records
calls and mimics ClickHouse's token deduplication, so the sink's own decisions can be checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

from ingest.batch import RecordBatch, encode_batch
from streams.raw_sink import DeadLetter, Message, RawSink
from streams.writer import dedup_token, dedup_token_ranges, raw_columns


class FakeStore:
    def __init__(self, fail_times: int = 0) -> None:
        self.rows: list[dict[str, np.ndarray]] = []
        self.tokens: set[str] = set()
        self.fail_times = fail_times
        self.calls = 0

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]]) -> int:
        self.calls += 1
        if self.fail_times:
            self.fail_times -= 1
            raise ConnectionError("store down")
        if token in self.tokens:
            return 0
        self.tokens.add(token)
        cols = raw_columns(kind, batches, 10**9, sources)
        self.rows.append(cols)
        return len(cols["src_offset"])

    async def max_offset(self, table: str, partition: int, since: int) -> int:
        offs = [int(o) for c in self.rows for o, p in zip(c["src_offset"], c["src_partition"],
                                                            strict=True)
                if p == partition and o >= since]
        return max(offs, default=-1)

    def count(self) -> int:
        return sum(len(c["src_offset"]) for c in self.rows)


def ops(n: int, start: int = 0) -> bytes:
    return encode_batch("ops", "job", {
        "rank": np.arange(n) % 8, "comm_id": ["dp"] * n, "op_seq": np.arange(start, start + n),
        "op": ["AllReduce"] * n, "bytes": np.full(n, 64), "t_enqueue": np.full(n, 5),
        "t_start": np.full(n, 10), "t_end": np.full(n, 20)})


T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def make(store: FakeStore, dead: list[DeadLetter] | None = None) -> RawSink:
    async def dl(batch: Sequence[DeadLetter]) -> None:
        (dead if dead is not None else []).extend(batch)
    return RawSink("ops", "ops", store, dl, retry_initial_s=0.001)


def test_one_insert_for_all_partitions_with_offset_token_and_source_columns() -> None:
    store = FakeStore()
    sink = make(store)
    msgs = [Message("rw.ops", p, o, ops(3)) for p, o in [(1, 7), (0, 5), (0, 6)]]
    assert run(sink.process(msgs)) == 9
    assert store.tokens == {dedup_token_ranges("rw.ops", [(0, 5, 6), (1, 7, 7)])}
    assert store.tokens == {"rw.ops:0:5-6,1:7-7"}
    (rows,) = store.rows
    assert list(rows["src_partition"]) == [0] * 6 + [1] * 3
    assert list(rows["src_offset"]) == [5, 5, 5, 6, 6, 6, 7, 7, 7]
    assert set(rows["job_id"]) == {"job"}
    assert (rows["ingest_ts"] == 10**9).all()
    assert sink.stats.per_partition_rows == {0: 6, 1: 3} and sink.stats.inserts == 1


def test_token_of_one_partition_is_the_plain_dedup_token() -> None:
    assert dedup_token_ranges("rw.ops", [(3, 100, 101)]) == dedup_token("rw.ops", 3, 100, 101)
    assert dedup_token_ranges("rw.ops", [(2, 9, 9), (0, 1, 4)]) == "rw.ops:0:1-4,2:9-9"
    with pytest.raises(ValueError, match="offset"):
        dedup_token_ranges("rw.ops", [(0, 5, 4)])
    with pytest.raises(ValueError, match="no offset"):
        dedup_token_ranges("rw.ops", [])


def test_redelivery_after_crash_is_skipped_even_when_regrouped() -> None:
    store = FakeStore()
    run(make(store).process([Message("rw.ops", 0, o, ops(2)) for o in range(4)]))
    # a new worker (fresh sink, offsets never committed) gets 0..5 in one bigger batch
    sink2 = make(store)
    run(sink2.process([Message("rw.ops", 0, o, ops(2)) for o in range(6)]))
    assert store.count() == 12
    assert sink2.stats.skipped_messages == 4


def test_bad_batch_goes_to_dead_letters_and_neighbours_are_stored() -> None:
    store, dead = FakeStore(), list[DeadLetter]()
    sink = make(store, dead)
    bad = ops(2).replace(b'"AllReduce"', b'"Jump"')
    wrong_kind = encode_batch("wr", "job", {"rank": [0], "nic": ["mlx5_0"], "ts": [1],
                                            "inflight": [0], "bytes_done": [0]})
    msgs = [Message("rw.ops", 0, 0, ops(2)), Message("rw.ops", 0, 1, bad),
            Message("rw.ops", 0, 2, ops(2)), Message("rw.ops", 0, 3, wrong_kind)]
    assert run(sink.process(msgs)) == 4
    assert [d.offset for d in dead] == [1, 3]
    assert dead[0].error.field == "op" and "Jump" in dead[0].error.reason
    assert dead[0].to_json()["source"] == {"topic": "rw.ops", "partition": 0, "offset": 1}
    assert sink.stats.dead_letters == 2


def test_dead_letters_are_durable_before_the_insert_that_may_crash() -> None:
    store, dead = FakeStore(fail_times=100), list[DeadLetter]()

    async def dl(batch: Sequence[DeadLetter]) -> None:
        dead.extend(batch)

    sink = RawSink("ops", "ops", store, dl, stopping=lambda: True)
    msgs = [Message("rw.ops", 0, 0, b"{bad"), Message("rw.ops", 1, 0, ops(2))]
    with pytest.raises(ConnectionError):
        run(sink.process(msgs))
    assert [(d.partition, d.offset) for d in dead] == [(0, 0)] and store.count() == 0


def test_failed_insert_is_retried_until_stored() -> None:
    store = FakeStore(fail_times=3)
    sink = make(store)
    assert run(sink.process([Message("rw.ops", 0, 0, ops(4))])) == 4
    assert store.count() == 4 and sink.stats.insert_retries == 3
    assert "store down" in sink.stats.last_error


def test_failed_insert_while_stopping_raises_so_offsets_are_not_committed() -> None:
    store = FakeStore(fail_times=100)
    sink = RawSink("ops", "ops", store, lambda d: asyncio.sleep(0), stopping=lambda: True)
    with pytest.raises(ConnectionError):
        run(sink.process([Message("rw.ops", 0, 0, ops(1))]))
    assert store.count() == 0


def test_batches_skipped_as_stored_are_told_again_for_the_jobs_owner() -> None:
    """A worker stored a job's batches and died before reporting them (streams/reports.py): the
    worker they are redelivered to skips them, and tells `on_skipped` of the valid ones (the
    invalid one was dead-lettered, not stored)."""
    store = FakeStore()
    first = [Message("rw.ops", 0, 0, ops(2)), Message("rw.ops", 0, 1, b"garbage"),
             Message("rw.ops", 0, 2, ops(3, start=2))]
    run(make(store).process(first))
    told: list[tuple[str, list[RecordBatch]]] = []

    async def on_skipped(kind: str, batches: Sequence[RecordBatch]) -> None:
        told.append((kind, list(batches)))

    sink2 = RawSink("ops", "ops", store, make(store).dead_letters, retry_initial_s=0.001,
                    on_skipped=on_skipped)
    run(sink2.process([*first, Message("rw.ops", 0, 3, ops(1, start=5))]))
    assert store.count() == 6 and sink2.stats.skipped_messages == 3
    (kind, batches), = told
    assert kind == "ops" and [b.n for b in batches] == [2, 3]
    run(sink2.process([Message("rw.ops", 0, 4, ops(1, start=6))]))
    assert len(told) == 1  # nothing skipped: nothing told
