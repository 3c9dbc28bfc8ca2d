"""The tracer's writer into the rank's native ring (native/ring, `ingest.ring`).

One ring per rank for the Python tracer: ``/rankwatch.<job_id>.<rank>.py`` (source ``py``),
beside the NCCL plugin's and the CUPTI injector's rings of the same rank. Records follow
native/ring/rw_record.h:

- an op is written twice, like the NCCL plugin does: a start record (``t_end = 0``) when the call
  is made and an end record (flag ``RW_F_END``, ``t_end`` set) when it completes;
- one stage record per step;
- communicator names travel once, as name records (``RW_NS_COMM``), keyed by the 64-bit FNV-1a
  hash the records carry (`comm_hash`).

Each event is packed with a precompiled struct into a one-record buffer and written at once (one
ctypes call; the ring never blocks, a full ring drops and counts), so an op's start is in the
ring before the call can block — what a hang diagnosis needs. (`ingest.ring.RecordPacker` packs
kind and src itself and cannot place `flags`, which lies between them; hence our own struct, and
`rw_ring__write` called directly on the writer's handle: ~0.5 µs less per record than
`RingWriter._write_raw`.)
"""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from ingest import ring
from ingest.torch.events import OP_NAMES

_now = time.time_ns
OP_FIELDS = ("kind", "flags", "src", "ts", "comm_hash", "op_seq", "bytes", "t_enqueue",
             "t_start", "t_end", "step", "peer", "root", "func")
STAGE_FIELDS = ("kind", "src", "ts", "step", "t_start", "data_next_wait", "model_fwd_loss",
                "model_backward", "callbacks", "optim_step", "step_other", "device_ns",
                "sched_wait_ns", "cpu_pressure_ns")
#: tracer op code -> enum rw_func (same order, "other" first)
FUNC = tuple(ring.FUNCS.index(name) for name in OP_NAMES)
NS_COMM = 1
_CODES = {"u1": "B", "u2": "H", "u4": "I", "u8": "Q", "i4": "i", "i8": "q"}
PY = ring.SOURCES["py"]


def packer(dtype: Any, fields: Sequence[str]) -> struct.Struct:
    """A struct packing `fields` (in layout order) of one 128-byte record from offset 8."""
    fmt, pos = "<", 8
    for name in fields:
        ft, off = dtype.fields[name][0], int(dtype.fields[name][1])
        if off < pos:
            raise ValueError(f"{name}: fields must follow the record layout order")
        fmt += "x" * (off - pos) + _CODES[ft.str[1:]]
        pos = off + ft.itemsize
    return struct.Struct(fmt + "x" * (ring.RECORD_SIZE - pos))


def fnv1a64(text: str) -> int:
    """rw_hash__str of native/ring/rw_record.h: 64-bit FNV-1a, never 0."""
    h = 0xCBF29CE484222325
    for b in text.encode():
        if b == 0:
            break
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h or 1


class RingSink:
    """Writes this rank's op, stage and name records."""

    def __init__(self, job_id: str, rank: int, capacity: int,
                 prefix: str = ring.DEFAULT_PREFIX) -> None:
        self.name = ring.ring_name(job_id, rank, "py", prefix)
        self.writer = ring.RingWriter(self.name, capacity=capacity, rank=rank, job_id=job_id,
                                      source="py")
        dtypes = ring.record_dtypes()
        self._buf = bytearray(ring.RECORD_SIZE)
        self._addr = ctypes.addressof((ctypes.c_char * ring.RECORD_SIZE).from_buffer(self._buf))
        # one record per call, straight into the library: rw_ring__write copies it in and
        # returns 0 or -ENOSPC (dropped and counted in the ring header) — never an error to raise
        write_one = ring.load_library().rw_ring__write
        write_one.argtypes, write_one.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        handle = self.writer._handle
        addr = ctypes.c_void_p(self._addr)
        self._write_rec: Callable[[], int] = lambda: write_one(handle, addr)
        self._pack_op = packer(dtypes["op"], OP_FIELDS).pack_into
        self._pack_stage = packer(dtypes["stage"], STAGE_FIELDS).pack_into
        self._op = ring.KINDS["op"]
        self._stage = ring.KINDS["stage"]
        self.hashes: list[int] = []  # comm index -> comm_hash

    def comm(self, comm_id: str) -> None:
        """Register the next communicator index: its hash, and its name record."""
        h = fnv1a64(comm_id)
        self.hashes.append(h)
        text = comm_id.encode()[:256]
        parts = [text[i: i + 88] for i in range(0, len(text), 88)] or [b""]
        recs = self.writer.records("name", len(parts))
        recs["ts"] = _now()
        recs["hash"] = h
        recs["ns"] = NS_COMM
        recs["nparts"] = len(parts)
        recs["total_len"] = len(text)
        for i, p in enumerate(parts):
            recs["part"][i] = i
            recs["len"][i] = len(p)
            recs["text"][i] = p
        self.writer.write(recs)

    def op_start(self, comm: int, seq: int, opcode: int, nbytes: int, peer: int, t: int,
                 step: int) -> None:
        self._pack_op(self._buf, 8, self._op, 0, PY, t, self.hashes[comm], seq, nbytes, t, t, 0,
                      step, peer, -1, FUNC[opcode])
        self._write_rec()

    def op_end(self, comm: int, seq: int, t_end: int) -> None:
        self._pack_op(self._buf, 8, self._op, ring.F_END, PY, _now(), self.hashes[comm], seq, 0,
                      0, 0, t_end, -1, -1, -1, 0)
        self._write_rec()

    def stage(self, step: int, t_start: int, data: int, fwd: int, bwd: int, cb: int, optim: int,
              other: int, device_ns: int, sched_wait_ns: int = -1,
              cpu_pressure_ns: int = -1) -> None:
        self._pack_stage(self._buf, 8, self._stage, PY, _now(), step, t_start, data, fwd, bwd,
                         cb, optim, other, device_ns, sched_wait_ns, cpu_pressure_ns)
        self._write_rec()

    @property
    def dropped(self) -> int:
        return int(self.writer.stat().drops)

    def close(self, unlink: bool = False) -> None:
        if unlink:
            self.writer.unlink()
        self.writer.close()
