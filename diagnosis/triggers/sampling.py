"""Which ranks the always-on triggers watch (Mycroft §4.3, "Real-time Trigger Mechanism").

Mycroft samples "at least one rank per DP group" and "at most 10 ranks" per job, relying on the
observation that a failure or slowdown cascades to the whole job within a few hundred ms through
inter-group dependencies (§4.1), so any sampled rank soon shows it.

A DP group here is a `dp` communicator of the topology (the ranks that all-reduce the same
gradient shard: same PP stage and TP index across replicas); there are pp × tp of them.

The paper's two rules conflict as soon as pp × tp > 10 (e.g. TP=8, PP=2 already has 16 DP
groups — its own testbed). We resolve it explicitly:
1. pp × tp ≤ max_ranks: one rank from every DP group (full coverage, as in the paper).
2. otherwise: max_ranks DP groups chosen round-robin over PP stages, so every PP stage is watched
   whenever pp ≤ max_ranks. An unwatched DP group (s, t) still reaches a watched one in one hop:
   its members' TP groups contain a rank of every DP group (s, t') of the same stage, and a stalled
   DP collective stalls the next TP collective of those ranks. `Sample.covered` lists which DP
   groups have a sampled member, so the caller can see the choice.

Determinism: members are ordered by a hash of (job_id, rank), groups by a hash of (job_id,
comm_id); the first alive member wins. Re-sampling after a death (`dead=`) therefore replaces
only the dead rank — every other group keeps its rank. The hash also spreads the sample across
hosts and TP positions instead of always picking rank 0 of each group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from diagnosis.groups import grid_of
from ingest.records import JobTopology

MAX_SAMPLED = 10  # Mycroft §4.3


@dataclass(frozen=True)
class Sample:
    """The sampled ranks of one job and what they cover."""

    job_id: str
    ranks: tuple[int, ...]  # ascending
    covered: tuple[str, ...]  # dp comm_ids with a sampled member
    dp_groups: int  # DP groups in the job
    stages: tuple[int, ...]  # PP stages with a sampled rank

    @property
    def full_coverage(self) -> bool:
        return len(self.covered) == self.dp_groups


def _h(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def sample_ranks(topo: JobTopology, dead: Iterable[int] = (),
                 max_ranks: int = MAX_SAMPLED) -> Sample:
    """Choose the sampled ranks of a job; `dead` ranks are never chosen (see module docstring)."""
    if max_ranks < 1:
        raise ValueError(f"max_ranks={max_ranks} must be >= 1")
    grid = grid_of(topo)
    dead_set = {int(r) for r in dead}
    groups = grid.comms("dp")
    if not groups:  # a topology with no DP communicator: the whole job is one group
        groups = ["world"]
        members = {"world": np.arange(grid.world, dtype=np.int64)}
    else:
        members = {c: grid.comm_members[c] for c in groups}
    by_stage: dict[int, list[str]] = {}
    for c in groups:
        by_stage.setdefault(int(grid.stage[members[c][0]]), []).append(c)
    for lst in by_stage.values():
        lst.sort(key=lambda c: _h(topo.job_id, c))
    chosen: list[str] = []
    depth = 0
    while len(chosen) < min(max_ranks, len(groups)):  # round-robin over stages
        for s in sorted(by_stage):
            if depth < len(by_stage[s]) and len(chosen) < max_ranks:
                chosen.append(by_stage[s][depth])
        depth += 1
    ranks: list[int] = []
    covered: list[str] = []
    for c in chosen:
        alive = [int(r) for r in members[c] if int(r) not in dead_set]
        if alive:
            ranks.append(min(alive, key=lambda r: _h(topo.job_id, r)))
            covered.append(c)
    ranks_arr = np.asarray(sorted(ranks), dtype=np.int64)
    return Sample(
        job_id=topo.job_id, ranks=tuple(int(r) for r in ranks_arr), covered=tuple(sorted(covered)),
        dp_groups=len(groups), stages=tuple(sorted({int(grid.stage[r]) for r in ranks_arr})),
    )


def needs_resample(sample: Sample, dead: Iterable[int]) -> bool:
    """True when a sampled rank is among `dead` (call `sample_ranks` again with them)."""
    return bool(set(sample.ranks) & {int(r) for r in dead})
