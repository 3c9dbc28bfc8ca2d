"""PyTorch Flight Recorder dumps (``TORCH_NCCL_TRACE_BUFFER_SIZE``) → `ops` records with states.

A dump is a pickled dict: ``{"version", "rank", "host_name", "pg_config": {pg_name: {"name",
"desc", "ranks"}}, "pg_status", "entries": [...]}``; each entry has ``record_id``, ``pg_id``,
``process_group`` (name, desc), ``collective_seq_id``, ``p2p_seq_id``, ``profiling_name``
(``"nccl:all_reduce"``), ``state`` (scheduled / started / completed), ``time_created_ns``,
``time_discovered_started_ns``, ``time_discovered_completed_ns``, ``input_sizes``,
``input_dtypes``, ``is_p2p``.

One entry becomes one op: comm_id is the group name, op_seq the collective (or p2p) sequence
id, t_enqueue the creation time, t_start the time it was seen started (the creation time while
only scheduled), t_end the time it was seen completed — 0 unless the state is completed, which is
how a hang shows: the ops a rank scheduled or started and never finished.

Dumps are unpickled with a restricted unpickler that admits only plain containers, numbers and
strings — a dump is data, and a crafted pickle must not run code.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any

from ingest.importers.common import (
    DTYPE_BYTES,
    Collected,
    TraceError,
    collective_op,
    rank_from_name,
)

STATES = ("scheduled", "started", "completed")


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in ("set", "frozenset", "complex"):
            return getattr(__import__("builtins"), name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: dumps hold data only")


def _load(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(path, 0, f"cannot read: {e}") from None
    try:
        doc = _DataOnly(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as e:
        raise TraceError(path, 0, f"not a Flight Recorder pickle (truncated?): {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise TraceError(path, 0, "not a Flight Recorder dump: no entries list")
    return doc


def _ns(e: dict[str, Any], key: str, idx: int, path: Path, required: bool = False) -> int:
    v = e.get(key)
    if v is None and not required:
        return 0
    if not isinstance(v, int) or v < 0:
        raise TraceError(path, 0, f"entries[{idx}].{key}: expected nanoseconds, got {v!r}")
    return v


def _bytes(e: dict[str, Any]) -> int:
    sizes, dtypes = e.get("input_sizes") or [], e.get("input_dtypes") or []
    total = 0
    for i, shape in enumerate(sizes):
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            dt = str(dtypes[i]).lower() if i < len(dtypes) else ""
            total += math.prod(shape) * DTYPE_BYTES.get(dt, 0)
    return total


def parse(path: Path, rank: int | None = None) -> Collected:
    doc = _load(path)
    r = doc.get("rank", rank if rank is not None else rank_from_name(path))
    if not isinstance(r, int) or r < 0:
        raise TraceError(path, 0, "no rank: not in the dump, --rank or the file name")
    out = Collected()
    for i, e in enumerate(doc["entries"]):
        if not isinstance(e, dict):
            raise TraceError(path, 0, f"entries[{i}] is not a dict")
        state = e.get("state")
        if state not in STATES:
            raise TraceError(path, 0, f"entries[{i}].state {state!r} is not one of {STATES}")
        name = str(e.get("profiling_name", ""))
        op = collective_op(name)
        if op is None:
            raise TraceError(path, 0, f"entries[{i}].profiling_name {name!r}: unknown op")
        pg = e.get("process_group")
        comm = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", ""))
        p2p = bool(e.get("is_p2p", op in ("Send", "Recv")))
        seq = e.get("p2p_seq_id" if p2p else "collective_seq_id")
        if not isinstance(seq, int) or seq < 0:
            raise TraceError(path, 0, f"entries[{i}]: sequence id {seq!r} is not an integer")
        created = _ns(e, "time_created_ns", i, path, required=True)
        started = _ns(e, "time_discovered_started_ns", i, path) or created
        ended = _ns(e, "time_discovered_completed_ns", i, path) if state == "completed" else 0
        if state == "completed" and not ended:
            ended = started  # completed but the watchdog never timed it
        out.add("ops", rank=r, comm_id=comm or "default", op_seq=seq, op=op, bytes=_bytes(e),
                peer=-1, stream=0, t_enqueue=created, t_start=max(started, created),
                t_end=ended, step=-1)
    return out
