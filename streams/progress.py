"""The progress feed: per job and short window, per rank and communicator, how far it got.

One window `[ws, we)` of one job (default 1 s) costs three queries in ClickHouse and one
vectorized merge here, whatever the number of ranks:

- A. ops that started up to `hang_horizon` (1 h) before the window end and are still running
  at `ws` or ended in the window (t_end = 0 or ≥ ws), grouped by (rank, comm_id): the calls
  that completed inside the window (count, bytes, first and last end, highest op_seq) and the
  newest start among calls started from `ws − op_lookback` on. A call that ended before `ws`
  was counted by the window holding its end, so the carried state already has its op_seq: the
  t_end minmax index lets ClickHouse skip the granules of finished calls, so an hour of
  history costs what a few seconds did. A call longer than `op_lookback` counts as completed
  in the window where it ends, like any other (one scan: cheaper than a recent and an old
  query, docs/performance.md);
- R. the rows of calls running at `we` (t_end = 0 or ≥ we, started in the horizon), one row
  each: a call is in flight unless its op_seq is at most the highest op_seq its (rank,
  comm_id) completed by `we` (`ProgressState._running`). The host agent stores a call that
  runs over 2 s twice — in flight, then completed — and the in-flight row stays in the
  horizon: counted by row, a stall that recovered left its calls "in flight" for an hour;
- C. beats in the window: newest heartbeat per (rank, comm_id).

`ProgressState` (pure numpy) carries what outlives a window — last completed op_seq, last beat,
last record time — for every (rank, comm_id) ever seen in the job, so a rank that stopped still
gets a row every window (that is what a hang trigger needs). Per job it is a handful of int64
arrays of (ranks × communicators) entries: bounded by the job's shape, not by its run length.
It is rebuilt from the `progress` table — the rows of the latest window ending at or before
the one to compute — whenever that window does not follow the last one folded in (a restart, a
rebalance, a job's windows moved back): each window's rows follow from the stored rows alone.

Definitions (ingest.records.Progress): `last_op_seq` counts completed calls only (a beat's
last_op_seq is the last call *started*, so it is not mixed in); `bytes_per_s` is the bytes of the
calls completed in the window over the window length; `op_interval_ns` is (last end − first end) /
(completed − 1); `inflight_ops` counts calls started and not completed by `we`, each once.
Calls on one communicator complete in the order they were issued (they share a stream): that
is what lets a later completion supersede an in-flight row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ingest.units import SECOND as _NS
from streams.db import Database

_NONE = np.iinfo(np.int64).min
#: The largest whole part a rate may have so that rate * 10^9 fits int64.
_MAX_WHOLE = (np.iinfo(np.int64).max - _NS) // _NS


def per_second(total: np.ndarray, width_ns: int) -> np.ndarray:
    """floor(total * 10^9 / width_ns), exactly, in int64 without overflow: `total * 10^9`
    overflows past 9.2 GB in a window (one 400 Gb/s link fills that in 0.2 s). The remainder
    is scaled in two steps (10^4, then 10^5) so no intermediate exceeds int64 for windows up to
    ~10 days; rates beyond 9.2e18/s (impossible) are clipped."""
    if not 0 < width_ns <= 900_000 * _NS:
        raise ValueError(f"window width {width_ns} ns: expected 1 ns .. 10 days")
    whole, rest = np.divmod(np.asarray(total, np.int64), width_ns)
    q1, r1 = np.divmod(rest * 10_000, width_ns)
    out: np.ndarray = (np.minimum(whole, _MAX_WHOLE) * _NS + q1 * 100_000
                       + (r1 * 100_000) // width_ns)
    return out


@dataclass(frozen=True)
class ProgressParams:
    window_ns: int = _NS
    op_lookback_ns: int = 5 * _NS
    hang_horizon_ns: int = 3600 * _NS


OPS_SQL = """
WITH fromUnixTimestamp64Nano({ws:Int64}, 'UTC') AS ws_t,
     fromUnixTimestamp64Nano({we:Int64}, 'UTC') AS we_t,
     fromUnixTimestamp64Nano({lo:Int64}, 'UTC') AS lo_t,
     toUnixTimestamp64Nano(t_end) AS e
SELECT rank, toString(comm_id) AS comm,
       countIf(t_end >= ws_t AND t_end < we_t) AS completed,
       maxIf(op_seq, t_end >= ws_t AND t_end < we_t) AS seq_done,
       toInt64(least(sumIf(toInt128(bytes), t_end >= ws_t AND t_end < we_t),
                     9223372036854775807)) AS done_bytes,
       minIf(e, t_end >= ws_t AND t_end < we_t) AS first_end,
       maxIf(e, t_end >= ws_t AND t_end < we_t) AS last_end,
       maxIf(toUnixTimestamp64Nano(t_start), t_start >= lo_t) AS last_ts
