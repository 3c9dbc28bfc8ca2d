"""Native ring records → record-contract columns, per ring, vectorized (no per-record Python).

A drained block is split by kind (`ingest.ring.split_kinds`); each kind becomes the columns of its
contract kind. Names (communicators, kernels, NICs) arrive once per producer as name records and
are kept per ring (`Names`); a hash whose name never arrived is shown as ``0x<hash>``.

Ops are written twice by every producer — a start record (``t_end = 0``) and an end record
(``RW_F_END``). `OpJoin` keeps one ring's open starts and joins ends to them on
(comm_hash, op_seq):

- an end becomes one `ops` row: the start's fields, overridden by the end's non-zero ones (the
  NCCL plugin knows t_start only at the end), with the end's `t_end`;
- a start still open `inflight_ns` after it began is published once with ``t_end = 0`` (an op in
  flight: what hang diagnosis looks for; its t_start is the enqueue time when the start has
  none) and kept; when it completes later a second row with the real `t_end` follows. The
  completed row supersedes the in-flight one (ingest/inflight.py: readers drop an in-flight row
  once its communicator completed that op_seq or a later one);
- `close()` (the producer is gone) publishes what is still open with ``t_end = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingest import ring
from ingest.torch.events import STAGES
from ingest.units import SECOND

Cols = dict[str, np.ndarray]
_FUNCS = np.array(ring.FUNCS, dtype=object)
#: op fields kept for open starts (int64 views of the record fields)
OP_KEEP = ("comm_hash", "op_seq", "bytes", "t_enqueue", "t_start", "t_end", "stream", "step",
           "peer", "func")
#: column positions in an `op_table` row
COMM_HASH, OP_SEQ, T_ENQUEUE, T_START, T_END, FUNC = (
    OP_KEEP.index(f) for f in ("comm_hash", "op_seq", "t_enqueue", "t_start", "t_end", "func"))
#: the columns an end is joined to its start on
JOIN_KEY = [COMM_HASH, OP_SEQ]


def _i64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.int64) if a.dtype != np.uint64 else a.view(np.int64)


def op_table(recs: Any) -> np.ndarray:
    """Op records as an int64 matrix [n, len(OP_KEEP)]."""
    return np.column_stack([_i64(np.asarray(recs[f])) for f in OP_KEEP]) if len(recs) else (
        np.empty((0, len(OP_KEEP)), np.int64))


class Names:
    """hash → text for one producer (names arrive once, possibly across drains)."""

    def __init__(self) -> None:
        self.known: dict[int, str] = {}

    def update(self, name_records: Any) -> None:
        if len(name_records):
            self.known.update(ring.decode_names(name_records))

    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """Text per hash (object array), one dict lookup per distinct hash."""
        uniq, inv = np.unique(hashes.view(np.uint64), return_inverse=True)
        text = np.array([self.known.get(int(h)) or f"0x{int(h):x}" for h in uniq], dtype=object)
        return text[inv.reshape(-1)] if len(hashes) else np.empty(0, object)


@dataclass
class OpJoin:
    """One ring's open op starts; `last_seq` is the last op_seq seen per comm_hash."""

    inflight_ns: int = 2 * SECOND
    open: np.ndarray = field(default_factory=lambda: np.empty((0, len(OP_KEEP)), np.int64))
    shown: np.ndarray = field(default_factory=lambda: np.empty(0, bool))
    last_seq: dict[int, int] = field(default_factory=dict)

    def feed(self, ops: Any, now_ns: int) -> np.ndarray:
        """Add a drain's op records; returns rows (OP_KEEP columns) to publish."""
        table = op_table(ops)
        is_end = (np.asarray(ops["flags"]) & ring.F_END) != 0 if len(ops) else np.zeros(0, bool)
        starts, ends = table[~is_end], table[is_end]
        if len(starts):
            order = np.lexsort((starts[:, OP_SEQ], starts[:, COMM_HASH]))
            c, s = starts[order, COMM_HASH], starts[order, OP_SEQ]
            last = np.r_[c[1:] != c[:-1], True]
            for ci, si in zip(c[last].tolist(), s[last].tolist(), strict=True):
                self.last_seq[ci] = max(si, self.last_seq.get(ci, -1))
        pend = np.concatenate([self.open, starts])
        shown = np.concatenate([self.shown, np.zeros(len(starts), bool)])
        matched = np.zeros(len(pend), bool)
        done_rows = ends.copy()
        if len(ends) and len(pend):
            matched, e_idx = _join(pend, ends)
            # an end keeps its positive fields (the NCCL plugin's t_start) and takes the rest
            # from its start (the Python tracer's ends carry only comm, op_seq and t_end)
            fill = done_rows[e_idx]
            done_rows[e_idx] = np.where(fill > 0, fill, pend[matched])
            done_rows[e_idx, T_END] = ends[e_idx, T_END]
        # an op's age runs from its enqueue (the NCCL plugin's start records have t_start 0:
        # the kernel has not started yet); the Python tracer's starts carry both
        issued = np.where(pend[:, T_ENQUEUE] > 0, pend[:, T_ENQUEUE], pend[:, T_START])
        late = ~matched & ~shown & (issued < now_ns - self.inflight_ns)
        late_rows = _in_flight(pend[late])
        self.open, self.shown = pend[~matched], (shown | late)[~matched]
        return np.concatenate([done_rows, late_rows])

    def close(self) -> np.ndarray:
        """Every op still open and not yet shown, as in-flight rows (the producer ended)."""
        rows = _in_flight(self.open[~self.shown])
        self.shown[:] = True
        return rows


