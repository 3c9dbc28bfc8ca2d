"""Timing of one collective or p2p transfer from the job model and the step's fault effects.

Links: a hop between two ranks of one host goes over NVLink; a hop between hosts goes through
the sending rank's NIC (one NIC per GPU, `mlx5_<local index>`). NIC faults act on network hops
only: a bandwidth limit stretches the sender's serialization time `tx`; background traffic adds
queueing delay to delivery (`lat`, in units of the nominal slice time); a NIC that is down blocks
its posts and the completions of data sent to it; a failed receiver blocks completions into it.
A PCIe downgrade adds a staging copy over the degraded link to every slice the GPU readies; a slow
GPU stretches reductions. Proxy delay: with probability p the member's proxy starts the op late.
Realism (`slow`, per member): the link's serialization, reduction and latency times scaled by its
communicator's speed and the call's transfer noise (ingest/sim/realism.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingest.sim.config import JobConfig
from ingest.sim.effects import StepEffects
from ingest.sim.ring import RingResult, ring_progress

MIB = float(1 << 20)


@dataclass
class Links:
    """Per-member parameters of the member's outgoing link, arrays shaped like `pos`."""

    net: np.ndarray
    g: np.ndarray
    tx: np.ndarray
    lat: np.ndarray


def links(cfg: JobConfig, fx: StepEffects, host: np.ndarray, pos: np.ndarray, dst: np.ndarray,
          slice_bytes: float, slow: np.ndarray | None = None) -> Links:
    """Link parameters for data from grid positions `pos` to `dst` (flat indices); `slow`
    (shaped like `pos`) scales every time of the member's link."""
    net = host[pos] != host[dst]
    nic_bw = fx.nic_bw.ravel()[pos]
    tx_nominal = slice_bytes / (cfg.nic_gbps * 1e9)
    tx = np.where(net, tx_nominal / nic_bw, slice_bytes / (cfg.nvlink_gbps * 1e9))
    lat_f = fx.lat.ravel()[pos]
    lat = np.where(net, cfg.nic_lat_us * 1e-6 + (lat_f - 1.0) * tx_nominal,
                   cfg.nvlink_lat_us * 1e-6)
    pcie = fx.pcie.ravel()[pos]
    g = slice_bytes / (cfg.reduce_gbps * 1e9) * fx.gpu.ravel()[pos]
    g = g + np.where(pcie < 1.0, slice_bytes / (cfg.nic_gbps * 1e9 * pcie), 0.0)
    if slow is not None:
        tx, g, lat = tx * slow, g * slow, lat * slow
    return Links(net, g, tx, lat)


def _blocks(fx: StepEffects, pos: np.ndarray, dst: np.ndarray, net: np.ndarray
            ) -> tuple[tuple[np.ndarray, np.ndarray] | None, tuple[np.ndarray, np.ndarray] | None]:
    if not fx.any_block:
        return None, None
    bf, bu = fx.block_from.ravel(), fx.block_until.ravel()
    rf, ru = fx.rblock_from.ravel(), fx.rblock_until.ravel()
    inf = np.inf
    block = (np.where(net, bf[pos], inf), bu[pos])
    dblock = (np.where(net, np.minimum(bf[dst], rf[dst]), inf), np.maximum(bu[dst], ru[dst]))
    return block, dblock


def _proxy_start(fx: StepEffects, pos: np.ndarray, start: np.ndarray,
                 rng: np.random.Generator) -> np.ndarray | None:
    if not fx.any_proxy:
        return None
    hit = rng.random(pos.shape) < fx.proxy_p.ravel()[pos]
    return np.where(hit, start + fx.proxy_delay.ravel()[pos], start)


def ring_collective(cfg: JobConfig, fx: StepEffects, host: np.ndarray, pos: np.ndarray,
                    start: np.ndarray, nbytes: float, steps: int, slices: int,
                    rng: np.random.Generator, slow: np.ndarray | None = None) -> RingResult:
    """A ring collective over groups `pos` [G, n] (flat grid positions, ring order on axis 1)
    that members enter at `start` [G, n]; `slow` [G, n] scales each member's link times."""
    n = pos.shape[1]
    dst = np.roll(pos, -1, axis=1)
    lk = links(cfg, fx, host, pos, dst, nbytes / n / slices, slow)
    block, dblock = _blocks(fx, pos, dst, lk.net)
    return ring_progress(start, lk.g, lk.tx, lk.lat, steps, slices, cfg.window, block, dblock,
                         _proxy_start(fx, pos, start, rng))


@dataclass
class Transfer:
    """A p2p transfer of `nbytes` in `units` slices: when data started moving, the per-slice
    serialization time and latency, and when the last slice was acknowledged."""

    begin: np.ndarray
    tx: np.ndarray
    lat: np.ndarray
    done: np.ndarray
    net: np.ndarray
    units: int


def p2p(cfg: JobConfig, fx: StepEffects, host: np.ndarray, src: np.ndarray, dst: np.ndarray,
        send_start: np.ndarray, recv_start: np.ndarray, nbytes: float,
        rng: np.random.Generator, slow: np.ndarray | None = None) -> Transfer:
    """Send from grid positions `src` to `dst`: data moves once both sides are in the call;
    `slow` scales each link's times."""
    units = cfg.slices
    lk = links(cfg, fx, host, src, dst, nbytes / units, slow)
    begin = np.maximum(send_start, recv_start)
    late = _proxy_start(fx, src, begin, rng)
    if late is not None:
        begin = late
    block, dblock = _blocks(fx, src, dst, lk.net)
    if block is not None:
        begin = np.where(begin >= block[0], np.maximum(begin, block[1]), begin)
    done = begin + np.maximum(lk.g, lk.tx) * units + lk.lat
    if dblock is not None:
        done = np.where(done >= dblock[0], np.maximum(done, dblock[1]), done)
    return Transfer(begin, np.maximum(lk.g, lk.tx), lk.lat, done, lk.net, units)
