"""Kernel summaries per window (ARGUS §5.2): the windowed shell around streams/kde.py.

For one job and window `[ws, ws + W)` (default 60 s, by kernel t_start) the kernel events are read
from the raw `kernels` table in rank slices of at most `max_events` events (memory per job is
bounded by that, not by the window or the run), each slice is summarized in one vectorized
`kde.summarize` call over all its (rank, stream, kernel) keys, and the rows come back as the
`kernel_summaries` contract columns plus one `kernel_windows` row (events in, rows out,
compression ratio as `kde.compression_ratio` defines it).

A key is `(rank · n_streams + stream code) · n_kernels + kernel code`, with stream and kernel
codes dense per slice, so the KDE sees int64 keys and the names never travel per event (the query
returns cityHash64 of the kernel name; a second query over the same range maps hashes to names).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import numpy as np

from streams.db import Database
from streams.kde import KdeParams, compression_ratio, summarize


@dataclass(frozen=True)
class KernelParams:
    window_ns: int = 60_000_000_000
    max_events: int = 8_000_000
    kde: KdeParams = field(default_factory=KdeParams)


RANGE = """job_id = {job:String} AND t_start >= fromUnixTimestamp64Nano({ws:Int64}, 'UTC')
  AND t_start < fromUnixTimestamp64Nano({we:Int64}, 'UTC')"""
COUNT_SQL = f"SELECT count() AS n, min(rank) AS lo, max(rank) AS hi FROM kernels WHERE {RANGE}"
# distinct names first (a LowCardinality column's dictionary), then one hash per name
NAMES_SQL = f"""SELECT cityHash64(name) AS h, name FROM (
SELECT DISTINCT toString(kernel) AS name FROM kernels WHERE {RANGE})"""
EVENTS_SQL = f"""SELECT rank, stream, cityHash64(kernel) AS h, duration FROM kernels
WHERE {RANGE} AND rank >= {{r0:Int32}} AND rank < {{r1:Int32}}"""


def summarize_events(ev: dict[str, np.ndarray], names: dict[int, str], ws: int,
                     params: KdeParams) -> tuple[dict[str, np.ndarray], int, int]:
    """Summary columns for one slice of events, its event count and key count. Pure."""
    n = len(ev["rank"])
    if not n:
        return {}, 0, 0
    streams, s_code = np.unique(ev["stream"].astype(np.int64), return_inverse=True)
    hashes, k_code = np.unique(ev["h"].astype(np.uint64), return_inverse=True)
    ns, nk = len(streams), len(hashes)
    key = (ev["rank"].astype(np.int64) * ns + s_code) * nk + k_code
    s = summarize(key, ev["duration"].astype(np.float64), params)
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


class KernelSummarizer:
    """Reads one window of a job's kernel events and summarizes it; see the module docstring."""

    def __init__(self, db: Database, params: KernelParams | None = None) -> None:
        self.db, self.p = db, params or KernelParams()

    async def compute(self, job: str, ws: int, offload: bool = True
                      ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(kernel_summaries columns, kernel_windows columns) of window `ws`; empty dicts when the
        window holds no events."""
        rng = {"job": job, "ws": ws, "we": ws + self.p.window_ns}
        count = await self.db.aquery_columns(COUNT_SQL, rng)
        total = int(count["n"][0]) if len(count["n"]) else 0
        if not total:
            return {}, {}
        lo, hi = int(count["lo"][0]), int(count["hi"][0]) + 1
        names_cols = await self.db.aquery_columns(NAMES_SQL, rng)
        names = {int(h): str(n) for h, n in zip(names_cols["h"], names_cols["name"], strict=True)}
        slices = max(1, -(-total // self.p.max_events))
        bounds = np.linspace(lo, hi, slices + 1).round().astype(np.int64)
        parts: list[dict[str, np.ndarray]] = []
        events = keys = 0
        for r0, r1 in itertools.pairwise(bounds):
            if r1 <= r0:
                continue
            ev = await self.db.aquery_columns(EVENTS_SQL, {**rng, "r0": int(r0), "r1": int(r1)})
            if offload:
                cols, n, k = await asyncio.to_thread(summarize_events, ev, names, ws, self.p.kde)
            else:
                cols, n, k = summarize_events(ev, names, ws, self.p.kde)
            if n:
                parts.append(cols)
                events, keys = events + n, keys + k
        if not parts:
            return {}, {}
        out = {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}
        rows = len(out["rank"])
        window = {"window_start": np.array([ws], np.int64), "events": np.array([events]),
                  "keys": np.array([keys]), "summary_rows": np.array([rows]),
                  "compression_ratio": np.array([compression_ratio(events, rows)])}
        return out, window
