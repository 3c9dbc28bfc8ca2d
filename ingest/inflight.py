"""Which in-flight op rows a completion has superseded — one rule for every reader of `ops`.

A tracer may store one call twice: the host agent publishes a call still running after 2 s with
`t_end = 0` (so a hang is visible while it lasts) and the completed row when it ends
(ingest/agent/decode.py). The in-flight row stays in the table. Readers that pair rows by
(rank, comm_id, op_seq) see both only when both fall in what they read; this rule needs no
pairing: calls on one communicator complete in the order they were issued (they share one
stream), so an in-flight row whose op_seq is at most the highest op_seq its (rank, comm_id) has
completed is a call that has completed. Used by the progress feed (streams/progress.py), the
iteration frames (streams/derived.py) and root cause's window (diagnosis/agents.py).
"""

from __future__ import annotations

import numpy as np


def superseded(rank: np.ndarray, comm: np.ndarray, op_seq: np.ndarray,
               t_end: np.ndarray, now_ns: int | None = None) -> np.ndarray:
    """Bool mask of in-flight rows (`t_end == 0`) whose (rank, comm) completed an op_seq at
    least theirs; completions after `now_ns` (when given) do not count. `comm` is any code of
    comm_id (equal ids, equal codes): small non-negative integers are used as they are.

    Only the (rank, comm) keys of in-flight rows matter, and they are few: completions are
    matched to them by a binary search (no sort of the frame, no table over every key)."""
    t_end = np.asarray(t_end, dtype=np.int64)
    waiting: np.ndarray = t_end == 0
    if not waiting.any():
        return waiting
    rank = np.asarray(rank, dtype=np.int64)
    comm = np.asarray(comm)
    span = int(rank.max()) + 1
    if comm.dtype.kind not in "iu" or int(comm.min()) < 0 or int(comm.max()) * span >= 1 << 62:
        comm = np.unique(comm, return_inverse=True)[1].reshape(-1)
    key = comm.astype(np.int64) * span + rank
    seq = np.asarray(op_seq, dtype=np.int64)
    wanted = np.unique(key[waiting])
    done = t_end > 0 if now_ns is None else (t_end > 0) & (t_end <= now_ns)
    kd, sd = key[done], seq[done]
    at = np.minimum(np.searchsorted(wanted, kd), len(wanted) - 1)
    hit = wanted[at] == kd
    best = np.full(len(wanted), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(best, at[hit], sd[hit])
    stale: np.ndarray = np.zeros(len(t_end), dtype=bool)
    stale[waiting] = seq[waiting] <= best[np.searchsorted(wanted, key[waiting])]
    return stale
