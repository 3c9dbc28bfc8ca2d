"""Python side of the per-rank shared-memory ring (native/ring, native/README.md).

Two users:

- the **host agent** drains rings with :class:`RingReader`: one ctypes call copies every committed
  record into a numpy structured array (no Python per record); :func:`split_kinds` turns the
  drained block into one structured array per record kind, and :func:`decode_names` resolves the
  64-bit name hashes (communicators, kernels, NICs) from the name records;
- the **PyTorch tracer** writes with :class:`RingWriter`: it fills a numpy array of records
  (:meth:`RingWriter.records`) and hands the whole batch to the ring in one ctypes call, which
  reserves once and commits each record with the same release store as the C producers.

The record layout is not repeated here: :func:`record_dtypes` builds the numpy dtypes from the
layout the C library exports (``rw_record__schema``), so the two cannot drift apart.

Nothing happens at import time; the library is loaded on first use from ``native/build`` (or an
explicit path) and a missing build raises :class:`RingLibraryMissing` with the command to run.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import numpy as np
import numpy.typing as npt

RECORD_SIZE: Final = 128
HEAD_FIELDS: Final = ("seq", "kind", "flags", "src", "ts")

#: enum rw_kind in native/ring/rw_record.h
KINDS: Final[dict[str, int]] = {
    "name": 1,
    "comm": 2,
    "op": 3,
    "flow": 4,
    "chunk": 5,
    "stage": 6,
    "kernel": 7,
    "wr": 8,
    "beat": 9,
}
#: enum rw_source
SOURCES: Final[dict[str, int]] = {"unknown": 0, "nccl": 1, "cupti": 2, "py": 3}
#: enum rw_flags
F_END: Final = 1 << 0
F_DETACHED: Final = 1 << 1
F_TRUNCATED: Final = 1 << 2
F_STALLED: Final = 1 << 3
F_FINAL: Final = 1 << 4
#: enum rw_func: index -> the contract's `op` name ("" = other)
FUNCS: Final = (
    "",
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "Reduce",
    "Broadcast",
    "AllToAll",
    "Send",
    "Recv",
    "Barrier",
)
DRAIN_SKIP_TORN: Final = 1
#: the producer's position words in the ring header (rw_ring.h RW_POS_*): step, realtime minus
#: the clock the times use, when a stage was last left, when each stage was last entered
POS_STEP: Final = 0
POS_OFFSET: Final = 1
POS_LEFT: Final = 2
POS_ENTER: Final = 3
POS_STAGES: Final = 5
POS_WORDS: Final = POS_ENTER + POS_STAGES
DEFAULT_PREFIX: Final = "/rankwatch"
PRODUCER_STATES: Final = ("dead", "alive", "unknown")

Records = npt.NDArray[np.void]


class RingLibraryMissing(FileNotFoundError):
    """librankwatch_ring.so is not built."""


class _Opts(ctypes.Structure):
    _fields_ = (
        ("capacity", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("source", ctypes.c_uint32),
        ("job_id", ctypes.c_char_p),
    )


class _Stat(ctypes.Structure):
    _fields_ = (
        ("capacity", ctypes.c_uint64),
        ("prod_pos", ctypes.c_uint64),
        ("cons_pos", ctypes.c_uint64),
        ("drops", ctypes.c_uint64),
        ("torn", ctypes.c_uint64),
        ("created_ns", ctypes.c_int64),
        ("producer_pid", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("source", ctypes.c_uint32),
        ("record_size", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("producer", ctypes.c_int32),
        ("job_id", ctypes.c_char * 64),
        ("pos_step", ctypes.c_int64),
        ("pos_ts", ctypes.c_int64),
        ("pos_stage", ctypes.c_int32),
        ("pos_pad", ctypes.c_int32),
    )


@dataclass(frozen=True)
class RingStat:
    """A ring's header and counters. `producer` is "alive", "dead" (stale ring) or "unknown"."""

    capacity: int
    prod_pos: int
    cons_pos: int
    drops: int  # records the producers dropped because the ring was full
    torn: int  # reserved slots skipped after their producer died
    created_ns: int
    producer_pid: int
    rank: int
    source: str
    version: int
    producer: str
    job_id: str
    pos_step: int = -1  # the producer's current step; -1 unknown (`RingWriter.position`)
    pos_stage: int = 0  # the stage it is inside, 1..POS_STAGES; 0 between stages or unknown
    pos_ts: int = 0  # when it entered that stage (or left its last one), realtime ns; 0 unknown

    @property
    def pending(self) -> int:
        return self.prod_pos - self.cons_pos

    @property
    def position(self) -> tuple[int, int, int]:
        """(step, stage, entry time ns) the producer last published (`RingWriter.position`):
        stage 0 is "between stages", 1.. index the producer's stage names from 1; (-1, 0, 0)
        when it never published one."""
        return self.pos_step, self.pos_stage, self.pos_ts


