"""A per-rank single-producer/single-consumer ring of fixed-size slots in a shared-memory file.

This is the Python stand-in for the native ring (native/ring, `ingest.ring`), which a colleague is
writing; it has the same shape, so swapping it in touches only `open_writer`/`open_reader`:

- one producer (the training thread) and one consumer (the host agent), no locks;
- fixed-size records (`events.SLOT_WORDS` int64 words), power-of-two capacity;
- `write` never blocks and never allocates a buffer: when the ring is full the event is dropped
  and counted in the header, which the agent reports;
- `read` hands the consumer every available slot as one numpy array (bulk, no per-record loop).

Layout (little-endian int64 words): ``[magic, capacity, head, tail, dropped, pid, 0, 0]`` then
``capacity × SLOT_WORDS`` words. The producer stores the slot, then `head`; the consumer reads
`head`, copies slots, then stores `tail`. On x86-64 (total store order) and with CPython executing
each store in program order this publishes the slot before the index, like a release store; the
native ring uses C11 acquire/release for the same pairing.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np

from ingest.torch.events import SLOT_WORDS

MAGIC = 0x52574E47_53504F4C  # "RWNGSPOL"
HEADER_WORDS = 8
_HEAD, _TAIL, _DROPPED, _PID = 2, 3, 4, 5
_SLOT_BASE = HEADER_WORDS * 8
_SLOT_BYTES = SLOT_WORDS * 8


def _map(path: Path, create_capacity: int = 0) -> tuple[mmap.mmap, np.ndarray]:
    if create_capacity:
        if create_capacity & (create_capacity - 1):
            raise ValueError(f"capacity {create_capacity} is not a power of two")
        size = (HEADER_WORDS + create_capacity * SLOT_WORDS) * 8
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.truncate(size)
        fd = os.open(tmp, os.O_RDWR)
    else:
        fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    words = np.frombuffer(mm, dtype="<i8")
    if create_capacity:
        words[1] = create_capacity
        words[_PID] = os.getpid()
        words[0] = MAGIC
        os.replace(tmp, path)  # readers never see a half-initialized ring
    elif words.size < HEADER_WORDS or words[0] != MAGIC:
        raise ValueError(f"{path}: not a rankwatch ring (bad magic)")
    return mm, words


class SpoolWriter:
    """The producer side: `write(*words)` appends one event or counts it dropped."""

    def __init__(self, path: Path, capacity: int = 1 << 16) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._mm, self._words = _map(path, capacity)
        self._cap = capacity
        self._mask = capacity - 1
        self._head = 0
        # memoryview stores and struct.pack_into are several times cheaper than numpy scalars
        self._hdr = memoryview(self._mm).cast("q")
        self._pack = [struct.Struct(f"<{n}q").pack_into for n in range(SLOT_WORDS + 1)]

    def write(self, row: tuple[int, ...]) -> bool:
        """Append one event (a tuple of up to SLOT_WORDS ints). False: the ring was full."""
        hdr = self._hdr
        head = self._head
        if head - hdr[_TAIL] >= self._cap:
            hdr[_DROPPED] += 1
            return False
        self._pack[len(row)](self._mm, _SLOT_BASE + (head & self._mask) * _SLOT_BYTES, *row)
        head += 1
        self._head = head
        hdr[_HEAD] = head  # publishes the slot (see module docstring)
        return True

    @property
    def dropped(self) -> int:
        return int(self._hdr[_DROPPED])

    def close(self, unlink: bool = False) -> None:
        self._hdr.release()
        self._words = np.empty(0, np.int64)
        self._mm.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class SpoolReader:
    """The consumer side: `read()` returns every slot written since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm, self._words = _map(path)
        self._cap = int(self._words[1])
        self._slots = self._words[HEADER_WORDS:].reshape(self._cap, SLOT_WORDS)

    @property
    def pid(self) -> int:
        return int(self._words[_PID])

    @property
    def dropped(self) -> int:
        return int(self._words[_DROPPED])

    @property
    def backlog(self) -> int:
        return int(self._words[_HEAD] - self._words[_TAIL])

    def read(self, max_rows: int = 1 << 20) -> np.ndarray:
        """Copy out up to `max_rows` available slots as an int64 array [n, SLOT_WORDS]."""
        tail = int(self._words[_TAIL])
        head = int(self._words[_HEAD])  # acquire: slots below head are complete
        n = min(head - tail, max_rows)
        if n <= 0:
            return np.empty((0, SLOT_WORDS), np.int64)
        idx = (tail + np.arange(n)) & (self._cap - 1)
        out: np.ndarray = self._slots[idx].copy()
        self._words[_TAIL] = tail + n  # release: the producer may reuse these slots
        return out

    def close(self) -> None:
        self._slots = self._words = np.empty((0, SLOT_WORDS), np.int64)
        self._mm.close()


def open_writer(path: Path, capacity: int = 1 << 16) -> SpoolWriter:
    return SpoolWriter(path, capacity)


def open_reader(path: Path) -> SpoolReader:
    return SpoolReader(path)
