"""PyTorch Flight Recorder dumps → `ops` records with states, and `beats` at the dump time.

A dump is a dict, pickled (``torch._C._distributed_c10d._dump_fr_trace``, the
``TORCH_NCCL_DUMP_ON_TIMEOUT`` files) or JSON (``_dump_fr_trace_json``; torchcomms writes the
same keys): ``{"version", "rank"?, "host_name"?, "pg_config": {key: {"name", "desc",
"ranks"}}, "pg_status": {pg_id: {"last_enqueued_collective", "last_started_collective",
"last_completed_collective"}}, "entries": [...]}``; each entry has ``pg_id``,
``process_group`` (name, desc), ``collective_seq_id``, ``p2p_seq_id``, ``profiling_name``
(``"nccl:all_reduce"``, ``"gloo:all_reduce"``), ``state`` (scheduled / started / completed),
``retired``, ``time_created_ns``, ``time_discovered_started_ns``,
``time_discovered_completed_ns``, ``input_sizes``, ``input_dtypes``, ``is_p2p``.

One entry becomes one op: comm_id is the group name, op_seq the collective (or p2p) sequence
id, t_enqueue the creation time, t_start the time it was seen started (the creation time while
only scheduled), t_end the time it was seen completed, 0 while in flight.

**What completed.** NCCL's watchdog moves entries to started and completed. Gloo has no such
watchdog: its entries stay ``scheduled`` whatever happened to them (torch 2.15's gloo dumps,
read here). The dump still says which finished, and an entry is completed when any of these
holds — otherwise it is in flight:
- its state is ``completed``;
- it is ``retired`` (the work object finished and left the ring's active set);
- its collective sequence id is at most its group's ``pg_status`` ``last_completed_collective``
  (p2p entries have no such counter);
- (gloo, no ``retired``/``pg_status`` in the dump) a later entry of the same group exists:
  gloo runs a group's calls in order, so a later call started means this one returned.
A completed entry without a completion time gets the creation time of the group's next entry
(it had returned by then), else its own start.

**Dump time.** A dump is the ranks' state at the moment it was written, and a hang is measured
against that moment: an op in flight for minutes when the dump was taken is a hang, even though
the dump's last entry is its creation. Where the dump carries its own time (``dump_time_ns``,
``timestamp_ns``, torchcomms' ``dump_ts``) that is the moment, else the file's modification
time. Each rank gets one `beats` row per group at that moment (last_op_seq = its last completed
collective): the process was alive and wrote the dump, and the pipeline's event clock reaches
the dump time rather than stopping at the last entry.

The rank is the dump's ``rank``, else ``--rank``, else the file name (``rank_3``, ``trace_3``).
Pickles are read with an unpickler that admits only plain data — a dump is data, and a crafted
pickle must not run code.
"""

from __future__ import annotations

import ast
import io
import json
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
    read_bytes,
)
from ingest.units import SECOND

