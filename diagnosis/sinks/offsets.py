"""Which offsets may be committed: a message counts as done when every sink it was routed to
finished with it (delivered, duplicate, or dead-lettered); a partition's commit point is one past
the longest done prefix of what was received. Thread-safe: sink threads finish, the consumer
thread commits. Pure (no Kafka)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

TP = tuple[str, int]


@dataclass
class _Partition:
    #: [offset, sinks still to finish], in the order received
    waiting: deque[list[int]] = field(default_factory=deque)
    commit: int = -1  # next offset to commit (-1: nothing new)
    #: revoked: sinks may still finish its messages, but they no longer count or commit
    detached: bool = False


class OffsetBook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[TP, _Partition] = {}
        self._pending = 0

    def add(self, tp: TP, offset: int, sinks: int) -> Callable[[str], None]:
        """Record a received message routed to `sinks` sinks; returns the callback each sink
        calls once when done with it (with no sinks the message is done at once)."""
        entry = [offset, sinks]
        with self._lock:
            part = self._parts.setdefault(tp, _Partition())
            part.waiting.append(entry)
            self._pending += 1
            if sinks == 0:
                self._advance(part)

        def done(_outcome: str) -> None:
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0:
                    self._advance(part)

        return done

    def _advance(self, part: _Partition) -> None:
        if part.detached:
            return
        while part.waiting and part.waiting[0][1] <= 0:
            part.commit = part.waiting.popleft()[0] + 1
            self._pending -= 1

    def pending(self) -> int:
        """Messages received and not yet done everywhere."""
        with self._lock:
            return self._pending

    def take_commits(self) -> dict[TP, int]:
        """The new commit points since the last call."""
        out: dict[TP, int] = {}
        with self._lock:
            for tp, part in self._parts.items():
                if part.commit >= 0:
                    out[tp] = part.commit
                    part.commit = -1
        return out

    def forget(self, tps: list[TP]) -> None:
        """Partitions revoked: their unfinished messages will be redelivered to the new owner."""
        with self._lock:
            for tp in tps:
                part = self._parts.pop(tp, None)
                if part is not None:
                    part.detached = True
                    self._pending -= len(part.waiting)
