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

No message can stop the topic:
- event times are checked against `TimeBounds` around the producer's clock (the Kafka message
  timestamp); a batch with a row outside them is dead-lettered whole, so it is never stored and
  never drives a derived window (a row at 1 ns would open windows in 1970, one in 2262 would
  close windows ahead of the wall clock, one batch spanning months would touch more partitions
  than one insert may);
- an insert the store refuses for the rows themselves (`refused_by_store`: a type, parse or
  partition error, not an outage) is split into one insert per message, and each message the
  store still refuses is dead-lettered with the store's message as the reason. Outages (a
  connection, a full disk, memory) are retried until they pass: the topic stalls, nothing is lost;
- a dead letter carries at most `DLQ_PAYLOAD_MAX` bytes of its message (with the size and sha256
  of the whole), so it always fits the dead-letter topic.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ingest.backoff import Backoff, retry
from ingest.batch import TIME_COLUMN, BatchError, RecordBatch, decode_batch
from ingest.units import SECOND as _NS
from streams.writer import dedup_token, dedup_token_ranges

log = logging.getLogger(__name__)


#: The most bytes of a rejected message a dead letter carries: base64 makes 12 MiB 16 MiB, the
#: broker's message.max.bytes (ingest.topics.MAX_MESSAGE_BYTES), so 8 MiB leaves room for the rest.
DLQ_PAYLOAD_MAX = 8 << 20


@dataclass(frozen=True)
class Message:
    """What the sink needs of one consumed Kafka message. `timestamp_ns` is the message's Kafka
    timestamp (the producer's clock when it was created; 0 when unknown)."""

    topic: str
    partition: int
    offset: int
    value: bytes
    timestamp_ns: int = 0


@dataclass(frozen=True)
class DeadLetter:
    topic: str
    partition: int
    offset: int
    error: BatchError
    value: bytes

    @property
    def excerpt(self) -> bytes:
        """What the dead letter stores of the message: all of it, or its first DLQ_PAYLOAD_MAX
        bytes."""
        return self.value[:DLQ_PAYLOAD_MAX]

    @property
    def truncated(self) -> bool:
        return len(self.value) > DLQ_PAYLOAD_MAX

    def digest(self) -> str:
        return hashlib.sha256(self.value).hexdigest()

    def reason(self) -> str:
        """The error's reason, plus the whole message's size and digest when truncated."""
        if not self.truncated:
            return self.error.reason
        return (f"{self.error.reason} [payload truncated to {DLQ_PAYLOAD_MAX} of "
                f"{len(self.value)} bytes; sha256 {self.digest()}]")

    def to_json(self) -> dict[str, object]:
        return {
            "v": 1,
            "source": {"topic": self.topic, "partition": self.partition, "offset": self.offset},
            **self.error.to_dict(),
            "payload_bytes": len(self.value),
            "payload_sha256": self.digest(),
            "payload_truncated": self.truncated,
            "payload_b64": base64.b64encode(self.excerpt).decode(),
        }


@dataclass(frozen=True)
class TimeBounds:
    """Plausible event times for a message whose producer's clock read `ref` ns when it sent it:
    nonzero times (0 is "not known yet") must lie in [max(min_ns, ref - past_ns), ref +
    future_ns], and the message's record times (the kind's ingest.batch.TIME_COLUMN) must span
    at most `span_ns`. `past_ns` 0: no bound behind the producer's clock (imports and replays
    publish old times), only `min_ns`."""

    min_ns: int
    future_ns: int
    span_ns: int
    past_ns: int = 0

    def check(self, kind: str, rb: RecordBatch, ref_ns: int) -> None:
        """Raise BatchError naming the first column and row out of bounds. Checked: the kind's
        record time, `t_end`, and the end a record implies (a stage's start plus its six
        durations, a kernel's start plus its duration), all of which drive windows."""
        lo = max(self.min_ns, ref_ns - self.past_ns) if self.past_ns else self.min_ns
        hi = ref_ns + self.future_ns
        main = TIME_COLUMN.get(kind, "")
        for name, t in _times(kind, main, rb):
            bad = (t != 0) & ((t < lo) | (t > hi))
            if bad.any():
                row = int(np.argmax(bad))
                raise BatchError(
                    f"event time {int(t[row])} ns ({_iso(int(t[row]))}) is outside the plausible "
                    f"window {_iso(lo)} .. {_iso(hi)} around the producer's clock "
                    f"({_iso(ref_ns)}); set RANKWATCH_EVENT_TIME_MIN / _PAST_S / _FUTURE_S to "
                    "accept it", name, row)
            if name == main:
                known = t[t != 0]
                span = int(known.max()) - int(known.min()) if len(known) else 0
                if span > self.span_ns:
                    row = int(np.argmax(t))
                    raise BatchError(
                        f"the batch's {name} spans {span / _NS:.0f} s, more than "
                        f"{self.span_ns / _NS:.0f} s (RANKWATCH_EVENT_TIME_SPAN_S)",
                        name, row)


