"""PyTorch profiler (Kineto) trace files → `kernels` and `ops` records.

A Kineto trace is one JSON object: ``{"schemaVersion", "distributedInfo": {"rank", "world_size",
"backend"}, "baseTimeNanoseconds", "traceEvents": [...]}``. We read complete events (``ph: "X"``):

- ``cat: "kernel"``: one GPU kernel — ``args.stream``, ``args.device``, ``args.correlation``;
  ``ts``/``dur`` in microseconds (floats) from ``baseTimeNanoseconds``. Every kernel becomes a
  `kernels` row.
- NCCL kernels also become `ops` rows. Both name styles are recognized: the older
  ``ncclKernel_AllReduce_RING_LL_Sum_float`` and the newer ``ncclDevKernel_AllReduce_Sum_f32_
  RING_LL`` (and ``ncclDevKernel_Generic``/``SendRecv`` whose op comes from the args). Recent
  traces annotate NCCL kernels with ``args["Collective name"]``, ``"Process Group Name"``,
  ``"Seq"``, ``"In msg nelems"``, ``"dtype"``; when present they give op, comm_id, op_seq and
  bytes, otherwise the op comes from the kernel name, comm_id is ``"nccl"`` and op_seq counts the
  kernels in time order.
- ``cat: "cuda_runtime"`` launches with the same ``args.correlation`` give the op's enqueue time.

The rank is ``distributedInfo.rank``, else ``--rank``, else a ``rank<N>`` in the file name.
Files may be gzipped (``.json.gz``, as HolisticTraceAnalysis and TensorBoard keep them). For the
job topology: ``distributedInfo.world_size``, its ``pg_config`` (``pg_name``, ``pg_desc``,
``ranks``) and the kernels' ``"Process Group Ranks"``/``"Process Group Description"`` name the
communicators and their members; ``host_name`` the rank's host.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from ingest.importers.common import (
    DTYPE_BYTES,
    Collected,
    TraceError,
    collective_op,
    rank_from_name,
    read_text,
)

_NCCL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_NAME_OP = {"AllReduce": "AllReduce", "AllGather": "AllGather", "ReduceScatter": "ReduceScatter",
            "Broadcast": "Broadcast", "Reduce": "Reduce", "SendRecv": "Send", "Send": "Send",
            "Recv": "Recv", "AllToAll": "AllToAll"}


def event_line(text: str, index: int) -> int:
    """The line where traceEvents[index] starts (error path only: one pass over the text)."""
    start = text.find('"traceEvents"')
    i = text.find("[", start) if start >= 0 else -1
    if i < 0:
        return 0
    depth, n, in_str, esc = 0, -1, False, False
    for j in range(i + 1, len(text)):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            if depth == 0:
                n += 1
                if n == index:
                    return text.count("\n", 0, j) + 1
            depth += 1
        elif ch in "}]":
            if depth == 0:
                return 0
            depth -= 1
    return 0


class _Events:
    """The trace's text, kept to name the line of a bad event."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.text = path, text

    def error(self, index: int, reason: str) -> TraceError:
        return TraceError(self.path, event_line(self.text, index),
                          f"traceEvents[{index}]: {reason}")


def _load(path: Path) -> dict[str, Any]:
    text = read_text(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, e.lineno, f"not valid JSON (truncated?): {e.msg}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(path, 1, "not a Kineto trace: no traceEvents array")
    doc["__text__"] = text
    return doc


def parse(path: Path, rank: int | None = None) -> Collected:
    doc = _load(path)
    where = _Events(path, doc.pop("__text__"))
    info = doc.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    r = info.get("rank", rank if rank is not None else rank_from_name(path))
    if not isinstance(r, int) or r < 0:
        raise TraceError(path, 0, "no rank: not in distributedInfo, --rank or the file name")
    base = doc.get("baseTimeNanoseconds", 0)
    if not isinstance(base, int) or base < 0:
        raise TraceError(path, 0, f"baseTimeNanoseconds {base!r} is not a non-negative integer")
    launches: dict[int, int] = {}
    kernels: list[tuple[int, dict[str, Any]]] = []
    for i, ev in enumerate(doc["traceEvents"]):
        if not isinstance(ev, dict):
            raise where.error(i, "not an object")
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "cuda_runtime"):
            continue
        ts, dur = ev.get("ts"), ev.get("dur", 0)
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) or dur < 0:
            raise where.error(i, f"({ev.get('name')!r}) ts/dur must be numbers >= 0, got "
                              f"ts={ts!r} dur={dur!r}")
        t_ns = base + round(ts * 1000)
        args = ev.get("args") or {}
        if ev["cat"] == "cuda_runtime":
            if isinstance(args.get("correlation"), int):
                launches[args["correlation"]] = t_ns
            continue
        kernels.append((i, ev))
    out = Collected()
    _topology(doc, info, r, out)
    seqs: dict[str, int] = {}
    for i, ev in sorted(kernels, key=lambda k: k[1]["ts"]):
        args = ev.get("args") or {}
        name = str(ev.get("name") or "")
        if not name:
            raise where.error(i, "kernel without a name")
        t0 = base + round(ev["ts"] * 1000)
        dur_ns = round(ev.get("dur", 0) * 1000)
        stream = args.get("stream", 0)
        if not isinstance(stream, int) or stream < 0:
            raise where.error(i, f"({name}) args.stream {stream!r} is not a stream id")
        out.add("kernels", rank=r, stream=stream, kernel=name[:256], t_start=t0,
                duration=dur_ns)
        m = _NCCL.match(name)
        if not m:
            continue
        op = collective_op(str(args.get("Collective name", ""))) or _NAME_OP.get(m.group(1))
        if op is None:
            continue
        comm = str(args.get("Process Group Name") or "nccl")
        if comm not in out.members and args.get("Process Group Ranks"):
            out.members[comm] = _ranks(args["Process Group Ranks"])
            out.descs[comm] = str(args.get("Process Group Description") or "")[:256]
        seq = args.get("Seq")
        if not isinstance(seq, int) or seq < 0:
            seq = seqs.get(comm, 0)
        seqs[comm] = seq + 1
        nelems = args.get("In msg nelems", 0)
        size = DTYPE_BYTES.get(str(args.get("dtype", "")).lower(), 0)
        nbytes = nelems * size if isinstance(nelems, int) and nelems >= 0 else 0
        enq = launches.get(args.get("correlation", -1), t0)
        out.add("ops", rank=r, comm_id=comm, op_seq=seq, op=op, bytes=nbytes, peer=-1,
                stream=stream, t_enqueue=min(enq, t0), t_start=t0, t_end=t0 + dur_ns, step=-1)
    return out


def _ranks(v: Any) -> set[int]:
    if isinstance(v, str):
        try:
            v = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return set()
    if isinstance(v, (list, tuple)):
        return {x for x in v if isinstance(x, int) and not isinstance(x, bool) and x >= 0}
    return set()


def _topology(doc: dict[str, Any], info: dict[str, Any], rank: int, out: Collected) -> None:
    """World size, process groups and host as the trace states them (module docstring)."""
    world = info.get("world_size")
    if isinstance(world, int) and 0 < world <= 1 << 20:
        out.world = world
    pgs = info.get("pg_config")
    for pg in pgs if isinstance(pgs, list) else []:
        if isinstance(pg, dict) and pg.get("pg_name") is not None:
            name = str(pg["pg_name"])
            out.members[name] = _ranks(pg.get("ranks"))
            out.descs[name] = str(pg.get("pg_desc") or "")[:256]
    host = doc.get("host_name")
    if isinstance(host, str) and host:
        out.hosts[rank] = host[:256]
