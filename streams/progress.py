"""The progress feed: per job and short window, per rank and communicator, how far it got.

One window `[ws, we)` of one job (default 1 s) costs three GROUP BY queries in ClickHouse and one
vectorized merge here, whatever the number of ranks:

- A. ops with t_start in `[ws − op_lookback, we)` still running at `ws` (t_end = 0 or ≥ ws),
  grouped by (rank, comm_id): the highest op_seq completed in the window, the calls that
  completed inside the window (count, bytes, first and last end), the calls in flight at `we`
  (started, and t_end = 0 or ≥ we) and the oldest one's start. A call that ended before `ws` was
  counted by an earlier window (the one holding its end; its start is in that window's range or
  query B's), so the carried state already has its op_seq and start: the t_end minmax index lets
  ClickHouse skip the lookback's granules of finished calls (94 → 60 ms per window of a
  1,024-rank job at 500,000 ops/s, `rankwatch bench streams --in-process`);
- B. calls that started before that range (up to `hang_horizon` back) and are still in flight
  (t_end = 0) or ended inside the window — a call longer than `op_lookback` counts as completed
  in the window where it ends, like any other; a minmax index on t_end makes this cheap: only
  granules holding an in-flight op or an op ending in the window are read;
- C. beats in the window: newest heartbeat per (rank, comm_id).

`ProgressState` (pure numpy) carries what outlives a window — last completed op_seq, last beat,
last record time — for every (rank, comm_id) ever seen in the job, so a rank that stopped still
gets a row every window (that is what a hang trigger needs). Per job it is a handful of int64
arrays of (ranks × communicators) entries: bounded by the job's shape, not by its run length.
After a restart it is rebuilt from the last window stored in the `progress` table.

Definitions (ingest.records.Progress): `last_op_seq` counts completed calls only (a beat's
last_op_seq is the last call *started*, so it is not mixed in); `bytes_per_s` is the bytes of the
calls completed in the window over the window length; `op_interval_ns` is (last end − first end) /
(completed − 1). A call longer than `op_lookback` is counted, through query B, as in flight
while it runs and as completed in the window where it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from streams.db import Database

_NONE = np.iinfo(np.int64).min


@dataclass(frozen=True)
class ProgressParams:
    window_ns: int = 1_000_000_000
    op_lookback_ns: int = 5_000_000_000
    hang_horizon_ns: int = 3600 * 1_000_000_000


OPS_SQL = """
WITH fromUnixTimestamp64Nano({ws:Int64}, 'UTC') AS ws_t,
     fromUnixTimestamp64Nano({we:Int64}, 'UTC') AS we_t,
     toUnixTimestamp64Nano(t_end) AS e
SELECT rank, toString(comm_id) AS comm,
       countIf(e > 0 AND t_end < we_t) AS n_done,
       maxIf(op_seq, e > 0 AND t_end < we_t) AS seq_done,
       countIf(t_end >= ws_t AND t_end < we_t) AS completed,
       sumIf(bytes, t_end >= ws_t AND t_end < we_t) AS done_bytes,
       minIf(e, t_end >= ws_t AND t_end < we_t) AS first_end,
       maxIf(e, t_end >= ws_t AND t_end < we_t) AS last_end,
       countIf(e = 0 OR t_end >= we_t) AS inflight,
       minIf(toUnixTimestamp64Nano(t_start), e = 0 OR t_end >= we_t) AS oldest,
       max(toUnixTimestamp64Nano(t_start)) AS last_ts
FROM ops
WHERE job_id = {job:String}
  AND t_start >= fromUnixTimestamp64Nano({lo:Int64}, 'UTC') AND t_start < we_t
  AND (t_end = fromUnixTimestamp64Nano(0, 'UTC') OR t_end >= ws_t)
GROUP BY rank, comm
"""

HUNG_SQL = """
WITH fromUnixTimestamp64Nano({ws:Int64}, 'UTC') AS ws_t,
     fromUnixTimestamp64Nano({we:Int64}, 'UTC') AS we_t,
     toUnixTimestamp64Nano(t_end) AS e
SELECT rank, toString(comm_id) AS comm, countIf(e = 0) AS inflight,
       minIf(toUnixTimestamp64Nano(t_start), e = 0) AS oldest,
       countIf(e > 0) AS completed, sumIf(bytes, e > 0) AS done_bytes,
       minIf(e, e > 0) AS first_end, maxIf(e, e > 0) AS last_end,
       maxIf(op_seq, e > 0) AS seq_done
FROM ops
WHERE job_id = {job:String}
  AND (t_end = fromUnixTimestamp64Nano(0, 'UTC') OR (t_end >= ws_t AND t_end < we_t))
  AND t_start >= fromUnixTimestamp64Nano({far:Int64}, 'UTC')
  AND t_start < fromUnixTimestamp64Nano({lo:Int64}, 'UTC')