def default_library_path() -> Path:
    return Path(__file__).resolve().parent.parent / "native" / "build" / "librankwatch_ring.so"


@cache
def load_library(path: str | None = None) -> ctypes.CDLL:
    """Load librankwatch_ring.so (default: native/build of this checkout) and declare its API."""
    lib_path = Path(path) if path else default_library_path()
    if not lib_path.exists():
        raise RingLibraryMissing(f"{lib_path} not found; build it with `make -C native`")
    lib = ctypes.CDLL(str(lib_path))
    vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "rw_ring__create": (ctypes.c_int, [cp, ctypes.POINTER(_Opts), ctypes.POINTER(vp)]),
        "rw_ring__attach": (ctypes.c_int, [cp, ctypes.POINTER(vp)]),
        "rw_ring__free": (None, [vp]),
        "rw_ring__unlink": (ctypes.c_int, [cp]),
        "rw_ring__write_batch": (ctypes.c_long, [vp, vp, sz]),
        "rw_ring__drain": (ctypes.c_long, [vp, vp, sz, ctypes.c_uint]),
        "rw_ring__stat": (ctypes.c_int, [vp, ctypes.POINTER(_Stat)]),
        "rw_ring__position": (ctypes.c_void_p, [vp]),
        "rw_ring__name": (ctypes.c_int, [cp, sz, cp, cp, ctypes.c_int, cp]),
        "rw_record__schema": (cp, []),
        "rw_now_ns": (ctypes.c_int64, []),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


def _np_type(code: str) -> Any:
    if "x" in code:  # "u4x3" -> uint32[3]
        base, n = code.split("x")
        return ("<" + base, (int(n),))
    return code if code.startswith("S") else "<" + code


@cache
def record_dtypes(lib_path: str | None = None) -> dict[str, np.dtype[np.void]]:
    """One dtype per kind ("raw" too: the head and a 104-byte payload), each 128 bytes wide."""
    schema = load_library(lib_path).rw_record__schema().decode()
    if not schema:
        raise RuntimeError("librankwatch_ring.so returned an empty record schema")
    fields: dict[str, list[tuple[str, int, Any]]] = {}
    for item in filter(None, schema.split(";")):
        qual, offset, code = item.split(":")
        kind, field = qual.split(".")
        fields.setdefault(kind, []).append((field, int(offset), _np_type(code)))
    head = fields.pop("head")
    if tuple(f for f, _, _ in head) != HEAD_FIELDS:
        raise RuntimeError(f"unexpected record head {head}")

    def build(items: list[tuple[str, int, Any]]) -> np.dtype[np.void]:
        return np.dtype(
            {
                "names": [f for f, _, _ in items],
                "formats": [t for _, _, t in items],
                "offsets": [o for _, o, _ in items],
                "itemsize": RECORD_SIZE,
            }
        )

    out = {kind: build(head + items) for kind, items in fields.items()}
    out["raw"] = build([*head, ("payload", 24, "V104")])
    missing = set(KINDS) - set(out)
    if missing:
        raise RuntimeError(f"record schema lacks kinds {sorted(missing)}")
    return out


