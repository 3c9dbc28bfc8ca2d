"""Kernel summaries per window (ARGUS §5.2): the windowed shell around streams/kde.py.

For one job and window `[ws, ws + W)` (default 60 s, by kernel t_start) every kernel event of the
window is summarized in one vectorized `kde.summarize` call per slice over all its (rank, stream,
kernel) keys, and the rows come back as the `kernel_summaries` contract columns plus one
`kernel_windows` row (events in, rows out, compression ratio as `kde.compression_ratio` defines
it).

Where the events come from — memory when it provably holds the window, else the raw table:
- `KernelBuffer` keeps, per job and open window, the columns the KDE needs (rank, stream, a
  per-job name code, duration: 24 bytes per event) of every kernel batch *after* the raw sink
  stored it (`streams.derived.ObservingStore`). At close the window's stored events are
  fingerprinted in ClickHouse (count, sum of durations, sum of ranks: `COUNT_SQL`, one pass
  over two columns) and the buffer's copy is used only when its fingerprint is the same: after
  a restart (the buffer lacks what the previous worker stored), a retried write observed twice,
  or a buffer over its bound (`buffer_events` per job: the window is dropped from memory),
  the fingerprints differ and the window is read back from the table. Memory comes first
  because reading a large job's window of events back costs about as much worker CPU as storing
  them (docs/architecture.md, "Kernel windows from memory"; throughput in docs/performance.md).
- The raw table path reads rank slices of at most `max_events` events (memory bounded by that,
  not by the window or the run); the query returns cityHash64 of the kernel name and a second
  query over the same range maps the window's few distinct hashes to names.

A key is `(rank · n_streams + stream code) · n_kernels + kernel code`, with stream and kernel
codes dense per slice (a lookup table over the value range when it is small, else a sorted
search: `np.unique` is slow over millions of events), so the KDE sees int64 keys and the names
never travel per event.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import numpy as np

from ingest.batch import RecordBatch
from ingest.units import SECOND as SEC
from streams.db import Database
from streams.kde import KdeParams, compression_ratio, summarize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelParams:
    window_ns: int = 60 * SEC
    max_events: int = 8_000_000
    #: Kernel events kept in memory per job (all its open windows, 24 bytes each); a window that
    #: would pass it is read back from the raw table instead.
    buffer_events: int = 8_000_000
    kde: KdeParams = field(default_factory=KdeParams)


RANGE = """job_id = {job:String} AND t_start >= fromUnixTimestamp64Nano({ws:Int64}, 'UTC')
  AND t_start < fromUnixTimestamp64Nano({we:Int64}, 'UTC')"""
COUNT_SQL = f"""SELECT count() AS n, min(rank) AS lo, max(rank) AS hi,
  sum(toInt64(rank)) AS rank_sum, sum(duration) AS duration_sum FROM kernels WHERE {RANGE}"""
# distinct names first (a LowCardinality column's dictionary), then one hash per name
NAMES_SQL = f"""SELECT cityHash64(name) AS h, name FROM (
SELECT DISTINCT toString(kernel) AS name FROM kernels WHERE {RANGE})"""
EVENTS_SQL = f"""SELECT rank, stream, cityHash64(kernel) AS h, duration FROM kernels
WHERE {RANGE} AND rank >= {{r0:Int32}} AND rank < {{r1:Int32}}"""


def dense_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, code of each element) of an integer array, as np.unique's
    return_inverse but O(n) through a lookup table when the values span at most 2**22."""
    x = np.asarray(x)
    if not x.size:
        return x[:0], np.zeros(0, np.int64)
    lo, hi = int(x.min()), int(x.max())
    if hi - lo >= 1 << 22:
        values, codes = np.unique(x, return_inverse=True)
        return values, codes.reshape(-1).astype(np.int64)
    offset = (x - lo).astype(np.int64)
    present = np.zeros(hi - lo + 1, bool)
    present[offset] = True
    values = (np.flatnonzero(present) + lo).astype(x.dtype)
    return values, (np.cumsum(present) - 1)[offset]


