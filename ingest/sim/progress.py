"""Periodic records: chunk snapshots of in-flight ops, RDMA work-request samples, heartbeats.

Chunk snapshots (Mycroft §4.2, Table 4) are taken every `chunk_interval_ms` on a global tick
grid, one row per channel, for every op that is in flight across a tick: ring collectives report
how many of their units were GPU-ready, posted (rdma_transmitted) and completed (rdma_done) by
the tick; a Send reports all units ready, the slices serialized so far and the slices acknowledged
(none while its receiver is failed); a Recv reports the slices received in all three counters.

WR samples (VenusTrace §3.2.2) and heartbeats come from per-rank timelines of events: a WR is
posted (+1 in flight) when a network unit is transmitted and retired (−1, +bytes) when it
completes; a heartbeat reports the last op_seq the rank started on each communicator. Timelines
are sampled window by window; events from later steps never fall before a window's end.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ingest.sim.config import JobConfig
from ingest.sim.emit import Clock, Cols
from ingest.sim.engine import OpGroup

SHIFT = 1 << 46  # rank key stride in ns: simulated runs shorter than ~19 hours


def ticks_between(lo: np.ndarray, hi: np.ndarray, interval: float) -> tuple[np.ndarray,
                                                                            np.ndarray]:
    """Rows (member index, tick time) for ticks k*interval with lo < tick < hi."""
    ok = np.isfinite(lo) & np.isfinite(hi)
    first = np.floor(np.where(ok, lo, 0.0) / interval) + 1
    last = np.ceil(np.where(ok, hi, 0.0) / interval) - 1
    count = np.where(ok, np.maximum(last - first + 1, 0), 0)
    count = count.astype(np.int64)
    idx = np.repeat(np.arange(len(lo)), count)
    if not len(idx):
        return idx, np.empty(0)
    offs = np.arange(len(idx)) - np.repeat(np.cumsum(count) - count, count)
    return idx, (first[idx] + offs) * interval


def _count_le(mat: np.ndarray, cols: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """For each row, how many entries of mat[:, cols[row]] are <= ts[row] (mat sorted along 0)."""
    if not len(cols):
        return np.zeros(0, np.int64)
    fin = np.isfinite(mat)
    last = np.where(fin, mat, -np.inf).max(axis=0)
    n_fin = fin.sum(axis=0)
    out = n_fin[cols].astype(np.int64)
    todo = np.flatnonzero(ts < last[cols])
    for lo in range(0, len(todo), 4096):  # bound the [units, rows] temporary
        part = todo[lo:lo + 4096]
        out[part] = (mat[:, cols[part]] <= ts[part]).sum(axis=0)
    return np.asarray(out)


class ChunkSnapshots:
    def __init__(self, cfg: JobConfig, ranks: np.ndarray, death: np.ndarray,
                 clock: Clock) -> None:
        self.cfg, self.ranks, self.death, self.clock = cfg, ranks, death, clock

    def rows(self, g: OpGroup, lo: float, hi: float, comm_names: list[str],
             comm_codes: np.ndarray, stuck_only: bool = False) -> Cols | None:
        """Snapshots of `g` for ticks in [lo, hi); `stuck_only`: members that never finish."""
        interval = self.cfg.chunk_interval_ms / 1e3
        end = np.minimum(np.minimum(g.t_end, self.death[g.pos]), hi)
        if stuck_only:
            end = np.where(np.isfinite(g.t_end), -math.inf, end)
        start = np.maximum(g.t_start, lo - 1e-12)
        alive = g.t_start < self.death[g.pos]
        j, ts = ticks_between(np.where(alive, start, math.inf), end, interval)
        j, ts = j[ts >= lo], ts[ts >= lo]
        if not len(j):
            return None
        if g.ring is not None:
            total = np.full(len(j), g.ring.units)
            ready = _count_le(g.ring.ready, j, ts)
            xmit = _count_le(g.ring.xmit, j, ts)
            done = _count_le(g.ring.done, j, ts)
        else:
            assert g.transfer is not None
            ready, xmit, done, total = _transfer_counts(g, j, ts)
        ch = self.cfg.channels
        pos = g.pos[j]
        ranks = np.repeat(self.ranks[pos], ch)
        n = len(ranks)
        return {
            "rank": ranks,
            "comm_id": (np.repeat(comm_codes[pos], ch), comm_names),
            "op_seq": np.full(n, g.seq, np.int64),
            "channel": np.tile(np.arange(ch), len(j)),
            "ts": self.clock.ns(np.repeat(ts, ch), ranks),
            "total_chunks": np.repeat(total, ch),
            "gpu_ready": np.repeat(ready, ch),
            "rdma_transmitted": np.repeat(xmit, ch),
            "rdma_done": np.repeat(done, ch),
        }


def _transfer_counts(g: OpGroup, j: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, ...]:
    tr = g.transfer
    assert tr is not None
    units = tr.units
    begin, tx, lat, done_t = tr.begin[j], tr.tx[j], tr.lat[j], tr.done[j]
    with np.errstate(invalid="ignore"):
        sent = np.clip(np.floor((ts - begin) / tx), 0, units)
        acked = np.clip(np.floor((ts - begin - lat) / tx), 0, units)
    sent = np.where(np.isfinite(begin), sent, 0).astype(np.int64)
    nominal = begin + tx * units + lat
    blocked = done_t > nominal * (1 + 1e-12) + 1e-9
    acked = np.where(ts >= done_t, units, np.where(blocked, 0, np.minimum(acked, units - 1)))
    acked = np.where(np.isfinite(begin), acked, 0).astype(np.int64)
    total = np.full(len(j), units, np.int64)
    if g.op == "Send":
        return total, sent, acked, total
    return acked, acked, acked, total


class Timeline:
    """Per-rank counters from events (rank, t, value): `sum` accumulates, `last` keeps the most
    recent value. Sampled at (rank, t) ticks inside a window; events before the window's end are
    folded into the state, later ones wait."""

    def __init__(self, n_ranks: int, width: int, mode: str) -> None:
        self.state = np.zeros((n_ranks, width), np.int64) if mode == "sum" else np.full(
            (n_ranks, width), -1, np.int64)
        self.mode = mode
        self.pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, ranks: np.ndarray, t: np.ndarray, values: np.ndarray) -> None:
        keep = np.isfinite(t)
        if keep.any():
            self.pending.append((ranks[keep], t[keep], values[keep]))

    def sample(self, ranks: np.ndarray, ts: np.ndarray, until: float) -> np.ndarray:
        """Counter values [rows, width] at ticks (ranks, ts), all ts < until."""
        if self.pending:
            r = np.concatenate([p[0] for p in self.pending])
            t = np.concatenate([p[1] for p in self.pending])
            v = np.concatenate([p[2] for p in self.pending])
        else:
            r, t, v = np.zeros(0, np.int64), np.zeros(0), np.zeros((0, self.state.shape[1]),
                                                                 np.int64)
        if not len(r):
            return np.asarray(self.state[ranks])
        now = t < until
        self.pending = [(r[~now], t[~now], v[~now])] if (~now).any() else []
        r, t, v = r[now], t[now], v[now]
        if not len(r):
            return np.asarray(self.state[ranks])
        order = np.lexsort((t, r))
        r, t, v = r[order], t[order], v[order]
        key = r * SHIFT + np.rint(t * 1e9).astype(np.int64)
        qkey = ranks * SHIFT + np.rint(ts * 1e9).astype(np.int64)
        idx = np.searchsorted(key, qkey, side="right") - 1
        first = np.searchsorted(key, ranks * SHIFT, side="left")
        has = idx >= first
        if self.mode == "sum":
            cum = np.cumsum(v, axis=0)
            base = np.where((first > 0)[:, None], cum[np.maximum(first - 1, 0)], 0)
            got = np.where(has[:, None], cum[np.maximum(idx, 0)] - base, 0)
            out = self.state[ranks] + got
            np.add.at(self.state, r, v)
        else:
            got = v[np.maximum(idx, 0)] if len(v) else np.zeros((len(ranks), v.shape[1]),
                                                               np.int64)
            out = np.where(has[:, None], np.maximum(self.state[ranks], got), self.state[ranks])
            if len(r):
                np.maximum.at(self.state, r, v)
        return np.asarray(out)


def wr_events(g: OpGroup, ranks: np.ndarray, group_size: int, slices: int
              ) -> list[tuple[np.ndarray, np.ndarray, Any]]:
    """(ranks, times, [inflight delta, bytes delta]) events of a call's network traffic."""
    if g.net is None or not g.net.any():
        return []
    net = np.flatnonzero(g.net)
    r = ranks[g.pos[net]]
    if g.ring is not None:
        units = g.ring.units
        xm, dn = g.ring.xmit[:, net].ravel(), g.ring.done[:, net].ravel()
        rr = np.tile(r, units)
        unit_bytes = g.nbytes // (group_size * slices)
        post = np.stack([np.ones(len(rr), np.int64), np.zeros(len(rr), np.int64)], axis=1)
        fin = np.stack([-np.ones(len(rr), np.int64), np.full(len(rr), unit_bytes)], axis=1)
        return [(rr, xm, post), (rr, dn, fin)]
    if g.op != "Send":
        return []
    tr = g.transfer
    assert tr is not None
    n = len(r)
    post = np.stack([np.full(n, tr.units), np.zeros(n, np.int64)], axis=1)
    fin = np.stack([np.full(n, -tr.units), np.full(n, g.nbytes)], axis=1)
    return [(r, tr.begin[net], post), (r, tr.done[net], fin)]
