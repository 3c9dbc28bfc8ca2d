"""Chunk-level progress of ring collectives, vectorized over every group at once.

A ring collective over n members moves data in `steps` ring steps (AllReduce: 2(n-1)), each split
into `slices` pipelined slices; a unit u = step * slices + slice. For member i (sending to i+1):

    avail[u] = max(start_i, done_{i-1}[u - slices])     data for step k arrived from upstream
    ready[u] = max(avail[u] + g_i, ready[u-1])          GPU reduced/copied it   (gpu_ready)
    xmit[u]  = max(ready[u], start_{i+1}, done[u-W], block_i)   posted to the link
                                                         (rdma_transmitted; needs the receiver's
                                                          buffers and a free slot of W)
    done[u]  = max(xmit[u] + tx_i + lat_i, done[u-1] + tx_i, dblock_i)
                                                         completion seen (rdma_done)

so a rank advances a chunk only after its upstream peer delivered it, and a slow or late member
stalls its downstream neighbour first and then the whole ring (Mycroft §2, Fig. 2). The counters
follow Mycroft Table 4: a slow GPU keeps the three equal but slow; a slow NIC (large tx) fills the
W send slots so xmit lags ready; congestion (large lat) keeps xmit == ready but done lags; a
receiver that never acknowledges (dblock = inf) leaves the sender with xmit > done while its own
counters stay equal. Infinite times (hangs) propagate through max and + unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RingResult:
    """Per-unit event times [units, G, n] and per-member end times [G, n] (seconds, inf = never)."""

    ready: np.ndarray
    xmit: np.ndarray
    done: np.ndarray
    end: np.ndarray

    @property
    def units(self) -> int:
        return int(self.ready.shape[0])


def ring_progress(
    start: np.ndarray,
    g: np.ndarray,
    tx: np.ndarray,
    lat: np.ndarray,
    steps: int,
    slices: int = 1,
    window: int = 8,
    block: tuple[np.ndarray, np.ndarray] | None = None,
    dblock: tuple[np.ndarray, np.ndarray] | None = None,
    net_start: np.ndarray | None = None,
) -> RingResult:
    """Event times of a ring collective. All inputs are float arrays [G, n] (ring order along
    axis 1). `net_start` (default `start`) is when a member's proxy starts progressing the op;
    `block` = (from, until): posts at or after `from` wait until `until` (the sender's NIC is
    down); `dblock` does the same to completions of the member's outgoing link (the receiver
    failed or its NIC is down)."""
    units = steps * slices
    shape = (units, *start.shape)
    ready = np.empty(shape)
    xmit = np.empty(shape)
    done = np.empty(shape)
    ns = start if net_start is None else np.maximum(start, net_start)
    credit = np.roll(ns, -1, axis=1)
    post_floor = np.maximum(ns, credit)
    g_ready = ns + g
    prev_ready = None
    for u in range(units):
        if u < slices:
            r = g_ready if prev_ready is None else np.maximum(g_ready, prev_ready)
        else:
            r = np.maximum(ns, np.roll(done[u - slices], 1, axis=1))
            r += g
            if prev_ready is not None:
                np.maximum(r, prev_ready, out=r)
        ready[u] = r
        p = np.maximum(r, post_floor)
        if u >= window:
            np.maximum(p, done[u - window], out=p)
        if block is not None:
            p = np.where(p >= block[0], np.maximum(p, block[1]), p)
        xmit[u] = p
        d = p + tx
        d += lat
        if u:
            np.maximum(d, done[u - 1] + tx, out=d)
        if dblock is not None:
            d = np.where(d >= dblock[0], np.maximum(d, dblock[1]), d)
        done[u] = d
        prev_ready = ready[u]
    last_in = np.roll(done[units - 1], 1, axis=1) + g
    end = np.maximum(done[units - 1], last_in)
    return RingResult(ready, xmit, done, end)