#: Durations that, added to the record time, give a time windows are driven by.
_DURATIONS: dict[str, tuple[str, ...]] = {
    "stages": ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step",
               "step_other"),
    "kernels": ("duration",),
}


def _times(kind: str, main: str, rb: RecordBatch) -> list[tuple[str, np.ndarray]]:
    out = []
    for name in (main, "t_end"):
        col = rb.cols.get(name) if name else None
        if col is not None and len(col):
            out.append((name, np.asarray(col)))
    durations = [rb.cols[d] for d in _DURATIONS.get(kind, ()) if d in rb.cols]
    if durations and out and out[0][0] == main:
        start = out[0][1]
        # in float: durations up to int64 max each must not wrap around; the end of a record
        # with an unknown start (0) is unknown too
        end = start.astype(np.float64) + np.sum(durations, axis=0, dtype=np.float64)
        end = np.where(start != 0, np.minimum(end, 2.0**62), 0).astype(np.int64)
        out.append((f"{main} + {' + '.join(_DURATIONS[kind])}", end))
    return out


def _iso(ns: int) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns // _NS))
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns"


#: ClickHouse error codes of outages, not of the rows: an insert that failed with one is retried.
#: CANNOT_WRITE_TO_FILE_DESCRIPTOR, CANNOT_OPEN_FILE, TIMEOUT_EXCEEDED, TOO_SLOW,
#: CANNOT_ALLOCATE_MEMORY, TOO_MANY_SIMULTANEOUS_QUERIES, SOCKET_TIMEOUT, NETWORK_ERROR, ABORTED,
#: MEMORY_LIMIT_EXCEEDED, TABLE_IS_READ_ONLY, NOT_ENOUGH_SPACE, TOO_MANY_PARTS (merges behind),
#: ALL_CONNECTION_TRIES_FAILED, QUERY_WAS_CANCELLED, SYSTEM_ERROR, KEEPER_EXCEPTION,
#: POCO_EXCEPTION; on a cluster (streams/cluster.py) also NO_ZOOKEEPER, TOO_FEW_LIVE_REPLICAS,
#: UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE, REPLICA_IS_NOT_IN_QUORUM, UNKNOWN_STATUS_OF_INSERT
#: (retried with the same deduplication token) and ALL_REPLICAS_ARE_STALE.
TRANSIENT_CODES = frozenset({159, 160, 173, 202, 209, 210, 236, 241, 242, 243, 252, 279, 394,
                             425, 999, 1000, 75, 76, 225, 285, 286, 289, 319, 369})


