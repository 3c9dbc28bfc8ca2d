"""Raw sink: one consumed batch of Kafka messages of one record kind -> one insert.

Contract (what `RawSink.process` guarantees when it returns):
- every valid record batch among `messages` is durable in the kind's raw table;
- every invalid one is durable in the dead-letter topic (and the `dlq` table) with its reason,
  written before the valid ones' insert: a message skipped after a restart (its offset is below
  one already stored) was dead-lettered already. A crash between the two repeats dead letters
  rather than losing them;
- nothing is stored twice, even when Kafka redelivers after a crash.

The caller (a Faust agent, streams/app.py) acks the messages only after `process` returned, so
offsets are committed only after the rows are durable. `process` does not return until the store
accepted the rows: it retries a failing insert with back-off (the stream stalls; nothing is lost).

Exactly-once storage on top of at-least-once delivery takes two mechanisms:

1. **Offsets stored with the rows.** Each row carries `src_partition` and `src_offset` (the Kafka
   offset of the message it came from). The first time the sink sees a partition after start-up or
   a rebalance, it asks the table for the highest offset already stored from that partition at or
   after the first offset now being delivered, and skips messages up to it. This catches the case
   of an insert that succeeded but whose offsets were never committed: after the restart the same
   messages arrive again, grouped differently, and are skipped.
2. **Insert deduplication tokens.** Each insert carries a token derived from the topic and, per
   partition, the first and last offset it holds, so retrying an insert whose outcome is
   unknown (timeout, lost response) stores its rows once. ClickHouse keeps recent tokens per
   table (`non_replicated_deduplication_window`).

One insert for all partitions of a consumed batch, not one per partition: an insert costs the
engine ~10 ms whatever its size (a new part per table partition), so a consumer assigned six
partitions would spend most of its time creating parts. The rows still carry their own
(src_partition, src_offset), which is all mechanism 1 needs.

Per-record work is numpy only: batches are decoded with their string columns still
dictionary-encoded, and streams.writer.raw_block concatenates them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ingest.batch import BatchError, RecordBatch, decode_batch
from streams.writer import dedup_token_ranges

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Message:
    """What the sink needs of one consumed Kafka message."""

    topic: str
    partition: int
    offset: int
    value: bytes


@dataclass(frozen=True)
class DeadLetter:
    topic: str
    partition: int
    offset: int
    error: BatchError
    value: bytes

    def to_json(self) -> dict[str, object]:
        return {
            "v": 1,
            "source": {"topic": self.topic, "partition": self.partition, "offset": self.offset},
            **self.error.to_dict(),
            "payload_b64": base64.b64encode(self.value).decode(),
        }


class Store(Protocol):
    """The storage operations the sink needs (streams.store.ClickHouseStore over the writer)."""

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]]) -> int:
        """Store `batches` in one insert deduplicated by `token`; `sources` are their Kafka
        (partition, offset). Returns rows written; raises when not stored."""
        ...

    async def max_offset(self, table: str, partition: int, since: int) -> int:
        """Highest src_offset stored from `partition` that is >= `since`, or -1."""
        ...


DeadLetterSink = Callable[[Sequence[DeadLetter]], Awaitable[None]]


@dataclass
class SinkStats:
    messages: int = 0
    rows: int = 0
    inserts: int = 0
    skipped_messages: int = 0
    dead_letters: int = 0
    insert_retries: int = 0
    last_error: str = ""
    per_partition_rows: dict[int, int] = field(default_factory=dict)


class RawSink:
    """Stores batches of one kind into `table`; see the module docstring for the guarantees."""

    def __init__(
        self,
        kind: str,
        table: str,
        store: Store,
        dead_letters: DeadLetterSink,
        *,
        retry_initial_s: float = 0.2,
        retry_max_s: float = 10.0,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.kind, self.table, self.store = kind, table, store
        self.dead_letters = dead_letters
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self.stopping = stopping
        self.stats = SinkStats()
        self._stored_through: dict[int, int] = {}  # partition -> highest offset known stored

    def forget_partitions(self) -> None:
        """After a rebalance another worker may have stored more: re-read watermarks lazily."""
        self._stored_through.clear()

    async def process(self, messages: Sequence[Message]) -> int:
        """Store one consumed batch in one insert (all its partitions); returns rows inserted."""
        by_partition: dict[int, list[Message]] = {}
        for m in messages:
            by_partition.setdefault(m.partition, []).append(m)
        dead: list[DeadLetter] = []
        batches: list[RecordBatch] = []
        sources: list[tuple[int, int]] = []
        ranges: list[tuple[int, int, int]] = []  # (partition, first, last) of the fresh messages
        for partition, msgs in sorted(by_partition.items()):
            msgs.sort(key=lambda m: m.offset)
            fresh = await self._unstored(partition, msgs)
            if not fresh:
                continue
            ranges.append((partition, fresh[0].offset, fresh[-1].offset))
            for m in fresh:
                try:
                    rb = decode_batch(m.value, coded=True)
                    if rb.kind != self.kind:
                        raise BatchError(f"a {rb.kind!r} batch on the {self.kind!r} topic", "kind")
                except BatchError as e:
                    dead.append(DeadLetter(m.topic, m.partition, m.offset, e, m.value))
                    continue
                batches.append(rb)
                sources.append((partition, m.offset))
        if dead:  # first: after a crash past the insert, the skip below would pass them by
            await self.dead_letters(dead)
            self.stats.dead_letters += len(dead)
        rows = 0
        if batches:
            token = dedup_token_ranges(messages[0].topic, ranges)
            rows = await self._write(batches, token, sources)
            for (partition, _), rb in zip(sources, batches, strict=True):
                self.stats.per_partition_rows[partition] = (
                    self.stats.per_partition_rows.get(partition, 0) + rb.n)
        for partition, _, last in ranges:
            self._stored_through[partition] = last
        self.stats.messages += len(messages)
        self.stats.rows += rows
        return rows

    async def _unstored(self, partition: int, msgs: list[Message]) -> list[Message]:
        if partition not in self._stored_through:
            self._stored_through[partition] = await self.store.max_offset(
                self.table, partition, msgs[0].offset)
        through = self._stored_through[partition]
        fresh = [m for m in msgs if m.offset > through]
        self.stats.skipped_messages += len(msgs) - len(fresh)
        return fresh

    async def _write(self, batches: list[RecordBatch], token: str,
                     sources: list[tuple[int, int]]) -> int:
        delay = self.retry_initial_s
        while True:
            try:
                n = await self.store.write(self.kind, batches, token, sources=sources)
                self.stats.inserts += 1
                return n
            except Exception as e:  # the store's errors are many; all mean "not stored yet"
                self.stats.insert_retries += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                if self.stopping():
                    raise
                log.warning("insert into %s failed (%s); retrying in %.1fs",
                            self.table, self.stats.last_error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
