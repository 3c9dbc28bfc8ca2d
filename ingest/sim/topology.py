"""Job layout: Megatron rank order, rank→host map, communicators, and the topology record.

Megatron orders ranks with TP fastest, then CP, EP, DP and PP slowest. With cp = 1 (the simulator
does not model context parallelism) a rank is

    rank = tp_idx + tp * (dp_idx + dp * pp_idx)

and `grid[dp_idx, pp_idx, tp_idx]` is that rank. Hosts hold `ranks_per_host` consecutive ranks
(8 by default), so a TP group of up to 8 stays on one host and talks over NVLink while PP and DP
neighbours usually sit on other hosts and talk through the NIC of their GPU.

EP is carved out of DP (ep must divide dp); it appears in the topology record and its
communicators, but the simulator sends no expert-parallel traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ingest.records import Communicator, JobTopology


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1
    ranks_per_host: int = 8

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "ranks_per_host"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def n_hosts(self) -> int:
        return -(-self.world // self.ranks_per_host)

    @cached_property
    def grid(self) -> np.ndarray:
        """int64 array [dp, pp, tp] of ranks in Megatron order."""
        d = np.arange(self.dp)[:, None, None]
        s = np.arange(self.pp)[None, :, None]
        t = np.arange(self.tp)[None, None, :]
        return np.asarray(t + self.tp * (d + self.dp * s), dtype=np.int64)

    @cached_property
    def host_of(self) -> np.ndarray:
        """int64 array [world]: host index of each rank."""
        return np.arange(self.world, dtype=np.int64) // self.ranks_per_host

    @cached_property
    def host_grid(self) -> np.ndarray:
        """int64 array [dp, pp, tp]: host index of each grid position."""
        return np.asarray(self.host_of[self.grid])

    def host_name(self, host: int) -> str:
        return f"node{host:04d}"

    def nic_name(self, rank: int) -> str:
        return f"mlx5_{rank % self.ranks_per_host}"

    def position(self, rank: int) -> tuple[int, int, int]:
        """(dp_idx, pp_idx, tp_idx) of a rank."""
        t = rank % self.tp
        rest = rank // self.tp
        return rest % self.dp, rest // self.dp, t

    # Communicator ids, stable across runs: one per group, named by the fixed coordinates.
    def tp_comm(self, d: int, s: int) -> str:
        return f"tp:pp{s}:dp{d}"

    def pp_comm(self, d: int, t: int) -> str:
        return f"pp:dp{d}:tp{t}"

    def dp_comm(self, s: int, t: int) -> str:
        return f"dp:pp{s}:tp{t}"

    @cached_property
    def comm_names(self) -> dict[str, list[str]]:
        """Per kind, the comm_id dictionary; `comm_codes` indexes into it."""
        return {
            "tp": [self.tp_comm(d, s) for d in range(self.dp) for s in range(self.pp)],
            "pp": [self.pp_comm(d, t) for d in range(self.dp) for t in range(self.tp)],
            "dp": [self.dp_comm(s, t) for s in range(self.pp) for t in range(self.tp)],
        }

    @cached_property
    def comm_codes(self) -> dict[str, np.ndarray]:
        """Per kind, int64 [dp, pp, tp]: index of each grid position's communicator in
        `comm_names[kind]`."""
        d = np.arange(self.dp)[:, None, None]
        s = np.arange(self.pp)[None, :, None]
        t = np.arange(self.tp)[None, None, :]
        shape = (self.dp, self.pp, self.tp)
        return {
            "tp": np.broadcast_to(d * self.pp + s, shape).astype(np.int64),
            "pp": np.broadcast_to(d * self.tp + t, shape).astype(np.int64),
            "dp": np.broadcast_to(s * self.tp + t, shape).astype(np.int64),
        }

    def communicators(self) -> list[Communicator]:
        g = self.grid
        out: list[Communicator] = []
        for d in range(self.dp):
            for s in range(self.pp):
                out.append(Communicator(comm_id=self.tp_comm(d, s), kind="tp",
                                        members=g[d, s, :].tolist()))
        for d in range(self.dp):
            for t in range(self.tp):
                out.append(Communicator(comm_id=self.pp_comm(d, t), kind="pp",
                                        members=g[d, :, t].tolist()))
        for s in range(self.pp):
            for t in range(self.tp):
                out.append(Communicator(comm_id=self.dp_comm(s, t), kind="dp",
                                        members=g[:, s, t].tolist()))
        if self.ep > 1:  # EP groups: consecutive blocks of ep DP replicas
            for s in range(self.pp):
                for t in range(self.tp):
                    for e in range(self.dp // self.ep):
                        members = g[e * self.ep:(e + 1) * self.ep, s, t].tolist()
                        out.append(Communicator(comm_id=f"ep:pp{s}:tp{t}:e{e}", kind="ep",
                                                members=members))
        out.append(Communicator(comm_id="world", kind="world",
                                members=list(range(self.world))))
        return out

    def topology(self, job_id: str, ts: int, microbatches: int) -> JobTopology:
        return JobTopology(
            job_id=job_id, ts=ts, world_size=self.world, tp=self.tp, pp=self.pp, dp=self.dp,
            ep=self.ep, microbatches=microbatches, schedule="1f1b" if self.pp > 1 else "none",
            hosts=[self.host_name(int(h)) for h in self.host_of],
            communicators=self.communicators(),
        )
