"""Chunk-level progress of ring collectives, vectorized over every group at once.

A ring collective over n members moves data in `steps` ring steps (AllReduce: 2(n-1)), each split
into `slices` pipelined slices; a unit u = step * slices + slice. For member i (sending to i+1):

    avail[u] = max(start_i, done_{i-1}[u - slices])     data for step k arrived from upstream
    ready[u] = max(avail[u] + g_i, ready[u-1], done[u-W])
                    the GPU reduced/copied it into one of W send slots           (gpu_ready)
    xmit[u]  = max(ready[u], start_{i+1}, xmit[u-1], block_i) + tx_i
                    the NIC put it on the wire, one slice at a time, once the
                    receiver had entered the op                           (rdma_transmitted)
    done[u]  = max(xmit[u] + lat_i, done[u-1], dblock_i)
                    its completion came back                                    (rdma_done)

so a rank advances a chunk only after its upstream peer delivered it, and a slow or late member
stalls its downstream neighbour first and then the whole ring (Mycroft §2, Fig. 2). The counters
follow Mycroft Table 4: a slow GPU keeps the three equal but slow; a slow NIC (large tx) lets
ready run up to W slices ahead of xmit; congestion (large lat) keeps xmit ≈ ready but done lags; a
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
    prev_ready = np.full(start.shape, -np.inf)
    for u in range(units):
        if u < slices:
            r = np.maximum(g_ready, prev_ready)
        else:
            r = np.maximum(ns, np.roll(done[u - slices], 1, axis=1))
            r += g
            np.maximum(r, prev_ready, out=r)
        if u >= window:  # the send FIFO has `window` slots: wait for one to be acknowledged
            np.maximum(r, done[u - window], out=r)
        ready[u] = r
        x = np.maximum(r, post_floor)
        if u:
            np.maximum(x, xmit[u - 1], out=x)  # the link serializes one slice at a time
        if block is not None:
            x = np.where(x >= block[0], np.maximum(x, block[1]), x)
        x += tx
        xmit[u] = x
        d = x + lat
        if u:
            np.maximum(d, done[u - 1], out=d)
        if dblock is not None:
            d = np.where(d >= dblock[0], np.maximum(d, dblock[1]), d)
        done[u] = d
        prev_ready = r
    last_in = np.roll(done[units - 1], 1, axis=1) + g
    end = np.maximum(done[units - 1], last_in)
    return RingResult(ready, xmit, done, end)
