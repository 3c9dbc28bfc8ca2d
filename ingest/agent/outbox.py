"""The agent's way out: per-(job, kind) column buffers → encoded batches → Kafka, with a spill.

- `append` adds a drain's columns to the (job, kind) buffer; a buffer becomes one record batch
  when it holds `max_rows` rows or is `linger_s` old (`lingers` per kind: `flush`). String
  columns are
  dictionary-encoded with `np.unique` (no Python loop over rows).
- A batch goes to the publisher (`BatchPublisher`: idempotent, zstd, linger). One the client
  will not queue now, or whose delivery fails (broker down past ``message.timeout.ms``), goes into
  the bounded `Spill` and is retried first (`pump`); batches keep their order because nothing new
  is sent while older ones wait.
- `stats` measures the way out: delivered/failed/retried, spill and its drops, `lag_s` (age of
  the oldest record not yet handed to the client) and publish latency (ring read → broker ack).

Single-threaded: delivery callbacks run inside the publisher's `flush(0)`, on the agent's loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ingest.agent.decode import Cols, n_rows
from ingest.agent.spill import Pending, Spill
from ingest.batch import encode_batch
from ingest.keys import batch_key


class Publisher(Protocol):
    def publish(self, kind: str, data: bytes, key: bytes | str | None = None,
                topic: str | None = None,
                on_delivery: Callable[..., None] | None = None) -> bool: ...

    def flush(self, timeout: float = 30.0) -> int: ...


@dataclass
class Delivery:
    delivered_batches: int = 0
    delivered_records: int = 0
    failed_batches: int = 0
    retried_batches: int = 0
    latency_s_max: float = 0.0
    latency_s_last: float = 0.0


class Outbox:
    def __init__(self, publisher: Publisher, producer: str, *, linger_s: float, max_rows: int,
                 spill_bytes: int, lingers: dict[str, float] | None = None) -> None:
        self.pub = publisher
        self.producer = producer
        self.linger_s, self.max_rows = linger_s, max_rows
        #: per kind, a linger other than `linger_s` (the kinds a diagnosis waits on)
        self.lingers = dict(lingers or {})
        self.buffers: dict[tuple[str, str], tuple[list[Cols], int, float]] = {}
        self.spill = Spill(spill_bytes)
        self.counters = Delivery()
        self.seq = 0

    def append(self, job: str, kind: str, cols: Cols) -> None:
        n = n_rows(cols)
        if not n:
            return
        parts, rows, t0 = self.buffers.get((job, kind), ([], 0, time.monotonic()))
        parts.append(cols)
        self.buffers[(job, kind)] = (parts, rows + n, t0)
        if rows + n >= self.max_rows:
            self._flush_one(job, kind)

    def flush(self, force: bool = False) -> None:
        """Encode and send every buffer that is due (all of them with `force`)."""
        now = time.monotonic()
        for (job, kind), (_, _, t0) in list(self.buffers.items()):
            if force or now - t0 >= self.lingers.get(kind, self.linger_s):
                self._flush_one(job, kind)

    def _flush_one(self, job: str, kind: str) -> None:
        parts, rows, t0 = self.buffers.pop((job, kind))
        cols: dict[str, Any] = {}
        for k in parts[0]:
            v = np.concatenate([p[k] for p in parts])
            if v.dtype == object:  # dictionary-encode without a Python loop over rows
                uniq, codes = np.unique(v, return_inverse=True)
                cols[k] = (codes.reshape(-1), uniq.tolist())
            else:
                cols[k] = v
        self.seq += 1
        data = encode_batch(kind, job, cols, producer=self.producer, seq=self.seq,
                            validate=False, framing="binary")  # docs/records.md
        # the job's home partition, or this host's share of a spread kind (ingest/keys.py)
        self.send(Pending(kind, batch_key(kind, job, self.producer).encode(), data, rows, t0))

    def send(self, item: Pending) -> None:
        """Publish `item`, or spill it behind the batches already waiting."""
        if len(self.spill) or not self._try(item):
            self.spill.push(item)

    def _try(self, item: Pending) -> bool:
        def delivered(err: Any, _msg: Any) -> None:
            c = self.counters
            if err is not None:
                c.failed_batches += 1
                self.spill.push(item)
                return
            c.delivered_batches += 1
            c.delivered_records += item.records
            c.latency_s_last = time.monotonic() - item.t_read
            c.latency_s_max = max(c.latency_s_max, c.latency_s_last)

        return self.pub.publish(item.kind, item.data, key=item.key, on_delivery=delivered)

    def pump(self) -> None:
        """Retry spilled batches, oldest first, until the client refuses one."""
        while (item := self.spill.pop()) is not None:
            self.counters.retried_batches += 1
            if not self._try(item):
                self.spill.unpop(item)
                return

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery callbacks (waits up to `timeout` for outstanding deliveries)."""
        return self.pub.flush(timeout)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        oldest = min((t0 for _, _, t0 in self.buffers.values()), default=None)
        buffered_age = time.monotonic() - oldest if oldest is not None else 0.0
        return {
            "delivered_batches": c.delivered_batches, "delivered_records": c.delivered_records,
            "failed_batches": c.failed_batches, "retried_batches": c.retried_batches,
            "spill_batches": len(self.spill), "spill_bytes": self.spill.bytes,
            "spill_dropped_batches": self.spill.dropped_batches,
            "spill_dropped_records": self.spill.dropped_records,
            "lag_s": round(max(buffered_age, self.spill.oldest_age()), 3),
            "publish_latency_s_last": round(c.latency_s_last, 3),
            "publish_latency_s_max": round(c.latency_s_max, 3),
        }
