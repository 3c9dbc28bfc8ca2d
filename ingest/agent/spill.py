"""A bounded spill of encoded batches the broker has not taken yet (outage, full client queue).

Oldest out first; when adding a batch would exceed `max_bytes`, the oldest batches are dropped
and counted (batches and the records in them) — memory stays bounded through any outage, and the
agent reports exactly what it lost. Single-threaded: the agent's loop and the Kafka delivery
callbacks (served by that loop's `poll`) are the only users.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    kind: str
    key: bytes
    data: bytes
    records: int
    t_read: float  # monotonic time the rows left the ring (for lag)


class Spill:
    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.items: deque[Pending] = deque()
        self.bytes = 0
        self.dropped_batches = 0
        self.dropped_records = 0

    def push(self, item: Pending) -> None:
        self.items.append(item)
        self.bytes += len(item.data)
        while self.bytes > self.max_bytes and self.items:
            old = self.items.popleft()
            self.bytes -= len(old.data)
            self.dropped_batches += 1
            self.dropped_records += old.records

    def pop(self) -> Pending | None:
        if not self.items:
            return None
        item = self.items.popleft()
        self.bytes -= len(item.data)
        return item

    def unpop(self, item: Pending) -> None:
        """Put back at the front (the broker refused it again)."""
        self.items.appendleft(item)
        self.bytes += len(item.data)

    def oldest_age(self) -> float:
        return time.monotonic() - self.items[0].t_read if self.items else 0.0

    def __len__(self) -> int:
        return len(self.items)