#: an odd 64-bit multiplier (2^64 / golden ratio): spreads a communicator hash over the key
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _mixed(rows: np.ndarray) -> np.ndarray:
    """One uint64 per row of (comm_hash, op_seq): hash × `_MIX` xor seq, wrapping. For one
    communicator distinct seqs give distinct keys; across communicators two pairs may share a
    key, which `_join` checks for."""
    with np.errstate(over="ignore"):
        return (rows[:, COMM_HASH].view(np.uint64) * _MIX) ^ rows[:, OP_SEQ].view(np.uint64)


def _join(pend: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(matched, e_idx): which `pend` rows have an end of the same (comm_hash, op_seq), and,
    for those, the first such end (its index in `ends`). One sort of a 1-D key (`_mixed`),
    verified on both columns: where a shared key paired different ops, the exact join on
    the two columns (`np.unique(axis=0)`, several times the cost) decides instead."""
    kp, ke = _mixed(pend), _mixed(ends)
    order = np.argsort(ke, kind="stable")
    pos = np.minimum(np.searchsorted(ke[order], kp), len(ke) - 1)
    matched = ke[order][pos] == kp
    e_idx = order[pos[matched]]
    if np.array_equal(pend[matched][:, JOIN_KEY], ends[e_idx][:, JOIN_KEY]):
        return matched, e_idx
    _, ids = np.unique(np.concatenate([pend[:, JOIN_KEY], ends[:, JOIN_KEY]]), axis=0,
                       return_inverse=True)
    ids = ids.reshape(-1)
    pid, eid = ids[: len(pend)], ids[len(pend):]
    order = np.argsort(eid, kind="stable")
    pos = np.minimum(np.searchsorted(eid[order], pid), len(eid) - 1)
    matched = eid[order][pos] == pid
    return matched, order[pos[matched]]


def _in_flight(starts: np.ndarray) -> np.ndarray:
    """Open starts as in-flight rows: t_end 0, and t_start the enqueue time where the start
    has none (the NCCL plugin's: its kernel has not started, or the plugin does not know).
    Readers select ops by t_start (the raw tables are ordered by it): a row at t_start 0 —
    1970 — was in no window, so a call hung in NCCL was invisible to the progress feed and to
    root cause. The completed row, when it comes, carries the real t_start."""
    rows: np.ndarray = starts.copy()
    rows[:, T_END] = 0
    rows[:, T_START] = np.where(rows[:, T_START] > 0, rows[:, T_START], rows[:, T_ENQUEUE])
    return rows


def op_columns(rows: np.ndarray, rank: int, names: Names) -> Cols:
    """Op rows from `OpJoin` as `ops` columns; rows of an unknown function ("other") are left
    out (the contract has no name for them)."""
    func = rows[:, FUNC]
    rows = rows[(func > 0) & (func < len(_FUNCS))]
    c = {f: rows[:, i] for i, f in enumerate(OP_KEEP)}
    return {
        "rank": np.full(len(rows), rank, np.int64), "comm_id": names.lookup(c["comm_hash"]),
        "op_seq": c["op_seq"], "op": _FUNCS[c["func"]], "bytes": c["bytes"],
        "peer": c["peer"], "stream": c["stream"], "t_enqueue": c["t_enqueue"],
        "t_start": c["t_start"], "t_end": np.maximum(c["t_end"], 0), "step": c["step"],
    }


def _cols(recs: Any, rank: int, fields: dict[str, str]) -> Cols:
    out: Cols = {"rank": np.full(len(recs), rank, np.int64)}
    for name, src in fields.items():
        out[name] = _i64(np.asarray(recs[src]))
    return out


def stage_columns(recs: Any, rank: int) -> Cols:
    return _cols(recs, rank, {f: f for f in (
        "step", "t_start", "data_next_wait", "model_fwd_loss", "model_backward", "callbacks",
        "optim_step", "step_other", "device_ns", "sched_wait_ns",
        "cpu_pressure_ns")})


def kernel_columns(recs: Any, rank: int, names: Names) -> Cols:
    out = _cols(recs, rank, {"stream": "stream", "t_start": "t_start", "duration": "duration"})
    out["kernel"] = names.lookup(_i64(np.asarray(recs["name_hash"])))
    return out


def flow_columns(recs: Any, rank: int, names: Names) -> Cols:
    out = _cols(recs, rank, {"op_seq": "op_seq", "channel": "channel", "peer": "peer",
                             "bytes": "bytes", "t_start": "t_start", "t_end": "t_end"})
    out["comm_id"] = names.lookup(_i64(np.asarray(recs["comm_hash"])))
    return out


def chunk_columns(recs: Any, rank: int, names: Names) -> Cols:
    out = _cols(recs, rank, {"op_seq": "op_seq", "channel": "channel", "ts": "ts",
                             "total_chunks": "total_chunks", "gpu_ready": "gpu_ready",
                             "rdma_transmitted": "rdma_transmitted", "rdma_done": "rdma_done"})
    out["comm_id"] = names.lookup(_i64(np.asarray(recs["comm_hash"])))
    return out


def wr_columns(recs: Any, rank: int, names: Names) -> Cols:
    out = _cols(recs, rank, {"ts": "ts", "inflight": "inflight", "bytes_done": "bytes_done"})
    out["nic"] = names.lookup(_i64(np.asarray(recs["nic_hash"])))
    return out


def beat_columns(recs: Any, rank: int, names: Names) -> Cols:
    """The NCCL plugin's beats: it knows no stage position (step -1, stage "", stage_ts 0)."""
    out = _cols(recs, rank, {"ts": "ts", "last_op_seq": "last_op_seq", "dropped": "dropped"})
    out["comm_id"] = names.lookup(_i64(np.asarray(recs["comm_hash"])))
    n = len(recs)
    out["step"] = np.full(n, -1, np.int64)
    out["stage"] = np.full(n, "", object)
    out["stage_ts"] = np.zeros(n, np.int64)
    out["sched_run_ns"] = np.full(n, -1, np.int64)
    out["sched_wait_ns"] = np.full(n, -1, np.int64)
    out["exited"] = np.zeros(n, np.int64)
    out["exit_status"] = np.full(n, -1, np.int64)
    return out


def schedstat(pid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable waiting for one) of `pid`'s main thread from
    /proc/<pid>/schedstat; (-1, -1) when unreadable (another pid namespace, gone, no
    CONFIG_SCHEDSTATS) or malformed."""
    try:
        with open(f"/proc/{int(pid)}/schedstat", "rb") as f:
            parts = f.read(128).split()
        run, wait = int(parts[0]), int(parts[1])
    except (OSError, ValueError, IndexError):
        return -1, -1
    return (run, wait) if run >= 0 and wait >= 0 else (-1, -1)


#: ring position stage (ingest.ring.RingStat.position: 0 between stages, i = STAGES[i - 1])
POSITION_STAGES: tuple[str, ...] = ("", *STAGES)


def position(step: int, stage: int, ts: int) -> tuple[int, str, int]:
    """A ring's position (`ingest.ring.RingStat.position`) as the beat's (step, stage,
    stage_ts), clamped to what the contract accepts: a damaged header never fails a batch."""
    return (step if step >= -1 else -1,
            POSITION_STAGES[stage] if 0 <= stage < len(POSITION_STAGES) else "",
            ts if ts > 0 else 0)


def n_rows(cols: Cols) -> int:
    return len(next(iter(cols.values()))) if cols else 0
