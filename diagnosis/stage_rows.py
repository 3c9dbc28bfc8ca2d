"""The stage records of the jobs a worker owns, kept in memory as they are stored.

A pending slowdown trigger is tried each time new stage records of its job are stored, several
times a second (diagnosis/analyst.py), and every try, sweep and re-check read the job's stage
records over the analyst's 90 s window: one query each (about a fifth of a try's cost on an idle
machine). The rows such a read returns are already in hand: the owner of a job stores all of its
stage records itself (they are keyed by job, streams/ownership.py) and the raw sink hands every
stored batch to its listeners (`DiagnosisAgents.on_stored`). So the first read of a job queries
ClickHouse once for every stage record stored from the read's start on (`begin`, then
`anchor`), each batch stored from just before that query on is added (`add`), and later reads
are cut from memory (`read`): the rows with `t_start` in the read's range, as the query would
have returned them.

A row may reach the copy twice — stored just before the anchoring query ran, and handed to the
listener just after — so a row added whose (rank, step, t_start) is already held is dropped
(`_merge`); the rows are kept sorted by (t_start, rank), the order of the table's primary key.
The copy is dropped, and the next read queries ClickHouse again, when:

- another worker reports stage records of the job stored (a rebalance: the job's previous
  owner stored some after this worker took it over; `DiagnosisAgents.on_stored_ends`);
- the job is handed over to another worker (`drop`);
- a read starts before the copy's first moment (`since_ns`: rows older than
  `KEEP_BEFORE_S` before the newest read's start are let go);
- a batch lacks a column the reads return, or more than `MAX_PENDING` batches wait unread;
- it was not read for `IDLE_S` when another job's copy is anchored (a job that ended).

The arrays handed out are read-only views of the copy: a caller that changed them in place
would change every later read, so numpy refuses it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from diagnosis.columns import Columns
from ingest.units import SECOND

#: the columns a stage read returns (diagnosis.agents.WINDOW_COLUMNS) and their dtypes there
COLUMNS: dict[str, np.dtype[np.int64] | np.dtype[np.int32]] = {
    "rank": np.dtype(np.int32), "step": np.dtype(np.int64), "t_start": np.dtype(np.int64),
    "data_next_wait": np.dtype(np.int64), "model_fwd_loss": np.dtype(np.int64),
    "model_backward": np.dtype(np.int64), "callbacks": np.dtype(np.int64),
    "optim_step": np.dtype(np.int64), "step_other": np.dtype(np.int64),
    "sched_wait_ns": np.dtype(np.int64), "cpu_pressure_ns": np.dtype(np.int64)}
#: rows this much older than the newest read's start are let go (a hang trigger's read at the
#: job's event clock may start a little before a slowdown try's at the stored stage records)
KEEP_BEFORE_S = 30.0
#: batches added and not yet read before the copy is dropped
MAX_PENDING = 4096
#: a copy not read for this long is dropped as another job's is anchored (a job that ended:
#: no sweep or try reads it again), s
IDLE_S = 300.0


@dataclass
class _Copy:
    since_ns: int  # every stored row with t_start >= since_ns is here once anchored
    table: dict[str, np.ndarray] | None = None  # None: the anchoring query is under way
    pending: list[dict[str, np.ndarray]] = field(default_factory=list)
    read_at: float = field(default_factory=time.monotonic)  # its last read (or begin)


@dataclass
class StageRows:
    """Per job, its stage records stored from some moment on (module docstring). Thread-safe:
    batches are added on the event loop, reads come from the analyst's thread."""

    copies: dict[str, _Copy] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    clock: Callable[[], float] = time.monotonic
    #: reads served from memory, and the anchoring queries made
    hits: int = 0
    anchors: int = 0

    def read(self, job: str, start_ns: int, end_ns: int) -> Columns | None:
        """The job's stage rows with `start_ns <= t_start <= end_ns`, as the stages query
        returns them ({} when there are none), or None when the copy cannot say: the caller
        queries, between `begin` and `anchor`."""
        with self.lock:
            c = self.copies.get(job)
            if c is None or c.table is None or start_ns < c.since_ns:
                return None
            if c.pending:
                c.table = _merge(c.table, c.pending)
                c.pending = []
            c.read_at = self.clock()
            keep = start_ns - int(KEEP_BEFORE_S * SECOND)
            if keep > c.since_ns:  # let go of what no read will ask for
                cut = int(np.searchsorted(c.table["t_start"], keep, side="left"))
                if cut:
                    c.table = {k: v[cut:] for k, v in c.table.items()}
                c.since_ns = keep
            t = c.table["t_start"]
            lo = int(np.searchsorted(t, start_ns, side="left"))
            hi = int(np.searchsorted(t, end_ns, side="right"))
            self.hits += 1
            if hi <= lo:
                return {}
            return {k: v[lo:hi] for k, v in c.table.items()}

    def begin(self, job: str, since_ns: int) -> None:
        """A query for every stage row of `job` with `t_start >= since_ns` is about to run:
        batches stored from now on are kept for the copy it anchors. Copies not read for
        `IDLE_S` are dropped."""
        with self.lock:
            now = self.clock()
            for j in [j for j, c in self.copies.items() if now - c.read_at > IDLE_S]:
                del self.copies[j]
            self.copies[job] = _Copy(since_ns, read_at=now)

    def anchor(self, job: str, since_ns: int, table: Columns | None) -> None:
        """The query `begin` announced returned `table` (None or {}: no rows)."""
        with self.lock:
            c = self.copies.get(job)
            if c is None or c.table is not None or c.since_ns != since_ns:
                return  # dropped (or begun again) while the query ran
            try:
                base = _cast(table) if table else _empty()
            except KeyError:
                del self.copies[job]
                return
            order = np.lexsort((base["rank"], base["t_start"]))
            c.table = {k: _frozen(v[order]) for k, v in base.items()}
            self.anchors += 1

    def add(self, job: str, cols: Columns) -> None:
        """A batch of the job's stage records is stored (its columns as the raw sink has them).
        Quick: the batch is merged into the copy at the next read."""
        with self.lock:
            c = self.copies.get(job)
            if c is None:
                return
            try:
                rows = _cast(cols)
            except KeyError:  # a column the reads return is missing: the table has a default
                del self.copies[job]
                return
            if len(c.pending) >= MAX_PENDING:
                del self.copies[job]
                return
            c.pending.append(rows)

    def drop(self, job: str) -> None:
        with self.lock:
            self.copies.pop(job, None)