def ring_name(job_id: str, rank: int, source: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The shm name a producer uses: "<prefix>.<job_id>.<rank>.<source>" (validated in C)."""
    buf = ctypes.create_string_buffer(256)
    rc = load_library().rw_ring__name(
        buf, 256, prefix.encode(), job_id.encode(), rank, source.encode()
    )
    _check(rc, f"ring name for job_id={job_id!r} rank={rank} source={source!r}")
    return buf.value.decode()


def list_rings(prefix: str = DEFAULT_PREFIX, shm_dir: str = "/dev/shm") -> list[str]:
    """Shared-memory names that start with `prefix.` (what a host agent drains)."""
    stem = prefix.lstrip("/") + "."
    try:
        entries = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    return ["/" + e for e in entries if e.startswith(stem)]


def _stat(lib: ctypes.CDLL, handle: ctypes.c_void_p, name: str) -> RingStat:
    st = _Stat()
    _check(lib.rw_ring__stat(handle, ctypes.byref(st)), f"stat {name}")
    sources = {v: k for k, v in SOURCES.items()}
    return RingStat(
        capacity=st.capacity,
        prod_pos=st.prod_pos,
        cons_pos=st.cons_pos,
        drops=st.drops,
        torn=st.torn,
        created_ns=st.created_ns,
        producer_pid=st.producer_pid,
        rank=st.rank,
        source=sources.get(st.source, str(st.source)),
        version=st.version,
        producer=PRODUCER_STATES[st.producer] if 0 <= st.producer < 3 else "unknown",
        job_id=st.job_id.decode(errors="replace"),
        pos_step=st.pos_step,
        pos_stage=st.pos_stage,
        pos_ts=st.pos_ts,
    )


class _Ring:
    def __init__(self, name: str, lib_path: str | None) -> None:
        self.name = name
        self._lib = load_library(lib_path)
        self._dtypes = record_dtypes(lib_path)
        self._handle = ctypes.c_void_p()

    def stat(self) -> RingStat:
        self._require_open()
        return _stat(self._lib, self._handle, self.name)

    def close(self) -> None:
        handle = getattr(self, "_handle", None)  # absent when __init__ failed early
        if handle:
            self._lib.rw_ring__free(handle)
            self._handle = ctypes.c_void_p()

    def _require_open(self) -> None:
        if not self._handle:
            raise ValueError(f"ring {self.name} is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class RingReader(_Ring):
    """The one consumer of a ring. `drain` copies committed records out in bulk."""

    def __init__(self, name: str, *, lib_path: str | None = None, batch: int = 65536) -> None:
        super().__init__(name, lib_path)
        _check(self._lib.rw_ring__attach(name.encode(), ctypes.byref(self._handle)), name)
        self._buf = np.empty(batch, dtype=self._dtypes["raw"])
        self._bytes = self._buf.view(np.uint8)
        self._addr = self._buf.ctypes.data  # the buffer never moves: no ctypes object per drain
        self._empty = self._buf[:0].copy()

    def drain(self, max_records: int | None = None, *, skip_torn: bool = False) -> Records:
        """Every committed record (up to `max_records`), oldest first, as a "raw" array.

        With `skip_torn`, slots a dead producer reserved but never committed are skipped and
        counted (RingStat.torn); the C side checks that the producer is dead before skipping.
        """
        self._require_open()
        limit = max_records if max_records is not None else 1 << 62
        chunks: list[Records] = []
        flags = DRAIN_SKIP_TORN if skip_torn else 0
        while limit > 0:
            want = min(limit, len(self._buf))
            n = _check(
                self._lib.rw_ring__drain(self._handle, self._addr, want, flags),
                f"drain {self.name}",
            )
            if n == 0 and not chunks:
                return self._empty  # an idle ring: nothing allocated
            # Copy as bytes: numpy copies structured dtypes field by field, much slower.
            chunks.append(self._bytes[: n * RECORD_SIZE].copy().view(self._buf.dtype))
            limit -= n
            if n < want:
                break
        return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]

    def records(self, raw: Records, kind: str) -> Records:
        """The records of one kind from a drained block, viewed with that kind's dtype."""
        return split_kinds(raw, self._dtypes, kinds=(kind,))[kind]


class RingWriter(_Ring):
    """A producer in Python (the PyTorch tracer). Creates the ring; writes batches of records."""

    def __init__(
        self,
        name: str,
        *,
        capacity: int = 1 << 16,
        rank: int = -1,
        job_id: str = "",
        source: str = "py",
        lib_path: str | None = None,
    ) -> None:
        super().__init__(name, lib_path)
        self._src = SOURCES[source]
        opts = _Opts(capacity, rank, self._src, job_id.encode() or None)
        rc = self._lib.rw_ring__create(
            name.encode(), ctypes.byref(opts), ctypes.byref(self._handle)
        )
        _check(rc, f"create {name} (capacity {capacity})")

    def records(self, kind: str, n: int) -> Records:
        """n zeroed records of `kind` with kind and src set, ready to be filled and written."""
        arr = np.zeros(n, dtype=self._dtypes[kind])
        arr["kind"] = KINDS[kind]
        arr["src"] = self._src
        return arr

    def write(self, records: Records) -> int:
        """Write a batch (any kind dtype, or raw) with one reservation. Returns how many went in;
        the rest were dropped and counted in the ring header. Never blocks."""
        self._require_open()
        if records.dtype.itemsize != RECORD_SIZE or not records.flags.c_contiguous:
            raise ValueError("records must be a C-contiguous array of 128-byte ring records")
        if not len(records):
            return 0
        n = self._lib.rw_ring__write_batch(self._handle, records.ctypes.data, len(records))
        return _check(n, f"write {self.name}")

    def packer(self, kind: str, fields: Sequence[str], batch: int = 256) -> RecordPacker:
        """A per-record writer for `kind` that takes values of `fields` positionally."""
        return RecordPacker(self, kind, fields, batch)

    def _write_raw(self, address: int, n: int) -> int:
        self._require_open()
        return _check(self._lib.rw_ring__write_batch(self._handle, address, n), self.name)

    def position(self) -> Any:
        """The producer's `POS_WORDS` position words in the ring header, a writable ctypes int64
        array (an item store is one aligned 8-byte write, cheaper than a memoryview's): at a
        step's start store `POS_OFFSET` (realtime − your clock, ns), then `POS_STEP`, then
        `POS_LEFT` = now; on entering stage i (1..POS_STAGES) store ``[POS_ENTER + i - 1]`` = now,
        on leaving it ``[POS_LEFT]`` = now — one store each, any monotonic ns clock. `stat`
        reads back (step, stage, realtime entry ns). Valid until `close`: drop it before."""
        self._require_open()
        addr = self._lib.rw_ring__position(self._handle)
        return (ctypes.c_int64 * POS_WORDS).from_address(addr)

    def unlink(self) -> None:
        """Remove the ring's name (the reader's mapping stays valid)."""
        _check(self._lib.rw_ring__unlink(self.name.encode()), f"unlink {self.name}")


_STRUCT_CODES: Final = {"u1": "B", "u2": "H", "u4": "I", "u8": "Q", "i4": "i", "i8": "q"}


class RecordPacker:
    """The tracer's per-record path: one `add(*values)` packs a record into a staging buffer
    with a precompiled struct (no numpy per record); every `batch` records, or on `flush`, the
    staged records go into the ring with one call (same reservation and release stores as the
    C producers). `fields` must follow the record layout order (ValueError names the order);
    kind and src are filled in, `ts` is a field like any other.
    """

    def __init__(self, writer: RingWriter, kind: str, fields: Sequence[str], batch: int) -> None:
        dtype = writer._dtypes[kind]
        known: dict[str, Any] = dict(dtype.fields or {})
        unknown = [f for f in fields if f not in known or f in ("seq", "kind", "src")]
        if unknown:
            raise ValueError(f"{kind}: fields {unknown} cannot be packed")
        offsets = [int(known[f][1]) for f in fields]
        if offsets != sorted(offsets):
            in_order = sorted(fields, key=lambda f: int(known[f][1]))
            raise ValueError(f"{kind}: give fields in layout order {in_order}")
        fmt, pos = "<", 8
        for name in ("kind", "src", *fields):
            off, ft = int(known[name][1]), known[name][0]
            code = _STRUCT_CODES.get(ft.str[1:])
            if code is None:
                raise ValueError(f"{kind}.{name}: {ft} cannot be packed")
            fmt += "x" * (off - pos) + code
            pos = off + ft.itemsize
        self._struct = struct.Struct(fmt + "x" * (RECORD_SIZE - pos))
        self._head = (KINDS[kind], writer._src)
        self._writer = writer
        self._batch = batch
        self._buf = bytearray(RECORD_SIZE * batch)
        self._address = ctypes.addressof((ctypes.c_char * len(self._buf)).from_buffer(self._buf))
        self._n = 0
        self.written = 0
        self.dropped = 0

    def add(self, *values: int) -> None:
        self._struct.pack_into(self._buf, self._n * RECORD_SIZE + 8, *self._head, *values)
        self._n += 1
        if self._n == self._batch:
            self.flush()

    def flush(self) -> int:
        """Write what is staged; returns how many went in (the rest are dropped and counted)."""
        n, self._n = self._n, 0
        if not n:
            return 0
        put = self._writer._write_raw(self._address, n)
        self.written += put
        self.dropped += n - put
        return put


def split_kinds(
    raw: Records,
    dtypes: dict[str, np.dtype[np.void]] | None = None,
    kinds: tuple[str, ...] | None = None,
) -> dict[str, Records]:
    """Group a drained block by kind: {kind: structured array with that kind's fields}."""
    dtypes = dtypes or record_dtypes()
    codes = raw["kind"]
    # One stable sort and one gather instead of a mask per kind; order within a kind is kept.
    order = np.argsort(codes, kind="stable")
    grouped = raw.view(np.uint8).reshape(-1, RECORD_SIZE)[order]
    sorted_codes = codes[order]
    out: dict[str, Records] = {}
    for kind in kinds or tuple(KINDS):
        lo, hi = np.searchsorted(sorted_codes, [KINDS[kind], KINDS[kind] + 1])
        out[kind] = grouped[lo:hi].reshape(-1).view(dtypes[kind])
    return out


def decode_names(names: Records) -> dict[int, str]:
    """hash -> text from name records (parts joined in order; incomplete names are left out).

    This loops in Python, but over names only: each name is sent once per producer.
    """
    parts: dict[int, dict[int, bytes]] = {}
    total: dict[int, int] = {}
    for rec in names:
        h = int(rec["hash"])
        parts.setdefault(h, {})[int(rec["part"])] = bytes(rec["text"])[: int(rec["len"])]
        total[h] = int(rec["nparts"])
    out: dict[int, str] = {}
    for h, got in parts.items():
        if len(got) == total[h]:
            out[h] = b"".join(got[i] for i in range(total[h])).decode(errors="replace")
    return out


def iter_stats(prefix: str = DEFAULT_PREFIX) -> Iterator[tuple[str, RingStat]]:
    """(name, stat) of every ring under `prefix` that can be attached; foreign ones are skipped."""
    for name in list_rings(prefix):
        try:
            with RingReader(name, batch=1) as r:
                yield name, r.stat()
        except OSError:
            continue