FROM ops
WHERE job_id = {job:String}
  AND t_start >= fromUnixTimestamp64Nano({far:Int64}, 'UTC') AND t_start < we_t
  AND (t_end = fromUnixTimestamp64Nano(0, 'UTC') OR t_end >= ws_t)
GROUP BY rank, comm
"""

RUNNING_SQL = """
WITH fromUnixTimestamp64Nano({we:Int64}, 'UTC') AS we_t
SELECT rank, toString(comm_id) AS comm, op_seq, toUnixTimestamp64Nano(t_start) AS t0
FROM ops
WHERE job_id = {job:String}
  AND (t_end = fromUnixTimestamp64Nano(0, 'UTC') OR t_end >= we_t)
  AND t_start >= fromUnixTimestamp64Nano({far:Int64}, 'UTC') AND t_start < we_t
"""

BEATS_SQL = """
SELECT rank, toString(comm_id) AS comm, max(toUnixTimestamp64Nano(ts)) AS beat
FROM beats
WHERE job_id = {job:String} AND ts >= fromUnixTimestamp64Nano({ws:Int64}, 'UTC')
  AND ts < fromUnixTimestamp64Nano({we:Int64}, 'UTC')
GROUP BY rank, comm
"""

LAST_SQL = """
SELECT rank, toString(comm_id) AS comm, last_op_seq, toUnixTimestamp64Nano(last_beat_ts) AS beat,
       toUnixTimestamp64Nano(last_record_ts) AS last_ts
FROM progress FINAL
WHERE job_id = {job:String}
  AND window_end = (SELECT max(window_end) FROM progress WHERE job_id = {job:String}
                    AND window_end <= fromUnixTimestamp64Nano({ws:Int64}, 'UTC'))