GROUP BY rank, comm
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
  AND window_end = (SELECT max(window_end) FROM progress WHERE job_id = {job:String})
"""


@dataclass
class ProgressState:
    """Carried per (rank, comm_id) of one job; keys are `comm code << 32 | rank`, sorted."""

    comms: dict[str, int] = field(default_factory=dict)
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_op_seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_beat_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_record_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

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

    def window(self, ws: int, we: int, ops: dict[str, np.ndarray], hung: dict[str, np.ndarray],
               beats: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Fold one window's aggregates in and return its rows (every key ever seen)."""
        ka = self.encode(ops["rank"], ops["comm"])
        kb = self.encode(hung["rank"], hung["comm"])
        kc = self.encode(beats["rank"], beats["comm"])
        self._grow(ka, kb, kc)
        n = len(self.keys)
        ia, ib, ic = (np.searchsorted(self.keys, k) for k in (ka, kb, kc))
        done = ops["n_done"] > 0
        np.maximum.at(self.last_op_seq, ia[done], ops["seq_done"][done].astype(np.int64))
        long_done = hung["completed"] > 0  # calls longer than op_lookback ending in the window
        np.maximum.at(self.last_op_seq, ib[long_done],
                      hung["seq_done"][long_done].astype(np.int64))
        np.maximum.at(self.last_beat_ts, ic, beats["beat"].astype(np.int64))
        np.maximum.at(self.last_record_ts, ia, ops["last_ts"].astype(np.int64))
        np.maximum.at(self.last_record_ts, ic, beats["beat"].astype(np.int64))
        completed = np.zeros(n, np.int64)
        done_bytes = np.zeros(n, np.int64)
        first_end = np.full(n, np.iinfo(np.int64).max, np.int64)
        last_end = np.zeros(n, np.int64)
        for i, part, ok in ((ia, ops, ops["completed"] > 0), (ib, hung, long_done)):
            np.add.at(completed, i[ok], part["completed"][ok].astype(np.int64))
            np.add.at(done_bytes, i[ok], part["done_bytes"][ok].astype(np.int64))
            np.minimum.at(first_end, i[ok], part["first_end"][ok].astype(np.int64))
            np.maximum.at(last_end, i[ok], part["last_end"][ok].astype(np.int64))
        interval = np.full(n, -1, np.int64)
        many = completed > 1
        interval[many] = (last_end[many] - first_end[many]) // (completed[many] - 1)
        inflight = np.zeros(n, np.int64)
        np.add.at(inflight, ia, ops["inflight"].astype(np.int64))
        np.add.at(inflight, ib, hung["inflight"].astype(np.int64))
        oldest = np.full(n, np.iinfo(np.int64).max, np.int64)
        live_a = ops["inflight"] > 0
        live_b = hung["inflight"] > 0
        np.minimum.at(oldest, ia[live_a], ops["oldest"][live_a].astype(np.int64))
        np.minimum.at(oldest, ib[live_b], hung["oldest"][live_b].astype(np.int64))
        rank, comm = self.decode()
        width = max(we - ws, 1)
        return {
            "window_end": np.full(n, we, np.int64), "rank": rank, "comm_id": comm,
            "last_op_seq": self.last_op_seq.copy(), "completed_ops": completed,
            "bytes_per_s": done_bytes * 1_000_000_000 // width, "op_interval_ns": interval,
            "inflight_ops": inflight,
            "oldest_inflight_age_ns": np.where(inflight > 0, np.maximum(we - oldest, 0), 0),
            "last_beat_ts": self.last_beat_ts.copy(), "last_record_ts": self.last_record_ts.copy(),
        }

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

    async def _state(self, job: str) -> ProgressState:
        st = self.states.get(job)
        if st is None:
            st = self.states[job] = ProgressState()
            last = await self.db.aquery_columns(LAST_SQL, {"job": job})
            if len(last["rank"]):
                st.restore(last)
        return st

    async def compute(self, job: str, ws: int) -> dict[str, np.ndarray]:
        we = ws + self.p.window_ns
        lo = ws - self.p.op_lookback_ns
        st = await self._state(job)
        ops = await self.db.aquery_columns(OPS_SQL, {"job": job, "ws": ws, "we": we, "lo": lo})
        hung = await self.db.aquery_columns(
            HUNG_SQL, {"job": job, "ws": ws, "we": we, "lo": lo,
                       "far": we - self.p.hang_horizon_ns})
        beats = await self.db.aquery_columns(BEATS_SQL, {"job": job, "ws": ws, "we": we})
        return st.window(ws, we, ops, hung, beats)

    def forget(self, job: str) -> None:
        self.states.pop(job, None)