def refused_by_store(e: BaseException) -> bool:
    """True when a failed insert failed for its rows (retrying the same rows fails again), False
    for an outage. Errors of ClickHouse with a code are the rows' unless the code is an outage's
    (TRANSIENT_CODES; "too many partitions for one insert" is the rows' although its code,
    TOO_MANY_PARTS, is also the merges-behind one); errors without a code, OS and connection
    errors are outages; ValueError/TypeError (a column the writer cannot encode) are the rows'."""
    code = getattr(e, "code", None)
    if isinstance(code, int) and code > 0:
        if "partitions for single INSERT" in str(e):
            return True
        return code not in TRANSIENT_CODES
    if isinstance(e, (OSError, ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return False
    return isinstance(e, (ValueError, TypeError, KeyError, IndexError, OverflowError))


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
    refused_inserts: int = 0
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
        bounds: TimeBounds | None = None,
        clock: Callable[[], int] = time.time_ns,
        on_skipped: Callable[[str, Sequence[RecordBatch]], Awaitable[None]] | None = None,
    ) -> None:
        self.kind, self.table, self.store = kind, table, store
        #: told of the valid batches skipped as already stored (a redelivery after a crash
        #: between the insert and the commit), as the store's write tells what it stored: the
        #: job's owner may never have heard of them (streams/reports.py)
        self.on_skipped = on_skipped
        self.dead_letters = dead_letters
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self.stopping = stopping
        self.bounds, self.clock = bounds, clock
        self.stats = SinkStats()
        self._stored_through: dict[int, int] = {}  # partition -> highest offset known stored
        #: time.monotonic() when the batch now being stored arrived; None when idle.
        self.busy_since: float | None = None

    def forget_partitions(self) -> None:
        """After a rebalance another worker may have stored more: re-read watermarks lazily."""
        self._stored_through.clear()

    async def process(self, messages: Sequence[Message]) -> int:
        """Store one consumed batch in one insert (all its partitions); returns rows inserted."""
        self.busy_since = time.monotonic()
        try:
            return await self._process(messages)
        finally:
            self.busy_since = None

    async def _process(self, messages: Sequence[Message]) -> int:
        by_partition: dict[int, list[Message]] = {}
        for m in messages:
            by_partition.setdefault(m.partition, []).append(m)
        dead: list[DeadLetter] = []
        batches: list[RecordBatch] = []
        sources: list[tuple[int, int]] = []
        kept: list[Message] = []
        ranges: list[tuple[int, int, int]] = []  # (partition, first, last) of the fresh messages
        now = self.clock()
        skipped: list[Message] = []
        for partition, msgs in sorted(by_partition.items()):
            msgs.sort(key=lambda m: m.offset)
            fresh = await self._unstored(partition, msgs)
            skipped += msgs[:len(msgs) - len(fresh)]
            if not fresh:
                continue
            ranges.append((partition, fresh[0].offset, fresh[-1].offset))
            for m in fresh:
                try:
                    rb = decode_batch(m.value, coded=True)
                    if rb.kind != self.kind:
                        raise BatchError(f"a {rb.kind!r} batch on the {self.kind!r} topic", "kind")
                    if self.bounds is not None:
                        self.bounds.check(self.kind, rb, m.timestamp_ns or now)
                except BatchError as e:
                    dead.append(DeadLetter(m.topic, m.partition, m.offset, e, m.value))
                    continue
                batches.append(rb)
                sources.append((partition, m.offset))
                kept.append(m)
        if skipped and self.on_skipped is not None:
            await self._tell_skipped(skipped, now)
        if dead:  # first: after a crash past the insert, the skip below would pass them by
            await self._dead(dead)
        rows = 0
        if batches:
            token = dedup_token_ranges(messages[0].topic, ranges)
            rows, stored = await self._write_or_split(batches, token, sources, kept)
            batches = [b for b, ok in zip(batches, stored, strict=True) if ok]
            sources = [s for s, ok in zip(sources, stored, strict=True) if ok]
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

    async def _tell_skipped(self, skipped: list[Message], now: int) -> None:
        """`on_skipped` with the valid batches among `skipped` (the invalid ones were
        dead-lettered, not stored), retried while it fails for an outage."""
        batches = []
        for m in skipped:
            try:
                rb = decode_batch(m.value, coded=True)
                if rb.kind == self.kind and self.bounds is not None:
                    self.bounds.check(self.kind, rb, m.timestamp_ns or now)
            except BatchError:
                continue
            if rb.kind == self.kind:
                batches.append(rb)
        if not batches:
            return
        assert self.on_skipped is not None
        tell = self.on_skipped

        async def once() -> None:
            await tell(self.kind, batches)

        def again(e: Exception, wait: float) -> bool:
            log.warning("%s: telling of %d batches stored before failed (%s: %s); retrying in "
                        "%.1fs", self.table, len(batches), type(e).__name__, e, wait)
            return not self.stopping()

        await retry(once, Backoff(self.retry_initial_s, self.retry_max_s), again)

    async def _dead(self, dead: list[DeadLetter]) -> None:
        await self.dead_letters(dead)
        self.stats.dead_letters += len(dead)

    async def _write_or_split(self, batches: list[RecordBatch], token: str,
                              sources: list[tuple[int, int]], msgs: list[Message]
                              ) -> tuple[int, list[bool]]:
        """Store `batches` in one insert; when the store refuses their rows, one insert per
        message, dead-lettering each it still refuses (in offset order, so a message skipped
        after a restart was stored or dead-lettered). Returns rows written and, per batch,
        whether it was stored."""
        try:
            return await self._write(batches, token, sources), [True] * len(batches)
        except _Refused as refused:
            if len(batches) == 1:
                m = msgs[0]
                await self._dead([DeadLetter(m.topic, m.partition, m.offset,
                                             _store_error(refused.error), m.value)])
                return 0, [False]
            log.warning("%s: the store refused an insert of %d messages (%s); storing them one "
                        "by one", self.table, len(batches), refused.error)
        rows, stored = 0, []
        for rb, src, m in zip(batches, sources, msgs, strict=True):
            try:
                rows += await self._write([rb], dedup_token(m.topic, m.partition, m.offset,
                                                            m.offset), [src])
                stored.append(True)
            except _Refused as refused:
                await self._dead([DeadLetter(m.topic, m.partition, m.offset,
                                             _store_error(refused.error), m.value)])
                stored.append(False)
        return rows, stored

    async def _write(self, batches: list[RecordBatch], token: str,
                     sources: list[tuple[int, int]]) -> int:
        """One insert, retried while the store is out (waits from `retry_initial_s` doubling up
        to `retry_max_s`); raises _Refused when the store refuses the rows themselves
        (`refused_by_store`)."""

        async def insert() -> int:
            return await self.store.write(self.kind, batches, token, sources=sources)

        def again(e: Exception, wait: float) -> bool:  # the store's errors are many
            self.stats.last_error = f"{type(e).__name__}: {e}"
            if refused_by_store(e):
                self.stats.refused_inserts += 1
                raise _Refused(e) from e
            self.stats.insert_retries += 1
            if self.stopping():
                return False
            log.warning("insert into %s failed (%s); retrying in %.1fs",
                        self.table, self.stats.last_error, wait)
            return True

        n = await retry(insert, Backoff(self.retry_initial_s, self.retry_max_s), again)
        self.stats.inserts += 1
        return n


class _Refused(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _store_error(e: BaseException) -> BatchError:
    message = " ".join(str(getattr(e, "message", e)).split())[:2000]
    return BatchError(f"the store refused the rows: {type(e).__name__}: {message}", "", -1)