def summarize_events(ev: dict[str, np.ndarray], names: dict[int, str], ws: int,
                     params: KdeParams) -> tuple[dict[str, np.ndarray], int, int]:
    """Summary columns for one slice of events (`h`: a name's hash or code, a key of `names`),
    its event count and key count. Pure."""
    n = len(ev["rank"])
    if not n:
        return {}, 0, 0
    streams, s_code = dense_codes(ev["stream"].astype(np.int64))
    h = ev["h"].astype(np.uint64)
    known = np.unique(np.fromiter(names, np.uint64, len(names)))
    k_code = np.searchsorted(known, h)
    if known.size == 0 or np.any(known[np.minimum(k_code, known.size - 1)] != h):
        hashes, k_code = dense_codes(h)  # a name stored after the names were read
    else:
        hashes = known
    ns, nk = len(streams), len(hashes)
    key = (ev["rank"].astype(np.int64) * ns + s_code) * nk + k_code
    s = summarize(key, ev["duration"], params)
    kernel_code = s.key % nk
    stream_code = (s.key // nk) % ns
    label = np.array([names.get(int(h), f"#{int(h):x}") for h in hashes], dtype=object)
    cols = {
        "window_start": np.full(s.n_rows, ws, np.int64),
        "rank": (s.key // (nk * ns)).astype(np.int32),
        "stream": streams[stream_code],
        "kernel": label[kernel_code],
        "cluster": s.cluster,
        "count": s.count,
        "p50_ns": np.rint(s.p50).astype(np.int64),
        "p99_ns": np.rint(s.p99).astype(np.int64),
    }
    return cols, n, int(np.unique(s.key).size)


@dataclass
class _Window:
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=list)
    events: int = 0
    rank_sum: int = 0
    duration_sum: int = 0


@dataclass
class _JobBuffer:
    names: dict[str, int] = field(default_factory=dict)
    windows: dict[int, _Window] = field(default_factory=dict)
    #: windows below this start are closed (taken or dropped): their events are not kept
    closed_before: int = -(1 << 62)
    #: windows that passed the bound: not kept, read back from the table
    overflowed: set[int] = field(default_factory=set)
    events: int = 0


class KernelBuffer:
    """The open windows' kernel events of every job, as stored (module docstring)."""

    def __init__(self, window_ns: int, max_events: int) -> None:
        self.window_ns, self.max_events = window_ns, max_events
        self.jobs: dict[str, _JobBuffer] = {}
        self.hits = self.misses = 0

    def add(self, batch: RecordBatch) -> None:
        """Keep a stored kernel batch's events in their windows (call only after it is stored)."""
        if not batch.n:
            return
        jb = self.jobs.setdefault(batch.job_id, _JobBuffer())
        name = batch.strings.get("kernel")
        if name is None:  # decoded without codes
            values, codes = np.unique(batch.cols["kernel"].astype(str), return_inverse=True)
        else:
            values, codes = name.values, name.codes
        lut = np.array([jb.names.setdefault(str(v), len(jb.names)) for v in values], np.int32)
        t = np.asarray(batch.cols["t_start"], np.int64)
        win = t // self.window_ns * self.window_ns
        win[t <= 0] = -(1 << 62)  # no time: in no window the runner closes (not kept below)
        first, last = int(win.min()), int(win.max())
        starts = [first] if first == last else np.unique(win).tolist()
        for ws in starts:
            sel = slice(None) if first == last else (win == ws)
            if ws < max(jb.closed_before, 0) or ws in jb.overflowed:
                continue
            rank = np.asarray(batch.cols["rank"][sel], np.int32)
            part = (rank, np.asarray(batch.cols["stream"][sel], np.int64),
                    lut[np.asarray(codes)[sel]], np.asarray(batch.cols["duration"][sel], np.int64))
            n = len(rank)
            if jb.events + n > self.max_events:
                self._drop(jb, ws)
                jb.overflowed.add(ws)
                continue
            w = jb.windows.setdefault(ws, _Window())
            w.parts.append(part)
            w.events += n
            w.rank_sum += int(rank.sum(dtype=np.int64))
            w.duration_sum += int(part[3].sum())
            jb.events += n

    def take(self, job: str, ws: int, fingerprint: tuple[int, int, int]
             ) -> tuple[dict[str, np.ndarray], dict[int, str]] | None:
        """Window `ws`'s events and names when its fingerprint (count, rank sum, duration sum)
        is the stored one's, else None; the window is closed either way."""
        jb = self.jobs.get(job)
        if jb is None:
            self.misses += 1
            return None
        w = jb.windows.get(ws)
        self.close(job, ws + self.window_ns)
        n, rank_sum, duration_sum = fingerprint
        if w is None or (w.events, w.rank_sum, w.duration_sum % (1 << 64)) != (
                n, rank_sum, duration_sum % (1 << 64)):
            self.misses += 1
            return None
        self.hits += 1
        ev = {c: np.concatenate([p[i] for p in w.parts])
              for i, c in enumerate(("rank", "stream", "h", "duration"))}
        return ev, {code: name for name, code in jb.names.items()}

    def close(self, job: str, before: int) -> None:
        """Forget the windows of `job` that start before `before` and keep none of them again."""
        jb = self.jobs.get(job)
        if jb is None:
            return
        jb.closed_before = max(jb.closed_before, before)
        for ws in [ws for ws in jb.windows if ws < before]:
            self._drop(jb, ws)
        jb.overflowed = {ws for ws in jb.overflowed if ws >= before}

    @staticmethod
    def _drop(jb: _JobBuffer, ws: int) -> None:
        w = jb.windows.pop(ws, None)
        if w is not None:
            jb.events -= w.events


class KernelSummarizer:
    """Summarizes one window of a job's kernel events; see the module docstring."""

    def __init__(self, db: Database, params: KernelParams | None = None) -> None:
        self.db, self.p = db, params or KernelParams()
        self.buffer = KernelBuffer(self.p.window_ns, self.p.buffer_events)

    async def compute(self, job: str, ws: int, offload: bool = True
                      ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(kernel_summaries columns, kernel_windows columns) of window `ws`; empty dicts when the
        window holds no events. Closes the window in the buffer."""
        rng = {"job": job, "ws": ws, "we": ws + self.p.window_ns}
        count = await self.db.aquery_columns(COUNT_SQL, rng)
        total = int(count["n"][0]) if len(count["n"]) else 0
        if not total:
            self.buffer.close(job, ws + self.p.window_ns)
            return {}, {}
        held = self.buffer.take(job, ws, (total, int(count["rank_sum"][0]),
                                          int(count["duration_sum"][0])))
        parts: list[dict[str, np.ndarray]] = []
        events = keys = 0
        if held is not None:
            ev, names = held
            cols, n, k = await self._summarize(ev, names, ws, offload)
            parts, events, keys = [cols], n, k
        else:
            log.info("kernel window %d of %s: %d events read back from the table (not all of "
                     "them in memory: a restart, or over buffer_events)", ws // SEC, job, total)
            lo, hi = int(count["lo"][0]), int(count["hi"][0]) + 1
            names_cols = await self.db.aquery_columns(NAMES_SQL, rng)
            names = {int(h): str(n) for h, n in zip(names_cols["h"], names_cols["name"],
                                                     strict=True)}
            slices = max(1, -(-total // self.p.max_events))
            bounds = np.linspace(lo, hi, slices + 1).round().astype(np.int64)
            for r0, r1 in itertools.pairwise(bounds):
                if r1 <= r0:
                    continue
                ev = await self.db.aquery_columns(EVENTS_SQL,
                                                  {**rng, "r0": int(r0), "r1": int(r1)})
                cols, n, k = await self._summarize(ev, names, ws, offload)
                if n:
                    parts.append(cols)
                    events, keys = events + n, keys + k
        if not parts or not events:
            return {}, {}
        out = {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}
        rows = len(out["rank"])
        window = {"window_start": np.array([ws], np.int64), "events": np.array([events]),
                  "keys": np.array([keys]), "summary_rows": np.array([rows]),
                  "compression_ratio": np.array([compression_ratio(events, rows)])}
        return out, window

    async def _summarize(self, ev: dict[str, np.ndarray], names: dict[int, str], ws: int,
                         offload: bool) -> tuple[dict[str, np.ndarray], int, int]:
        if offload:
            return await asyncio.to_thread(summarize_events, ev, names, ws, self.p.kde)
        return summarize_events(ev, names, ws, self.p.kde)