def _empty() -> dict[str, np.ndarray]:
    return {k: np.empty(0, dt) for k, dt in COLUMNS.items()}


def _cast(cols: Columns) -> dict[str, np.ndarray]:
    return {k: np.asarray(cols[k]).astype(dt, copy=True) for k, dt in COLUMNS.items()}


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _merge(table: dict[str, np.ndarray], pending: list[dict[str, np.ndarray]]
           ) -> dict[str, np.ndarray]:
    """`table` (sorted by (t_start, rank)) with the `pending` rows not already in it: only the
    tail of the table from the pending rows' earliest t_start on is sorted again."""
    new = {k: np.concatenate([p[k] for p in pending]) for k in COLUMNS}
    if not new["t_start"].size:
        return table
    cut = int(np.searchsorted(table["t_start"], int(new["t_start"].min()), side="left"))
    tail = {k: np.concatenate([table[k][cut:], new[k]]) for k in COLUMNS}
    n_old = table["t_start"].size - cut
    is_new = np.arange(tail["t_start"].size) >= n_old
    # rows held before come first among equal (t_start, rank, step): a later equal one is a
    # row the anchoring query returned already, or one added twice
    order = np.lexsort((is_new, tail["step"], tail["rank"], tail["t_start"]))
    key = [tail[k][order] for k in ("t_start", "rank", "step")]
    same = np.ones(order.size, dtype=bool)
    same[0] = False
    for k in key:
        same[1:] &= k[1:] == k[:-1]
    keep = order[~(same & is_new[order])]
    return {k: _frozen(np.concatenate([table[k][:cut], tail[k][keep]])) for k in COLUMNS}
