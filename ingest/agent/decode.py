"""Ring slots → record columns, per rank, vectorized (no per-record Python).

The tracer writes an op as two events, OP_START when it is issued and OP_END when it completes
(ingest/torch/events.py). `OpJoin` keeps one rank's unfinished starts as arrays and joins each
read's ends to them with a sorted search:

- a start whose end arrived becomes one `ops` row with its `t_end`;
- a start still open `inflight_ns` after it began is published once with ``t_end = 0`` (an op in
  flight: what hang diagnosis looks for) and kept; when it completes later a second row with the
  real `t_end` follows. Readers take, per (job, rank, comm_id, op_seq), the row with the largest
  `t_end` — the completed one supersedes the in-flight one;
- `close()` (the rank's process is gone) publishes what is still open with ``t_end = 0``.

Stages need no join: one STAGE event is one `stages` row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ingest.torch.events import OP_END, OP_NAMES, OP_START, STAGE

Cols = dict[str, np.ndarray]
_OPS = np.array(OP_NAMES, dtype=object)
_START_FIELDS = ("comm", "op_seq", "op", "bytes", "peer", "t_enqueue", "t_start", "step")
_STAGE_FIELDS = ("step", "t_start", "data_next_wait", "model_fwd_loss", "model_backward",
                 "callbacks", "optim_step", "step_other", "device_ns")


def _key(comm: np.ndarray, seq: np.ndarray) -> np.ndarray:
    return (comm.astype(np.int64) << 40) | seq.astype(np.int64)


@dataclass
class OpJoin:
    """One rank's open ops and the last op_seq seen per communicator index."""

    rank: int
    inflight_ns: int = 2_000_000_000
    open: np.ndarray = field(default_factory=lambda: np.empty((0, 8), np.int64))
    shown: np.ndarray = field(default_factory=lambda: np.empty(0, bool))
    last_seq: dict[int, int] = field(default_factory=dict)

    def feed(self, rows: np.ndarray, now_ns: int) -> np.ndarray:
        """Add a read's slots; returns op rows [n, 9] (the 8 start fields + t_end) to publish."""
        kind = rows[:, 0]
        starts = rows[kind == OP_START][:, 2:10]
        ends = rows[kind == OP_END][:, 2:5]
        if len(starts):
            comm, seq = starts[:, 0], starts[:, 1]
            order = np.lexsort((seq, comm))
            c, s = comm[order], seq[order]
            last = np.r_[c[1:] != c[:-1], True]
            for ci, si in zip(c[last].tolist(), s[last].tolist(), strict=True):
                self.last_seq[ci] = max(si, self.last_seq.get(ci, -1))
        pend = np.concatenate([self.open, starts])
        shown = np.concatenate([self.shown, np.zeros(len(starts), bool)])
        t_end = np.zeros(len(pend), np.int64)
        if len(ends) and len(pend):
            ek = _key(ends[:, 0], ends[:, 1])
            order = np.argsort(ek, kind="stable")
            ek_sorted = ek[order]
            pk = _key(pend[:, 0], pend[:, 1])
            pos = np.minimum(np.searchsorted(ek_sorted, pk), len(ek_sorted) - 1)
            hit = ek_sorted[pos] == pk
            t_end[hit] = ends[order[pos[hit]], 2]
        done = t_end > 0
        late = ~done & ~shown & (pend[:, 6] < now_ns - self.inflight_ns)
        out = np.concatenate([
            np.column_stack([pend[done], t_end[done]]),
            np.column_stack([pend[late], np.zeros(int(late.sum()), np.int64)]),
        ])
        keep = ~done
        self.open, self.shown = pend[keep], (shown | late)[keep]
        return out

    def close(self) -> np.ndarray:
        """Every op still open and not yet shown, as in-flight rows (the process ended)."""
        rows = self.open[~self.shown]
        self.shown[:] = True
        return np.column_stack([rows, np.zeros(len(rows), np.int64)])


def op_columns(rows: np.ndarray, rank: int, comm_ids: np.ndarray) -> Cols:
    """Op rows from `OpJoin` as `ops` record columns; `comm_ids[index]` names communicators."""
    comm = rows[:, 0]
    if len(comm) and int(comm.max()) >= len(comm_ids):
        raise ValueError(f"rank {rank}: communicator index {int(comm.max())} not in its sidecar")
    codes = rows[:, 2]
    if len(codes) and (codes.min() < 0 or codes.max() >= len(_OPS)):
        raise ValueError(f"rank {rank}: op code out of range")
    return {
        "rank": np.full(len(rows), rank, np.int64), "comm_id": comm_ids[comm],
        "op_seq": rows[:, 1], "op": _OPS[codes], "bytes": rows[:, 3], "peer": rows[:, 4],
        "t_enqueue": rows[:, 5], "t_start": rows[:, 6], "t_end": rows[:, 8],
        "step": rows[:, 7],
    }


def stage_columns(rows: np.ndarray, rank: int) -> Cols:
    """STAGE slots of one read as `stages` record columns."""
    st = rows[rows[:, 0] == STAGE][:, 2:11]
    cols: Cols = {name: st[:, i] for i, name in enumerate(_STAGE_FIELDS)}
    cols["rank"] = np.full(len(st), rank, np.int64)
    return cols


def n_rows(cols: Cols) -> int:
    return len(next(iter(cols.values()))) if cols else 0
