"""A job's parallel grid as arrays: each rank's (dp, pp, tp) position and its communicators.

Root-cause rules reason about "the TP group of rank r" or "PP stage s of replica d"; this module
answers those questions from a `JobTopology` once, as int64 arrays, so rules stay vectorized.

Positions come from the topology's communicators when it lists them: a rank's PP stage is its
index in the member list of its `pp` communicator (members are listed in stage order), its DP
index is its index in its `dp` communicator and its TP index its index in its `tp` communicator.
A topology without communicators falls back to Megatron's default order (TP fastest, then CP,
DP, PP slowest: rank = t + tp·(c + cp·(d + dp·s))) and synthesizes communicators named like the
simulator's (`tp:pp{s}:dp{d}`, `pp:dp{d}:tp{t}`, `dp:pp{s}:tp{t}`); CP ranks are folded into
the DP index in that case (cp > 1 is not modelled by any rule yet).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ingest.records import JobTopology, comm_kind, comm_kinds

Array = np.ndarray


@dataclass(frozen=True)
class Grid:
    """Positions (int64 arrays indexed by rank) and communicators of one job."""

    tp: int
    pp: int
    dp: int
    stage: Array  # pp index of each rank
    dp_index: Array
    tp_index: Array
    hosts: tuple[str, ...]
    #: comm_id -> kind, as the topology declares (or the synthesized communicators are);
    #: which kind any comm_id is: `kind_of`
    comm_kind: dict[str, str]
    comm_members: dict[str, Array]  # comm_id -> member ranks in communicator order

    @property
    def world(self) -> int:
        return int(self.stage.size)

    def kind_of(self, comm_id: str) -> str:
        """The kind of a communicator ("" when unknown): the one decision, ingest.records
        `comm_kind` — the kind declared here, else the kind the comm_id's name gives."""
        return comm_kind(comm_id, self.comm_kind)

    def kinds_of(self, comm_ids: Iterable[object]) -> Array:
        """`kind_of` each of distinct comm_ids (object array)."""
        return comm_kinds(comm_ids, self.comm_kind)

    def comms(self, kind: str) -> list[str]:
        """comm_ids of one kind, in topology order."""
        return [c for c, k in self.comm_kind.items() if k == kind]

    def comm_of(self, kind: str) -> Array:
        """object array [world]: the comm_id of each rank's communicator of `kind` ('' if none)."""
        out = np.full(self.world, "", dtype=object)
        for c in self.comms(kind):
            out[self.comm_members[c]] = c
        return out

    def rank_at(self, d: int, s: int, t: int) -> int:
        """The rank at grid position (dp index d, stage s, tp index t); -1 if there is none."""
        hit = np.flatnonzero((self.dp_index == d) & (self.stage == s) & (self.tp_index == t))
        return int(hit[0]) if hit.size else -1

    def replica_grid(self) -> Array:
        """int64 [dp, pp, tp] of ranks (-1 where the topology leaves a hole)."""
        g = np.full((self.dp, self.pp, self.tp), -1, dtype=np.int64)
        ok = (self.dp_index < self.dp) & (self.stage < self.pp) & (self.tp_index < self.tp)
        r = np.flatnonzero(ok)
        g[self.dp_index[r], self.stage[r], self.tp_index[r]] = r
        return g


def _megatron(topo: JobTopology) -> tuple[Array, Array, Array]:
    r = np.arange(topo.world_size, dtype=np.int64)
    t = r % topo.tp
    rest = r // topo.tp
    d = rest % (topo.dp * topo.cp)
    s = rest // (topo.dp * topo.cp)
    return s, d, t


def _synth_comms(topo: JobTopology, s: Array, d: Array, t: Array) -> dict[str, tuple[str, Array]]:
    out: dict[str, tuple[str, Array]] = {}
    dpx = topo.dp * topo.cp
    for di in range(dpx):
        for si in range(topo.pp):
            m = np.flatnonzero((d == di) & (s == si))
            out[f"tp:pp{si}:dp{di}"] = ("tp", m[np.argsort(t[m])])
    for di in range(dpx):
        for ti in range(topo.tp):
            m = np.flatnonzero((d == di) & (t == ti))
            out[f"pp:dp{di}:tp{ti}"] = ("pp", m[np.argsort(s[m])])
    for si in range(topo.pp):
        for ti in range(topo.tp):
            m = np.flatnonzero((s == si) & (t == ti))
            out[f"dp:pp{si}:tp{ti}"] = ("dp", m[np.argsort(d[m])])
    return out


def grid_of(topo: JobTopology) -> Grid:
    """Build the `Grid` of a topology (see the module docstring for how positions are found)."""
    s, d, t = _megatron(topo)
    comms = {c.comm_id: (str(c.kind), np.asarray(c.members, dtype=np.int64))
             for c in topo.communicators}
    if not comms:
        comms = _synth_comms(topo, s, d, t)
    for kind, pos in (("pp", s), ("dp", d), ("tp", t)):
        for k, members in comms.values():
            if k == kind:
                pos[members] = np.arange(members.size)
    return Grid(
        tp=topo.tp, pp=topo.pp, dp=topo.dp * topo.cp, stage=s, dp_index=d, tp_index=t,
        hosts=tuple(topo.hosts), comm_kind={c: k for c, (k, _) in comms.items()},
        comm_members={c: m for c, (_, m) in comms.items()},
    )
