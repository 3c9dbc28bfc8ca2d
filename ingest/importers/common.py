"""What every importer shares: the error type, collected columns, all-or-nothing publishing.

An importer parses whole files into `Collected` (lists of plain values per column and kind) and
raises `TraceError` naming the file and the line (or entry) on the first problem. Only when every
file parsed are the columns encoded — with validation, so a value the contract rejects is also
caught before anything is sent — and only then published. A bad file therefore leaves nothing
behind.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ingest.batch import BatchError, encode_batch

OP_BY_COLLECTIVE = {
    "allreduce": "AllReduce", "all_reduce": "AllReduce", "allgather": "AllGather",
    "all_gather": "AllGather", "_allgather_base": "AllGather",
    "all_gather_into_tensor": "AllGather", "allgather_into_tensor_coalesced": "AllGather",
    "reducescatter": "ReduceScatter", "reduce_scatter": "ReduceScatter",
    "_reduce_scatter_base": "ReduceScatter", "reduce_scatter_tensor": "ReduceScatter",
    "reduce_scatter_tensor_coalesced": "ReduceScatter", "broadcast": "Broadcast",
    "reduce": "Reduce", "all_to_all": "AllToAll", "alltoall": "AllToAll",
    "alltoall_base": "AllToAll", "all_to_all_single": "AllToAll", "send": "Send",
    "recv": "Recv", "barrier": "Barrier", "sendrecv": "Send",
}
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
               "bfloat16": 2, "long": 8, "int64": 8, "int": 4, "int32": 4, "char": 1,
               "byte": 1, "int8": 1, "uint8": 1, "bool": 1, "short": 2, "int16": 2,
               "float8_e4m3fn": 1, "float8_e5m2": 1}
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
#: the tutorials' `trace_0`, `nccl_trace_3.json`: a number closing the name's stem
_TRAILING_NUMBER = re.compile(r"[_-](\d+)$")
_SUFFIXES = (".gz", ".json", ".pkl", ".pickle", ".log", ".txt", ".trace")


class TraceError(ValueError):
    """A file that cannot be imported: names the file, the line (0: whole file) and why."""

    def __init__(self, path: Path | str, line: int, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {reason}")


def collective_op(name: str) -> str | None:
    """The contract's op for a collective name ("nccl:all_reduce", "allreduce", …)."""
    key = name.rsplit(":", 1)[-1].strip().lower()
    return OP_BY_COLLECTIVE.get(key)


def rank_from_name(path: Path) -> int | None:
    """`rank3.log`, `rank_3`, `rank-3.pt.trace.json.gz`, else a number closing the name's stem
    (`trace_3`, `nccl_trace_3.json`); None when the name says nothing."""
    m = _RANK_IN_NAME.search(path.name)
    if m:
        return int(m.group(1))
    stem = path.name
    while stem.lower().endswith(_SUFFIXES):
        stem = stem[: stem.rfind(".")]
    m = _TRAILING_NUMBER.search(stem)
    return int(m.group(1)) if m else None


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip (by its magic, whatever its name)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(path, 0, f"cannot read: {e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise TraceError(path, 0, f"a gzip file that does not decompress (truncated?): "
                             f"{e}") from None
    return raw


def read_text(path: Path) -> str:
    """The file as UTF-8 text (gzip or plain)."""
    raw = read_bytes(path)
    try:
        return raw.decode()
    except UnicodeDecodeError as e:
        raise TraceError(path, 0, f"not UTF-8 text at byte {e.start}: is this the right "
                         "format?") from None


@dataclass
class Collected:
    """Rows per kind as column lists, appended by parsers (not a hot path), and what the files
    say about the job's communicators (for the topology, ingest/importers/topology.py)."""

    cols: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    #: comm_id -> member ranks, as the files list them (FR pg_config, Kineto pg ranks)
    members: dict[str, set[int]] = field(default_factory=dict)
    #: comm_id -> its name for people ("TENSOR_MODEL_PARALLEL_GROUP", "default_pg")
    descs: dict[str, str] = field(default_factory=dict)
    #: the job's world size where a file states it
    world: int = 0
    #: rank -> host, where a file names it
    hosts: dict[int, str] = field(default_factory=dict)

    def add(self, kind: str, **row: Any) -> None:
        """Append one row; every row of a kind must name the same columns."""
        table = self.cols.get(kind)
        if table is None:
            table = self.cols[kind] = {k: [] for k in row}
        if table.keys() != row.keys():
            raise ValueError(f"{kind}: row columns {sorted(row)} differ from {sorted(table)}")
        for k, v in row.items():
            table[k].append(v)

    def counts(self) -> dict[str, int]:
        return {k: len(next(iter(t.values()))) for k, t in self.cols.items() if t}

    def merge(self, other: Collected) -> None:
        for kind, table in other.cols.items():
            mine = self.cols.setdefault(kind, {k: [] for k in table})
            for k, v in table.items():
                mine[k].extend(v)
        for comm, ranks in other.members.items():
            self.members.setdefault(comm, set()).update(ranks)
        self.descs.update(other.descs)
        self.world = max(self.world, other.world)
        self.hosts.update(other.hosts)


class Publisher(Protocol):
    def publish(self, kind: str, data: bytes, key: bytes | str | None = None,
                topic: str | None = None, on_delivery: Callable[..., None] | None = None
                ) -> bool: ...

    def flush(self, timeout: float = 30.0) -> int: ...


def encode_all(collected: Collected, job: str, producer: str,
               max_rows: int = 65_536) -> list[tuple[str, bytes]]:
    """Every batch, encoded and validated; raises BatchError before anything is published."""
    out: list[tuple[str, bytes]] = []
    seq = 0
    for kind, table in collected.cols.items():
        n = len(next(iter(table.values()))) if table else 0
        for lo in range(0, n, max_rows):
            cols = {k: v[lo: lo + max_rows] for k, v in table.items()}
            out.append((kind, encode_batch(kind, job, cols, producer=producer, seq=seq)))
            seq += 1
    return out


def publish_all(batches: list[tuple[str, bytes]], job: str, pub: Publisher) -> int:
    """Publish encoded batches and wait; returns how many were not delivered."""
    for kind, data in batches:
        pub.publish(kind, data, key=job)  # the job's home partition (streams.ownership)
    return pub.flush(60)


__all__ = ["BatchError", "Collected", "TraceError", "encode_all", "publish_all"]
