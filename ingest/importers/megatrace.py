"""Per-rank NCCL API log lines (MegaTrace's narrow waist: one line per intercepted call) → ops.

The lines are NCCL's own API log (``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL`` with
``NCCL_DEBUG_TIMESTAMP_FORMAT``), one file per rank, as MegaTrace collects them::

    [2025-03-01 10:00:00.123456] host1:2817:2817 [3] NCCL INFO AllReduce: opCount 1a sendbuff
        0x7f… recvbuff 0x7f… count 1048576 datatype 7 op 0 root 0 comm 0x55d1 [nranks=8]
        stream 0x55e2

plus the init line that names the communicator job-wide:
``… NCCL INFO comm 0x55d1 rank 3 nranks 8 cudaDev 3 … commId 0x8d1f… - Init COMPLETE``.
The timestamp may also be epoch seconds (``1740823200.123456 host1:…``). Other lines are skipped;
a line that starts like an API call but does not parse is an error naming its line.

A log shows when each call was made, not when it finished. So t_enqueue = t_start = the line's
time, t_end = the next call's time on the same communicator (an upper bound on host progress),
and each communicator's last call stays in flight (t_end = 0) — where a hung rank stopped.
comm_id is the init line's commId (the same on every rank), else the comm pointer.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

from ingest.importers.common import Collected, TraceError, rank_from_name

_TS = re.compile(r"^\s*(?:\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?)\]|(\d{9,11}\.\d+))\s+")
_CALL = re.compile(r"NCCL INFO (AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|Send|Recv"
                   r"|AllToAll): opCount")
_FIELDS = re.compile(r"opCount ([0-9a-fA-F]+) .*?count (\d+) datatype (\d+) op (\d+) root (-?\d+)"
                     r" comm (0x[0-9a-fA-F]+)")
_INIT = re.compile(r"NCCL INFO comm (0x[0-9a-fA-F]+) rank (\d+) nranks (\d+).*?commId "
                   r"(0x[0-9a-fA-F]+)")
#: ncclDataType_t -> bytes (int8, uint8, int32, uint32, int64, uint64, half, float, double,
#: bfloat16, fp8e4m3, fp8e5m2)
_DTYPE = (1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1)


def _time(m: re.Match[str]) -> int:
    if m.group(2):
        sec, frac = m.group(2).split(".")
        return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])
    dt = datetime.fromisoformat(m.group(1).replace(" ", "T")).replace(tzinfo=UTC)
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


def parse(path: Path, rank: int | None = None) -> Collected:
    r = rank if rank is not None else rank_from_name(path)
    if r is None:
        raise TraceError(path, 0, "no rank: pass --rank or name the file rank<N>…")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(path, 0, f"cannot read: {e}") from None
    comm_ids: dict[str, str] = {}
    calls: list[tuple[str, int, str, int, int]] = []  # comm ptr, t, op, bytes, peer
    lines = text.split("\n")
    for no, line in enumerate(lines, 1):
        if "NCCL INFO" not in line:
            continue
        init = _INIT.search(line)
        if init:
            comm_ids[init.group(1)] = init.group(4)
            continue
        call = _CALL.search(line)
        if not call:
            continue
        ts, fields = _TS.match(line), _FIELDS.search(line)
        if ts is None:
            raise TraceError(path, no, "NCCL call line without a timestamp prefix")
        if fields is None:
            why = "truncated line" if no == len(lines) else "unparseable NCCL call line"
            raise TraceError(path, no, f"{why}: {line[:120]!r}")
        count, dtype, root = int(fields.group(2)), int(fields.group(3)), int(fields.group(5))
        if dtype >= len(_DTYPE):
            raise TraceError(path, no, f"datatype {dtype} is not an ncclDataType_t")
        op = call.group(1)
        peer = root if op in ("Send", "Recv") else -1
        calls.append((fields.group(6), _time(ts), op, count * _DTYPE[dtype], peer))
    out = Collected()
    by_comm: dict[str, list[int]] = {}
    for i, c in enumerate(calls):
        by_comm.setdefault(c[0], []).append(i)
    for ptr, idx in by_comm.items():
        comm = comm_ids.get(ptr, ptr)
        for seq, i in enumerate(idx):
            _, t, op, nbytes, peer = calls[i]
            t_end = calls[idx[seq + 1]][1] if seq + 1 < len(idx) else 0
            out.add("ops", rank=r, comm_id=comm, op_seq=seq, op=op, bytes=nbytes, peer=peer,
                    stream=0, t_enqueue=t, t_start=t, t_end=max(t_end, t) if t_end else 0,
                    step=-1)
    return out