"""


@dataclass
class ProgressState:
    """Carried per (rank, comm_id) of one job; keys are `comm code << 32 | rank`, sorted."""

    comms: dict[str, int] = field(default_factory=dict)
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_op_seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_beat_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_record_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: the end of the last window folded in (None: none yet)
    we: int | None = None

    def encode(self, rank: np.ndarray, comm: np.ndarray) -> np.ndarray:
        names, inverse = np.unique(comm.astype(str), return_inverse=True)
        codes = np.array([self.comms.setdefault(str(n), len(self.comms)) for n in names],
                         dtype=np.int64)
        return (codes[inverse] << 32) | rank.astype(np.int64) if len(rank) else \
            np.zeros(0, np.int64)

    def _grow(self, *key_sets: np.ndarray) -> None:
        keys = np.unique(np.concatenate([self.keys, *key_sets]))
        if len(keys) == len(self.keys):
            return
        at = np.searchsorted(keys, self.keys)
        for name, fill in (("last_op_seq", -1), ("last_beat_ts", 0), ("last_record_ts", 0)):
            new = np.full(len(keys), fill, np.int64)
            new[at] = getattr(self, name)
            setattr(self, name, new)
        self.keys = keys

    def decode(self) -> tuple[np.ndarray, np.ndarray]:
        names = np.empty(len(self.comms), dtype=object)
        for n, c in self.comms.items():
            names[c] = n
        return (self.keys & 0xFFFFFFFF).astype(np.int32), names[self.keys >> 32]

    def window(self, ws: int, we: int, ops: dict[str, np.ndarray], beats: dict[str, np.ndarray],
               running: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Fold one window's aggregates in and return its rows (every key ever seen)."""
        ka = self.encode(ops["rank"], ops["comm"])
        kc = self.encode(beats["rank"], beats["comm"])
        running = {**running, "key": self.encode(running["rank"], running["comm"])}
        self._grow(ka, kc, running["key"])
        n = len(self.keys)
        ia, ic = (np.searchsorted(self.keys, k) for k in (ka, kc))
        done = ops["completed"] > 0
        np.maximum.at(self.last_op_seq, ia[done], ops["seq_done"][done].astype(np.int64))
        np.maximum.at(self.last_beat_ts, ic, beats["beat"].astype(np.int64))
        np.maximum.at(self.last_record_ts, ia, ops["last_ts"].astype(np.int64))
        np.maximum.at(self.last_record_ts, ic, beats["beat"].astype(np.int64))
        completed = np.zeros(n, np.int64)
        done_bytes = np.zeros(n, np.int64)
        first_end = np.full(n, np.iinfo(np.int64).max, np.int64)
        last_end = np.zeros(n, np.int64)
        completed[ia[done]] = ops["completed"][done]
        done_bytes[ia[done]] = ops["done_bytes"][done]
        first_end[ia[done]] = ops["first_end"][done]
        last_end[ia[done]] = ops["last_end"][done]
        interval = np.full(n, -1, np.int64)
        many = completed > 1
        interval[many] = (last_end[many] - first_end[many]) // (completed[many] - 1)
        inflight, oldest = self._running(running, n)
        rank, comm = self.decode()
        width = max(we - ws, 1)
        self.we = we
        return {
            "window_end": np.full(n, we, np.int64), "rank": rank, "comm_id": comm,
            "last_op_seq": self.last_op_seq.copy(), "completed_ops": completed,
            "bytes_per_s": per_second(done_bytes, width), "op_interval_ns": interval,
            "inflight_ops": inflight,
            "oldest_inflight_age_ns": np.where(inflight > 0, np.maximum(we - oldest, 0), 0),
            "last_beat_ts": self.last_beat_ts.copy(), "last_record_ts": self.last_record_ts.copy(),
        }

    def _running(self, running: dict[str, np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
        """Calls in flight at the window end per key, and the oldest one's start, from the rows
        of query R (call the window's completions folded into `last_op_seq` first). A row is a
        call still running unless its op_seq is at most the highest op_seq completed
        (`ingest.inflight`: calls on one communicator complete in order) — the in-flight row
        the host agent stores for a call running over 2 s is then superseded. A call stored
        both in flight and completed after the window end counts once."""
        oldest = np.full(n, np.iinfo(np.int64).max, np.int64)
        if not len(running["key"]):
            return np.zeros(n, np.int64), oldest
        i = np.searchsorted(self.keys, running["key"])
        seq = running["op_seq"].astype(np.int64)
        live = seq > self.last_op_seq[i]
        i, seq = i[live], seq[live]
        np.minimum.at(oldest, i, running["t0"][live].astype(np.int64))
        order = np.lexsort((seq, i))
        i, seq = i[order], seq[order]
        first = np.ones(len(i), dtype=bool)
        first[1:] = (i[1:] != i[:-1]) | (seq[1:] != seq[:-1])
        return np.bincount(i[first], minlength=n).astype(np.int64), oldest

    def restore(self, last: dict[str, np.ndarray]) -> None:
        """Start from the rows of the last stored window."""
        k = self.encode(last["rank"], last["comm"])
        self._grow(k)
        i = np.searchsorted(self.keys, k)
        self.last_op_seq[i] = last["last_op_seq"]
        self.last_beat_ts[i] = last["beat"]
        self.last_record_ts[i] = last["last_ts"]


class ProgressFeed:
    """Computes progress windows of many jobs against one `Database`."""

    def __init__(self, db: Database, params: ProgressParams | None = None) -> None:
        self.db, self.p = db, params or ProgressParams()
        self.states: dict[str, ProgressState] = {}

    async def _state(self, job: str, ws: int) -> ProgressState:
        """The state to fold window `ws` into: the one held when it follows the last window
        folded, else the rows stored for the latest window ending at or before `ws` (a job new
        to this worker, a restart, a window closed again after a rebalance restored an older
        checkpoint, or a job's windows moved back before its first stored one). A state carried
        past `ws` would put later completions into an earlier window — a `last_op_seq` that
        falls from one window to the next — and one behind it (windows another worker closed
        meanwhile) earlier values into a later one: each window is a function of the stored
        rows, whatever this worker computed before."""
        st = self.states.get(job)
        if st is None or st.we != ws:
            st = self.states[job] = ProgressState()
            last = await self.db.aquery_columns(LAST_SQL, {"job": job, "ws": ws})
            if len(last["rank"]):
                st.restore(last)
        return st

    async def compute(self, job: str, ws: int) -> dict[str, np.ndarray]:
        we = ws + self.p.window_ns
        lo = ws - self.p.op_lookback_ns
        st = await self._state(job, ws)
        far = we - self.p.hang_horizon_ns
        ops = await self.db.aquery_columns(
            OPS_SQL, {"job": job, "ws": ws, "we": we, "lo": lo, "far": far})
        beats = await self.db.aquery_columns(BEATS_SQL, {"job": job, "ws": ws, "we": we})
        running = await self.db.aquery_columns(RUNNING_SQL, {"job": job, "we": we, "far": far})
        return st.window(ws, we, ops, beats, running)

    def forget(self, job: str) -> None:
        self.states.pop(job, None)
