"""A capture file: the agent's record batches written to disk instead of Kafka, replayed later.

For a host that cannot reach the broker (an air-gapped GPU node, a bug report, a test
fixture): ``rankwatch agent --capture FILE`` writes every batch the agent would have published,
byte for byte, and ``rankwatch replay FILE`` publishes them to the broker afterwards, where the
worker stores them as if the agent had been connected (batches carry their own producer and
sequence, so a replay twice is stored once).

Format: the 8-byte magic ``RWCAP001``, then one frame per batch: three little-endian u32 lengths
(kind, key, data) followed by those bytes. A truncated last frame (the agent killed mid-write)
is reported and skipped; everything before it replays.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"RWCAP001"
_HEAD = struct.Struct("<III")


class CaptureError(ValueError):
    """The file is not a capture, or a frame is damaged."""


@dataclass
class CaptureStats:
    batches: int = 0
    bytes: int = 0
    refused: int = 0  # batches over max_bytes: the outbox spills and drops them, counted


class CaptureWriter:
    """The agent's `Publisher`, writing frames to a file. Bounded by `max_bytes`: past it a
    batch is refused (the outbox spills it, then drops and counts), never blocking the agent."""

    def __init__(self, path: str | Path, max_bytes: int = 1 << 30) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.stats = CaptureStats()
        self._f: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(MAGIC)
        self._size = len(MAGIC)

    def publish(self, kind: str, data: bytes, key: bytes | str | None = None,
                topic: str | None = None,
                on_delivery: Callable[..., None] | None = None) -> bool:
        k = key.encode() if isinstance(key, str) else (key or b"")
        kb = kind.encode()
        frame = _HEAD.pack(len(kb), len(k), len(data)) + kb + k
        if self._size + len(frame) + len(data) > self.max_bytes:
            self.stats.refused += 1
            return False
        self._f.write(frame)
        self._f.write(data)
        self._size += len(frame) + len(data)
        self.stats.batches += 1
        self.stats.bytes += len(data)
        if on_delivery is not None:
            on_delivery(None, None)
        return True

    def flush(self, timeout: float = 30.0) -> int:
        self._f.flush()
        return 0

    def close(self) -> None:
        self._f.close()


class Tee:
    """A `Publisher` that publishes to `pub` and writes each batch `pub` accepted to a capture
    too (`rankwatch agent --tee FILE`: the live path, plus a file to replay the same job in
    process later). A refused batch is not written: the outbox retries it."""

    def __init__(self, pub: Any, capture: CaptureWriter) -> None:
        self.pub, self.capture = pub, capture

    def publish(self, kind: str, data: bytes, key: bytes | str | None = None,
                topic: str | None = None,
                on_delivery: Callable[..., None] | None = None) -> bool:
        if not self.pub.publish(kind, data, key=key, topic=topic, on_delivery=on_delivery):
            return False
        self.capture.publish(kind, data, key=key, topic=topic)
        return True

    def flush(self, timeout: float = 30.0) -> int:
        self.capture.flush()
        return int(self.pub.flush(timeout))

    def close(self) -> None:
        self.capture.close()


@dataclass(frozen=True)
class Frame:
    kind: str
    key: bytes
    data: bytes


def read_capture(path: str | Path, on_truncated: Callable[[int], Any] | None = None
                 ) -> Iterator[Frame]:
    """The frames of a capture file, in the order written. Raises CaptureError when the file is
    not a capture; a truncated last frame calls `on_truncated(offset)` and ends the iteration."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise CaptureError(f"{path}: not a rankwatch capture (no {MAGIC.decode()} header); "
                               "write one with `rankwatch agent --capture FILE`")
        offset = len(MAGIC)
        while head := f.read(_HEAD.size):
            if len(head) < _HEAD.size:
                if on_truncated:
                    on_truncated(offset)
                return
            nk, nkey, nd = _HEAD.unpack(head)
            if nk == 0 or nk > 64:
                raise CaptureError(f"{path}: damaged frame at byte {offset} (kind length {nk})")
            body = f.read(nk + nkey + nd)
            if len(body) < nk + nkey + nd:
                if on_truncated:
                    on_truncated(offset)
                return
            yield Frame(body[:nk].decode(), body[nk:nk + nkey], body[nk + nkey:])
            offset += _HEAD.size + len(body)
