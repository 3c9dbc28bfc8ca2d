"""Process groups as communicators: ids, members, and the rank's sidecar file.

Every process group a rank uses becomes a communicator with a job-wide `comm_id`: ``"world"`` for
the default group, ``"pg<name>"`` for the others, where `<name>` is torch's group name — torch
requires every rank to create groups in the same order, so the names agree across ranks. The kind
(`tp`/`pp`/`dp`/`ep`/`cp`/`world`) comes from `set_kind` (e.g. ``ingest.torch.name_group(pg,
"tp")``), otherwise ``world`` for the default group and ``dp`` for the others.

Events carry the communicator's *index* in this rank's table (no strings in the ring). Each new
communicator rewrites the sidecar ``rank-<r>.json`` beside the ring (atomically; once per group,
never per event), which the agent reads to map indices to comm_ids and to build the job's topology
record: ``{job_id, rank, world_size, host, pid, parallel, comms: [{comm_id, kind, members}]}``.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

CommKind = str


class CommTable:
    """Maps process-group objects to (index, comm_id) and keeps the rank's sidecar current."""

    def __init__(self, sidecar: Path, job_id: str, rank: int, world_size: int) -> None:
        self.sidecar = sidecar
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.comms: list[dict[str, Any]] = []
        self.seq: list[int] = []  # next op_seq per communicator index
        self._by_group: dict[int, int] = {}
        self._kinds: dict[int, str] = {}
        self._keep: list[object] = []  # groups stay alive while indexed by id()
        self.parallel = _parallel_from_env()
        self.hosts: list[str] = []  # every rank's host, once rank 0 has gathered them

    def set_kind(self, group: object, kind: CommKind) -> None:
        self._kinds[id(group)] = kind
        idx = self._by_group.get(id(group))
        if idx is not None:
            self.comms[idx]["kind"] = kind
            self.write()

    def index(self, group: object, comm_id: str, members: list[int]) -> int:
        """The index of `group`, registering it on first sight."""
        idx = self._by_group.get(id(group))
        if idx is not None:
            return idx
        default = "world" if comm_id == "world" else "dp"
        kind = self._kinds.get(id(group), default)
        idx = len(self.comms)
        self.comms.append({"comm_id": comm_id, "kind": kind, "members": members})
        self.seq.append(0)
        self._by_group[id(group)] = idx
        self._keep.append(group)
        self.write()
        return idx

    def forget(self) -> None:
        """Drop the references to process groups (their ids may be reused afterwards)."""
        self._by_group.clear()
        self._kinds.clear()
        self._keep.clear()

    def write(self) -> None:
        doc = {"job_id": self.job_id, "rank": self.rank, "world_size": self.world_size,
               "host": host_name(), "pid": os.getpid(), "parallel": self.parallel,
               "comms": self.comms, "hosts": self.hosts}
        tmp = self.sidecar.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.sidecar)


def host_name() -> str:
    """The host a rank reports: ``RANKWATCH_NODE_NAME`` when set (the node's name where a rank's
    container has a hostname of its own, e.g. a Kubernetes pod given the node name through the
    downward API), else the machine's host name. Diagnoses name culprit hosts by it, and the
    PP-link rule compares only hops between different hosts."""
    return os.environ.get("RANKWATCH_NODE_NAME", "").strip() or socket.gethostname()


class HostGather:
    """Every rank's host name for the topology record, through the job's c10d store.

    Each rank sets ``rankwatch/host/<rank>`` when tracing attaches (one store write). Rank 0
    looks, without waiting (``Store.check``), at a few early step boundaries whether all are
    there; once they are it reads them into its sidecar and stops looking. No collective, no
    blocking: if the store cannot do it the hosts stay "unknown" beyond the local ones.
    """

    POLL_STEPS = frozenset({1, 3, 10, 30, 100, 300})

    def __init__(self, store: Any, table: CommTable) -> None:
        self.store, self.table = store, table
        self.keys = [f"rankwatch/host/{r}" for r in range(table.world_size)]
        store.set(self.keys[table.rank], host_name())

    def poll(self) -> bool:
        """True when done (gathered, or given up)."""
        try:
            if not self.store.check(self.keys):
                return False
            self.table.hosts = [self.store.get(k).decode() for k in self.keys]
            self.table.write()
        except Exception:  # a store without check/get: keep what we have
            pass
        return True


def _parallel_from_env() -> dict[str, int]:
    """Parallel sizes the launcher may declare: RANKWATCH_TP/PP/DP/EP/CP, RANKWATCH_MICROBATCHES."""
    out: dict[str, int] = {}
    for key in ("tp", "pp", "dp", "ep", "cp", "microbatches"):
        raw = os.environ.get(f"RANKWATCH_{key.upper()}")
        if raw is None:
            continue
        if not raw.isdigit() or int(raw) < 1:
            print(f"rankwatch: ignoring RANKWATCH_{key.upper()}={raw!r} (expected an integer "
                  ">= 1)", flush=True)
            continue
        out[key] = int(raw)
    return out
