"""Per-rank NCCL API call logs → ops: MegaTrace's own log lines and NCCL's INFO lines.

One file per rank. Two line formats are read, mixed freely:

- **MegaTrace** (sii-research/Megatrace, its patched NCCL's ring buffer, flushed per
  `save_count`): one line per intercepted API call::

      [save_count 1] [1755590104.254021144] [Rank 2] Fun AllReduce Data 1 stream 0x55… opCount 0
      [save_count 3] [1755590112.761995996] [Rank 2] Fun Recv Data 2048 stream 0x55… opCount 4
          groupHash -8215…   (one line)

  The time is the call's CLOCK_REALTIME, `Rank` the global rank, `Data` the element count (the
  datatype is not logged, so `bytes` holds elements: equal on every member of a collective,
  which is what the rules compare), `opCount` the communicator's own call counter. Newer
  versions add `groupHash`, a hash of the communicator's unique id — the same on every member,
  so it is the comm_id. Older lines name only the stream, which is per process:
  `link_channels` then finds which ranks' streams are one communicator (below).
- **NCCL INFO** (``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL``; NCCL ≥ 2.26 prints the time when
  ``NCCL_DEBUG_TIMESTAMP_LEVELS=WARN,INFO`` and ``NCCL_DEBUG_TIMESTAMP_FORMAT='[%F %T.%6f] '``
  with ``TZ=UTC``; older NCCL prints none)::

      [2025-03-01 10:00:00.123456] host1:2817:2817 [3] NCCL INFO AllReduce: opCount 1a sendbuff
          0x7f… recvbuff 0x7f… count 1048576 datatype 7 op 0 root 0 comm 0x55d1 [nranks=8] …

  plus the init line that names the communicator job-wide (``… comm 0x55d1 rank 3 nranks 8 …
  commId 0x8d1f… - Init COMPLETE``): its commId is the comm_id (else the comm pointer), its
  ranks the members. The time may also be epoch seconds (``1740823200.123456 host1:…``).

Other lines are skipped; a line that starts like a call but does not parse is an error naming
its line. A log shows when each call was made, not when it finished: t_enqueue = t_start = the
line's time, t_end = the next call's time on the same communicator (an upper bound on host
progress), and each communicator's last call stays in flight (t_end = 0) — where a hung rank
stopped. op_seq is opCount while a communicator's opCounts rise; a communicator whose opCount
repeats or falls (MegaTrace logs some grouped calls with opCount 0) is numbered by its calls.

**Linking streams (old MegaTrace lines).** The members of one communicator log the same calls
under the same opCount (op and element count agree) within the arrival skew of a collective,
while different communicators count differently. Two ranks' channels are one communicator when
at least `LINK_MIN_COMMON` of their common opCounts agree in op and count (≥ 95 %) and the median
time between the two ranks' calls is ≤ `LINK_MAX_SKEW_NS`; channels are joined transitively, and
a joined set holding two channels of one rank is not linked (ambiguous). Send/Recv channels are
left per rank (each rank counts its own p2p calls). Replicas that run in lockstep (DP > 1 with
identical TP groups) can look alike: `--tp/--pp/--dp` then restrict links to ranks that share a
group (`allowed`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

import numpy as np

from ingest.importers.common import Collected, TraceError, rank_from_name, read_text
from ingest.units import MICROSECOND, SECOND

_TS = re.compile(r"^\s*(?:\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?)\]|(\d{9,11}\.\d+))\s+")
_CALL = re.compile(r"NCCL INFO (AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|Send|Recv"
                   r"|AllToAll): opCount")
_FIELDS = re.compile(r"opCount ([0-9a-fA-F]+) .*?count (\d+) datatype (\d+) op (\d+) root (-?\d+)"
                     r" comm (0x[0-9a-fA-F]+)")
_INIT = re.compile(r"NCCL INFO comm (0x[0-9a-fA-F]+) rank (\d+) nranks (\d+).*?commId "
                   r"(0x[0-9a-fA-F]+)")
_MT = re.compile(r"^\s*\[save_count \d+\] \[(\d{9,11})\.(\d{1,9})\] \[Rank (\d+)\] Fun (\w+) "
                 r"Data (\d+) stream (\S+) opCount (-?\d+)(?: groupHash (-?\d+))?\s*$")
_MT_START = "[save_count"
#: ncclDataType_t -> bytes (int8, uint8, int32, uint32, int64, uint64, half, float, double,
#: bfloat16, fp8e4m3, fp8e5m2)
_DTYPE = (1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1)
_OPS = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv",
        "AllToAll", "AllToAllv"}
NO_TIME = ("NCCL API lines without a time: NCCL prints one on INFO lines from version 2.26 "
           "when run with NCCL_DEBUG_TIMESTAMP_LEVELS=WARN,INFO and "
           "NCCL_DEBUG_TIMESTAMP_FORMAT='[%F %T.%6f] ' (and TZ=UTC); older NCCL cannot")
LINK_MIN_COMMON = 8
LINK_MAX_SKEW_NS = 20_000_000
#: channel prefix of a per-rank stream channel (old MegaTrace lines)
LOCAL = "local:"
#: suffix of a per-rank channel numbered by its calls (its opCounts do not rise): not linked,
#: since its numbers are not the communicator's counter
BY_CALLS = "#calls"


def _time(m: re.Match[str]) -> int:
    if m.group(2):
        sec, frac = m.group(2).split(".")
        return int(sec) * SECOND + int((frac + "000000000")[:9])
    dt = datetime.fromisoformat(m.group(1).replace(" ", "T")).replace(tzinfo=UTC)
    return int(dt.timestamp()) * SECOND + dt.microsecond * MICROSECOND


Call = tuple[str, int, str, int, int, int]  # comm, t, op, bytes, peer, opCount


def _megatrace_line(path: Path, no: int, line: str, last: bool) -> tuple[int, Call]:
    m = _MT.match(line)
    if m is None:
        why = "truncated line" if last else "unparseable MegaTrace line"
        raise TraceError(path, no, f"{why}: {line[:120]!r}")
    sec, frac, rank, op, count, stream, opc, ghash = m.groups()
    op = "AllToAll" if op == "AllToAllv" else op
    if op not in _OPS:
        raise TraceError(path, no, f"unknown NCCL function {op!r}")
    t = int(sec) * SECOND + int((frac + "000000000")[:9])
    comm = f"g{ghash}" if ghash is not None else f"{LOCAL}{rank}:{stream}"
    return int(rank), (comm, t, op, int(count), -1, int(opc))


def _nccl_line(path: Path, no: int, line: str, last: bool) -> Call | None:
    call = _CALL.search(line)
    if not call:
        return None
    ts, fields = _TS.match(line), _FIELDS.search(line)
    if ts is None:
        raise TraceError(path, no, NO_TIME)
    if fields is None:
        why = "truncated line" if last else "unparseable NCCL call line"
        raise TraceError(path, no, f"{why}: {line[:120]!r}")
    count, dtype, root = int(fields.group(2)), int(fields.group(3)), int(fields.group(5))
    if dtype >= len(_DTYPE):
        raise TraceError(path, no, f"datatype {dtype} is not an ncclDataType_t")
    op = call.group(1)
    peer = root if op in ("Send", "Recv") else -1
    return (fields.group(6), _time(ts), op, count * _DTYPE[dtype], peer,
            int(fields.group(1), 16))


def parse(path: Path, rank: int | None = None,
          progress: Callable[[int, int], None] | None = None) -> Collected:
    text = read_text(path)
    comm_ids: dict[str, str] = {}
    calls: list[Call] = []
    ranks_seen: set[int] = set()
    lines = text.split("\n")
    for no, line in enumerate(lines, 1):
        if progress is not None and no % 200_000 == 0:
            progress(no, len(lines))
        last = no == len(lines)
        if line.lstrip().startswith(_MT_START):
            line_rank, c = _megatrace_line(path, no, line, last)
            ranks_seen.add(line_rank)
            calls.append(c)
            continue
        if "NCCL INFO" not in line:
            continue
        init = _INIT.search(line)
        if init:
            comm_ids[init.group(1)] = init.group(4)
            continue
        nc = _nccl_line(path, no, line, last)
        if nc is not None:
            calls.append(nc)
    if len(ranks_seen) > 1:
        raise TraceError(path, 0, f"lines of several ranks {sorted(ranks_seen)[:8]} in one "
                         "file: split it per rank")
    found = next(iter(ranks_seen)) if ranks_seen else rank if rank is not None \
        else rank_from_name(path)
    if found is None:
        raise TraceError(path, 0, "no rank: pass --rank or name the file rank<N>…")
    r: int = found
    out = Collected()
    by_comm: dict[str, list[int]] = {}
    for i, c in enumerate(calls):
        by_comm.setdefault(c[0], []).append(i)
    for ptr, idx in by_comm.items():
        comm = comm_ids.get(ptr, ptr)
        if comm.startswith(LOCAL):
            comm = f"{LOCAL}{r}:{ptr.rsplit(':', 1)[-1]}"
        idx.sort(key=lambda i: calls[i][1])
        opc = [calls[i][5] for i in idx]
        rising = all(b > a for a, b in pairwise(opc)) and opc[0] >= 0
        if ptr in comm_ids or ptr.startswith("g"):  # job-wide: commId or groupHash
            out.members.setdefault(comm, set()).add(r)
        elif comm.startswith(LOCAL) and not rising:
            comm += BY_CALLS
        for n, i in enumerate(idx):
            _, t, op, nbytes, peer, count = calls[i]
            t_end = calls[idx[n + 1]][1] if n + 1 < len(idx) else 0
            out.add("ops", rank=r, comm_id=comm, op_seq=count if rising else n, op=op,
                    bytes=nbytes, peer=peer, stream=0, t_enqueue=t, t_start=t,
                    t_end=max(t_end, t) if t_end else 0, step=-1)
    return out


def link_channels(c: Collected,
                  allowed: Callable[[int, int], bool] | None = None) -> dict[str, str]:
    """Rename per-rank stream channels (old MegaTrace lines) to job-wide comm_ids where the
    ranks' calls show they are one communicator (module docstring); returns old -> new."""
    ops = c.cols.get("ops")
    if not ops:
        return {}
    comm = np.asarray(ops["comm_id"], dtype=object)
    local = np.flatnonzero([str(x).startswith(LOCAL) for x in comm])
    if not local.size:
        return {}
    rank = np.asarray(ops["rank"], dtype=np.int64)[local]
    seq = np.asarray(ops["op_seq"], dtype=np.int64)[local]
    t = np.asarray(ops["t_start"], dtype=np.int64)[local]
    names = np.asarray(ops["op"], dtype=object)[local]
    size = np.asarray(ops["bytes"], dtype=np.int64)[local]
    chans: dict[str, np.ndarray] = {}
    for ch in np.unique(comm[local]):
        rows = np.flatnonzero(comm[local] == ch)
        if not np.isin(names[rows], ("Send", "Recv")).any() and not ch.endswith(BY_CALLS):
            chans[str(ch)] = rows[np.argsort(seq[rows], kind="stable")]
    keys = sorted(chans)
    parent = {k: k for k in keys}

    def root(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for i, a in enumerate(keys):
        ra, ia = int(rank[chans[a][0]]), chans[a]
        for b in keys[i + 1:]:
            rb, ib = int(rank[chans[b][0]]), chans[b]
            if ra == rb or (allowed is not None and not allowed(ra, rb)):
                continue
            _, xa, xb = np.intersect1d(seq[ia], seq[ib], assume_unique=True,
                                       return_indices=True)
            if xa.size < min(LINK_MIN_COMMON, ia.size, ib.size) or xa.size == 0:
                continue
            pa, pb = ia[xa], ib[xb]
            agree = (names[pa] == names[pb]) & (size[pa] == size[pb])
            if agree.mean() < 0.95:
                continue
            if np.median(np.abs(t[pa] - t[pb])) <= LINK_MAX_SKEW_NS:
                parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(root(k), []).append(k)
    rename: dict[str, str] = {}
    for members in groups.values():
        rs = sorted(int(rank[chans[k][0]]) for k in members)
        if len(members) < 2 or len(set(rs)) != len(rs):
            continue
        name = f"mt:{rs[0]}-{rs[-1]}x{len(rs)}"
        while name in c.members:
            name += "'"
        c.members[name] = set(rs)
        for k in members:
            rename[k] = name
    if rename:
        ops["comm_id"] = [rename.get(str(x), x) for x in ops["comm_id"]]
    return rename
