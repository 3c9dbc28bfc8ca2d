"""Turn a StepResult into columns of the contract's record kinds: ops, flows, stages, kernels.

Times become int64 ns of the producing host's clock: job epoch + simulated time + that host's
clock offset (uniform in ±clock_skew_ms, drawn once per run from the seed). A rank whose process
died emits nothing stamped at or after its death; an op it had in flight keeps t_end = 0, as does
any op that never completes. An op that never started (its rank hung before reaching it) has no
record at all — the rank's op_seq simply stops, which is the clock-free evidence of a hang.

Kernels: three per compute segment (a GEMM whose tile size alternates between two shapes, an
attention kernel, an elementwise kernel) sized by the segment's kernel-class multipliers, plus
one NCCL kernel per collective / p2p call on its own stream (its duration includes the wait, as
a real NCCL kernel spins until its peers arrive), and the optimizer's multi-tensor kernel. With
`kernel_every = k` only every k-th step carries kernels (documented volume control); with
`kernels = False` none do (a CPU job: the PyTorch tracer records ops and stages only).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ingest.records import JobTopology
from ingest.sim.config import JobConfig
from ingest.sim.engine import PASS_F, PASS_OPT, OpGroup, Segment, StepResult
from ingest.sim.topology import Layout

Cols = dict[str, Any]

KERNEL_NAMES = [
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize256x128x64",
    "flash_fwd_kernel",
    "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel",
    "vectorized_elementwise_kernel",
    "multi_tensor_apply_kernel",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    "ncclDevKernel_SendRecv",
]
K_GEMM_A, K_GEMM_B, K_FLASH_F, K_FLASH_B, K_ELT, K_OPT, K_NCCL_TP, K_NCCL_DP, K_NCCL_PP = range(9)
_NCCL_KERNEL = {"tp": K_NCCL_TP, "dp": K_NCCL_DP, "pp": K_NCCL_PP}
OP_NAMES = ["AllReduce", "Send", "Recv"]


class Clock:
    """Maps simulated seconds on a rank to that host's realtime ns."""

    def __init__(self, cfg: JobConfig, layout: Layout) -> None:
        rng = np.random.default_rng([cfg.seed, 0xC10C])
        skew = cfg.clock_skew_ms * 1e6
        self.offset = np.rint(rng.uniform(-skew, skew, layout.n_hosts)).astype(np.int64)
        self.rank_offset = self.offset[layout.host_of] + cfg.epoch_ns
        self.epoch = cfg.epoch_ns

    def ns(self, t: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Host-clock ns for finite times; callers mask out non-finite ones first."""
        safe = np.where(np.isfinite(t), t, 0.0)
        return np.asarray(np.rint(safe * 1e9).astype(np.int64) + self.rank_offset[ranks])


class StepEmitter:
    """Stateless per step apart from its configuration; see module docstring."""

    def __init__(self, cfg: JobConfig, layout: Layout, death: np.ndarray, clock: Clock) -> None:
        self.cfg, self.layout, self.clock = cfg, layout, clock
        self.ranks = layout.grid.ravel()
        self.death = death.ravel()  # per flat grid position, inf if alive
        self.comm_names, self.codes = comm_dictionary(layout, not cfg.declared_shape)
        self.nics = [layout.nic_name(r) for r in range(layout.ranks_per_host)]

    def _alive(self, pos: np.ndarray, t: np.ndarray) -> np.ndarray:
        return np.asarray(np.isfinite(t) & (t < self.death[pos]))

    def ops(self, g: OpGroup) -> Cols | None:
        keep = self._alive(g.pos, g.t_start)
        if not keep.any():
            return None
        pos = g.pos[keep]
        ranks = self.ranks[pos]
        ended = self._alive(pos, g.t_end[keep])
        n = len(pos)
        peer = np.full(n, -1, np.int64) if g.peer_pos is None else self.ranks[g.peer_pos[keep]]
        return {
            "rank": ranks,
            "comm_id": (self.codes[g.comm][pos], self.comm_names),
            "op_seq": np.full(n, g.seq, np.int64),
            "op": (np.full(n, OP_NAMES.index(g.op)), OP_NAMES),
            "bytes": np.full(n, g.nbytes, np.int64),
            "peer": peer,
            "stream": np.full(n, g.stream, np.int64),
            "t_enqueue": self.clock.ns(g.t_enqueue[keep], ranks),
            "t_start": self.clock.ns(g.t_start[keep], ranks),
            "t_end": np.where(ended, self.clock.ns(g.t_end[keep], ranks), 0),
            "step": np.full(n, g.step, np.int64),
        }

    def flows(self, g: OpGroup) -> Cols | None:
        """One flow per channel of each sending member (ring members and Send calls)."""
        if g.comm == "tp" or g.op == "Recv":
            return None
        if g.ring is not None:
            begin, finish = g.ring.xmit[0], g.ring.done[-1]
            peer_pos = np.roll(g.pos.reshape(-1, self.cfg.dp), -1, axis=1).ravel()
        else:
            assert g.transfer is not None and g.peer_pos is not None
            begin, finish, peer_pos = g.transfer.begin, g.transfer.done, g.peer_pos
        keep = self._alive(g.pos, begin)
        if not keep.any():
            return None
        ch = self.cfg.channels
        pos = np.repeat(g.pos[keep], ch)
        ranks = self.ranks[pos]
        net = np.repeat(np.asarray(g.net)[keep], ch)
        b, f = np.repeat(begin[keep], ch), np.repeat(finish[keep], ch)
        n = len(pos)
        nic_codes = np.where(net, ranks % self.layout.ranks_per_host + 1, 0)
        return {
            "rank": ranks,
            "comm_id": (self.codes[g.comm][pos], self.comm_names),
            "op_seq": np.full(n, g.seq, np.int64),
            "channel": np.tile(np.arange(ch), len(pos) // ch),
            "peer": self.ranks[np.repeat(peer_pos[keep], ch)],
            "nic": (nic_codes, ["", *self.nics]),
            "bytes": np.full(n, g.nbytes // ch, np.int64),
            "t_start": self.clock.ns(b, ranks),
            "t_end": np.where(self._alive(pos, f), self.clock.ns(f, ranks), 0),
        }

    def stages(self, res: StepResult) -> Cols | None:
        t0, end = res.t0.ravel(), res.end.ravel()
        pos = np.flatnonzero(np.isfinite(end) & (end < self.death) & np.isfinite(t0))
        if not len(pos):
            return None
        ranks = self.ranks[pos]
        cols: Cols = {"rank": ranks, "step": np.full(len(pos), res.step, np.int64),
                      "t_start": self.clock.ns(t0[pos], ranks)}
        for name, d in res.stages.items():
            cols[name] = np.rint(d.ravel()[pos] * 1e9).astype(np.int64)
        cols["device_ns"] = np.rint(res.device.ravel()[pos] * 1e9).astype(np.int64)
        if res.sched_wait is not None:  # the step's CPU wait, as the tracer reads it
            wait = res.sched_wait.ravel()[pos]
            cols["sched_wait_ns"] = np.rint(np.where(np.isfinite(wait), wait, 0.0) * 1e9
                                            ).astype(np.int64)
            # the host's CPU pressure, as the tracer reads PSI: some task of the host waited
            # for a CPU at least as long as its longest-waiting rank did
            host = self.layout.host_of[ranks]
            most = np.zeros(self.layout.n_hosts, np.int64)
            np.maximum.at(most, host, cols["sched_wait_ns"])
            cols["cpu_pressure_ns"] = most[host]
        return cols

    def kernels(self, res: StepResult) -> list[Cols]:
        if not self.cfg.kernels or res.step % self.cfg.kernel_every:
            return []
        rng = np.random.default_rng([self.cfg.seed, res.step, 0x6E1])
        out = [c for s in res.segments if (c := self._segment_kernels(s, rng)) is not None]
        out += [c for g in res.ops if (c := self._nccl_kernels(g)) is not None]
        return out

    def _segment_kernels(self, seg: Segment, rng: np.random.Generator) -> Cols | None:
        keep = self._alive(seg.pos, seg.start) & np.isfinite(seg.dur)
        if not keep.any():
            return None
        pos, start, dur = seg.pos[keep], seg.start[keep], seg.dur[keep]
        ranks = self.ranks[pos]
        if seg.kind == PASS_OPT:
            names = np.full(len(pos), K_OPT)
            return self._kernel_cols(ranks, names, start, dur)
        km = seg.kmult[:, keep] * np.array([0.6, 0.25, 0.15])[:, None]
        share = km / km.sum(axis=0)
        kd = dur[None, :] * share * np.exp(0.02 * rng.standard_normal(share.shape))
        ks = start[None, :] + np.vstack([np.zeros(len(pos)), np.cumsum(kd, axis=0)[:-1]])
        gemm = K_GEMM_A if seg.index % 2 == 0 else K_GEMM_B
        flash = K_FLASH_F if seg.kind == PASS_F else K_FLASH_B
        names = np.repeat(np.array([gemm, flash, K_ELT])[:, None], len(pos), axis=1).ravel()
        ks, kd = ks.ravel(), kd.ravel()
        live = ks < np.tile(self.death[pos], 3)  # a process that died mid-segment stops
        return self._kernel_cols(np.tile(ranks, 3)[live], names[live], ks[live], kd[live])

    def _nccl_kernels(self, g: OpGroup) -> Cols | None:
        keep = self._alive(g.pos, g.t_start) & self._alive(g.pos, g.t_end)
        if not keep.any():
            return None
        ranks = self.ranks[g.pos[keep]]
        start, end = g.t_start[keep], g.t_end[keep]
        names = np.full(len(ranks), _NCCL_KERNEL[g.comm])
        return self._kernel_cols(ranks, names, start, end - start, stream=g.stream)

    def _kernel_cols(self, ranks: np.ndarray, names: np.ndarray, start: np.ndarray,
                     dur: np.ndarray, stream: int = 0) -> Cols:
        return {
            "rank": ranks,
            "stream": np.full(len(ranks), stream, np.int64),
            "kernel": (names, KERNEL_NAMES),
            "t_start": self.clock.ns(start, ranks),
            "duration": np.maximum(np.rint(dur * 1e9), 1).astype(np.int64),
        }

    def step_records(self, res: StepResult) -> list[tuple[str, Cols]]:
        out: list[tuple[str, Cols]] = []
        for g in res.ops:
            if (c := self.ops(g)) is not None:
                out.append(("ops", c))
            if (c := self.flows(g)) is not None:
                out.append(("flows", c))
        if (c := self.stages(res)) is not None:
            out.append(("stages", c))
        out += [("kernels", c) for c in self.kernels(res)]
        return out


def comm_dictionary(layout: Layout, anonymous: bool = False
                    ) -> tuple[list[str], dict[str, np.ndarray]]:
    """One comm_id dictionary for every kind, and per kind the codes of each grid position;
    `anonymous`: the ids a tracer gives groups nobody named (`pg1`, `pg2`, … in this order)."""
    names: list[str] = []
    codes: dict[str, np.ndarray] = {}
    for kind, kind_names in layout.comm_names.items():
        codes[kind] = layout.comm_codes[kind].ravel() + len(names)
        names += kind_names
    if anonymous:
        names = [f"pg{i + 1}" for i in range(len(names))]
    return names, codes


def anonymous_topology(topo: JobTopology, layout: Layout) -> JobTopology:
    """The topology a tracer publishes when the launcher declared no shape (RANKWATCH_TP/PP/DP/
    MICROBATCHES unset): every rank data-parallel, one microbatch, no schedule, and every group
    an unnamed `pgN` of kind dp (the tracer's default role) — only `world` keeps its name; no
    group of one rank (a script creates none)."""
    plain, _ = comm_dictionary(layout)
    anon, _ = comm_dictionary(layout, True)
    rename = dict(zip(plain, anon, strict=True))
    comms = [c.model_dump() if c.comm_id == "world" else
             {**c.model_dump(), "comm_id": rename.get(c.comm_id, c.comm_id), "kind": "dp"}
             for c in topo.communicators if len(c.members) > 1 or c.comm_id == "world"]
    return JobTopology.model_validate({**topo.model_dump(), "tp": 1, "pp": 1,
                                       "dp": topo.world_size, "microbatches": 1,
                                       "schedule": "none", "communicators": comms})


def finite_max(*arrays: np.ndarray) -> float:
    best = -math.inf
    for a in arrays:
        f = a[np.isfinite(a)]
        if len(f):
            best = max(best, float(f.max()))
    return best