STATES = ("scheduled", "started", "completed")
_DUMP_TIME_KEYS = ("dump_time_ns", "timestamp_ns", "dump_ts", "dump_time")


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in ("set", "frozenset", "complex"):
            return getattr(__import__("builtins"), name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: dumps hold data only")


def _load(path: Path) -> dict[str, Any]:
    raw = read_bytes(path)
    if raw.lstrip()[:1] == b"{":
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            line = getattr(e, "lineno", 0)
            raise TraceError(path, line, f"not valid JSON (truncated?): {e}") from None
    else:
        try:
            doc = _DataOnly(io.BytesIO(raw)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
                AttributeError, KeyError, RecursionError) as e:
            raise TraceError(path, 0, "not a Flight Recorder dump (pickle or JSON; truncated?):"
                             f" {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise TraceError(path, 0, "not a Flight Recorder dump: no entries list")
    return doc


def _ns(e: dict[str, Any], key: str, idx: int, path: Path, required: bool = False) -> int:
    v = e.get(key)
    if v is None and not required:
        return 0
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TraceError(path, 0, f"entries[{idx}].{key}: expected nanoseconds, got {v!r}")
    return v


def _bytes(e: dict[str, Any]) -> int:
    sizes, dtypes = e.get("input_sizes") or [], e.get("input_dtypes") or []
    total = 0
    for i, shape in enumerate(sizes):
        if isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape):
            dt = str(dtypes[i]).lower() if i < len(dtypes) else ""
            total += math.prod(shape) * DTYPE_BYTES.get(dt, 0)
    return min(total, 2**62)


def _int(v: Any, default: int = -1) -> int:
    if isinstance(v, bool):
        return default
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.lstrip("-").isdigit():
        return int(v)
    return default


def _members(v: Any) -> set[int]:
    if isinstance(v, str):
        try:
            v = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return set()
    if isinstance(v, (list, tuple, set)):
        return {x for x in v if isinstance(x, int) and not isinstance(x, bool) and x >= 0}
    return set()


def dump_time(doc: dict[str, Any], path: Path) -> tuple[int, str]:
    """(ns, where it came from): the dump's own time, else the file's modification time."""
    for k in _DUMP_TIME_KEYS:
        v = _int(doc.get(k), 0)
        if v > 0:
            return (v if v > 10**15 else v * SECOND), f"the dump's {k}"
    return path.stat().st_mtime_ns, "the file's modification time"


def _groups(doc: dict[str, Any], comms: set[str], descs: dict[str, str],
            out: Collected) -> None:
    """Members of the groups the entries use, from pg_config (keys differ between versions:
    the group name, or an empty key whose desc or sole presence says which group it is)."""
    cfg = doc.get("pg_config")
    if not isinstance(cfg, dict):
        return
    rows = [(str(k), v) for k, v in cfg.items() if isinstance(v, dict)]
    for key, v in rows:
        name = str(v.get("name") or key)
        if name not in comms:
            by_desc = [c for c in comms if v.get("desc") and descs.get(c) == v.get("desc")]
            name = by_desc[0] if len(by_desc) == 1 else \
                next(iter(comms)) if len(rows) == len(comms) == 1 else name
        if name in comms:
            out.members.setdefault(name, set()).update(_members(v.get("ranks")))


def parse(path: Path, rank: int | None = None) -> Collected:
    doc = _load(path)
    r = _int(doc.get("rank"), -1)
    if r < 0:
        named = rank_from_name(path)
        r = rank if rank is not None else named if named is not None else -1
    if r < 0:
        raise TraceError(path, 0, "no rank: not in the dump, --rank or the file name "
                         "(rank_3, trace_3)")
    status = doc.get("pg_status") if isinstance(doc.get("pg_status"), dict) else {}
    rows: list[dict[str, Any]] = []
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
        seq = _int(e.get("p2p_seq_id" if p2p else "collective_seq_id"))
        if seq < 0:
            raise TraceError(path, 0, f"entries[{i}]: sequence id {seq!r} is not an integer")
        created = _ns(e, "time_created_ns", i, path, required=True)
        st = status.get(str(e.get("pg_id", ""))) if isinstance(status, dict) else None
        last_done = _int(st.get("last_completed_collective")) if isinstance(st, dict) else -1
        rows.append({"i": i, "comm": comm or "default", "desc": str(pg[1]) if isinstance(
            pg, (list, tuple)) and len(pg) > 1 else "", "op": op, "seq": seq, "p2p": p2p,
            "state": state, "created": created, "gloo": name.startswith("gloo:"),
            "started": _ns(e, "time_discovered_started_ns", i, path) or created,
            "ended": _ns(e, "time_discovered_completed_ns", i, path),
            "retired": e.get("retired"), "by_status": not p2p and 0 <= seq <= last_done,
            "bytes": _bytes(e)})
    out = Collected()
    nxt: dict[int, int] = {}
    last: dict[str, int] = {}
    for j in sorted(range(len(rows)), key=lambda j: (rows[j]["comm"], rows[j]["created"]),
                    reverse=True):
        c = rows[j]["comm"]
        if c in last:
            nxt[j] = rows[last[c]]["created"]
        last[c] = j
    done_seq: dict[str, int] = {}
    for j, x in enumerate(rows):
        done = (x["state"] == "completed" or x["retired"] is True or x["by_status"]
                or (x["gloo"] and x["retired"] is None and not status and j in nxt))
        t_end = 0
        if done:
            t_end = x["ended"] if x["state"] == "completed" and x["ended"] else \
                nxt.get(j, x["started"])
            t_end = max(t_end, x["started"], x["created"])
            if not x["p2p"]:
                done_seq[x["comm"]] = max(done_seq.get(x["comm"], -1), x["seq"])
        out.add("ops", rank=r, comm_id=x["comm"], op_seq=x["seq"], op=x["op"],
                bytes=x["bytes"], peer=-1, stream=0, t_enqueue=x["created"],
                t_start=max(x["started"], x["created"]), t_end=t_end, step=-1)
    descs = {x["comm"]: x["desc"] for x in rows}
    out.descs.update({k: v for k, v in descs.items() if v})
    _groups(doc, set(descs), descs, out)
    host = doc.get("host_name") or doc.get("hostname")
    if isinstance(host, str) and host:
        out.hosts[r] = host[:256]
    at, _ = dump_time(doc, path)
    newest = max((max(x["created"], x["started"]) for x in rows), default=0)
    for comm in sorted(descs) or [""]:
        out.add("beats", rank=r, ts=max(at, newest), comm_id=comm,
                last_op_seq=done_seq.get(comm, -1), dropped=0)
    return out
