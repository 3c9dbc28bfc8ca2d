"""A job's pipeline shape from its point-to-point pattern, when the launcher did not declare it.

Without ``RANKWATCH_PP/DP/MICROBATCHES`` the ranks' sidecars show the process groups, not the
pipeline. The ops do: in pipeline parallelism each stage exchanges activations and gradients with
its neighbours only, so the graph "rank r sent to or received from rank p" is a set of disjoint
chains, one per model replica (per DP × TP position), each `pp` ranks long, in stage order.

- **Stage order.** A chain's two ends are the first and the last stage; the first stage is the
  end whose first point-to-point call of a step is a Send (it feeds activations forward), the last
  one's is a Recv. When the ends cannot be told apart that way the lower rank goes first.
- **DP / TP.** The chains give tp·dp (their number). Groups the ranks created whose members all
  sit at one stage split it: with TP groups (named with ``name_group(pg, "tp")``) tp is their
  size; otherwise the largest such group (the DP all-reduce group) gives dp and the rest is tp;
  without any, dp is the number of chains.
- **Microbatches.** A stage sends one activation (forward) or one gradient (backward) per
  microbatch to each neighbour, so the sends from one rank to one peer in one complete step are
  the microbatch count (the median over ranks, peers and steps).

`P2PLog` accumulates what the agent drains (vectorized per drain, a few dict updates per distinct
(rank, peer, step)); `infer_pipeline` is pure. Both see the ranks of this host only, like the
sidecars the topology is built from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: complete steps remembered per rank (sends per step, first op of a step)
KEEP_STEPS = 8
#: p2p pairs remembered per job: a pipeline has ~2 per rank; a producer writing nonsense peers
#: must not grow the agent without bound
MAX_PAIRS = 1 << 16


@dataclass(frozen=True)
class PipelineShape:
    pp: int
    dp: int
    tp: int
    microbatches: int | None  # None: no complete step seen yet
    chains: tuple[tuple[int, ...], ...]  # one per replica, ranks in stage order
    megatron_order: bool  # stage of every rank == rank // (tp·dp): no pp communicator needed

    def describe(self) -> str:
        m = "?" if self.microbatches is None else str(self.microbatches)
        shown = ", ".join("→".join(map(str, c)) for c in self.chains[:4])
        more = f" (+{len(self.chains) - 4} more)" if len(self.chains) > 4 else ""
        return (f"pp={self.pp} dp={self.dp} tp={self.tp} microbatches={m}; "
                f"chains {shown}{more}")


class P2PLog:
    """What one job's drained ops show of its point-to-point pattern (module docstring)."""

    def __init__(self) -> None:
        self.edges: set[tuple[int, int]] = set()  # (low rank, high rank)
        self.sends: dict[tuple[int, int], dict[int, int]] = {}  # (rank, peer) -> step -> sends
        self.first: dict[int, dict[int, tuple[int, bool]]] = {}  # rank -> step -> (t, is_send)
        self.last_step: dict[int, int] = {}  # rank -> highest step seen

    def observe(self, ops: Mapping[str, np.ndarray]) -> None:
        """Completed Send/Recv rows of an `ops` column batch (rank, op, peer, step, t_start,
        t_end); anything else is ignored."""
        peer = np.asarray(ops.get("peer", ()), dtype=np.int64)
        if not peer.size:
            return
        cand = np.flatnonzero(peer >= 0)  # collectives carry -1: an int filter first
        if not cand.size:
            return
        op = np.asarray(ops["op"], dtype=object)[cand]
        is_send = op == "Send"
        keep = (is_send | (op == "Recv")) & (np.asarray(ops["t_end"])[cand] > 0) \
            & (np.asarray(ops["step"])[cand] >= 0)
        rows = cand[keep]
        if not rows.size:
            return
        is_send = is_send[keep]
        rank = np.asarray(ops["rank"], dtype=np.int64)[rows]
        peer = peer[rows]
        step = np.asarray(ops["step"], dtype=np.int64)[rows]
        t = np.asarray(ops["t_start"], dtype=np.int64)[rows]
        lo, hi = np.minimum(rank, peer), np.maximum(rank, peer)
        room = MAX_PAIRS - len(self.edges)
        if room > 0:
            order, head = _runs(hi, lo)
            pick = order[head][:room]
            self.edges.update((a, b) for a, b in zip(lo[pick].tolist(), hi[pick].tolist(),
                                                     strict=True) if a != b)
        if is_send.any():
            sr, sp, ss = rank[is_send], peer[is_send], step[is_send]
            order, head = _runs(ss, sp, sr)
            starts = np.flatnonzero(head)
            counts = np.diff(np.r_[starts, order.size])
            first = order[starts]
            for r, p, s_, n in zip(sr[first].tolist(), sp[first].tolist(), ss[first].tolist(),
                                   counts.tolist(), strict=True):
                per = self.sends.get((r, p))
                if per is None:
                    if len(self.sends) >= MAX_PAIRS:
                        continue
                    per = self.sends[(r, p)] = {}
                per[s_] = per.get(s_, 0) + n
                if len(per) > KEEP_STEPS + 1:
                    del per[min(per)]
        # the earliest p2p call per (rank, step) in this batch, then against what was seen
        order, head = _runs(t, step, rank, within=1)
        for i in order[head].tolist():
            r, s = int(rank[i]), int(step[i])
            per_rank = self.first.get(r)
            if per_rank is None:
                if len(self.first) >= MAX_PAIRS:
                    continue
                per_rank = self.first[r] = {}
            old = per_rank.get(s)
            if old is None or int(t[i]) < old[0]:
                per_rank[s] = (int(t[i]), bool(is_send[i]))
            if len(per_rank) > KEEP_STEPS + 1:
                del per_rank[min(per_rank)]
        # the highest step per rank: the last row of each rank's run in (step, rank) order
        order = np.lexsort((step, rank))
        last = np.r_[rank[order][1:] != rank[order][:-1], True]
        for r, s in zip(rank[order][last].tolist(), step[order][last].tolist(),
                        strict=True):  # per distinct rank
            if s > self.last_step.get(r, -1) and (r in self.last_step
                                                   or len(self.last_step) < MAX_PAIRS):
                self.last_step[r] = s

    def sends_per_step(self) -> list[int]:
        """Sends from one rank to one peer in each complete step (a later step was seen)."""
        out: list[int] = []
        for (r, _p), per in self.sends.items():
            last = self.last_step.get(r, -1)
            out.extend(n for s, n in per.items() if s < last)
        return out

    def first_is_send(self) -> dict[int, bool]:
        """Per rank: is its first p2p call of its most recent complete step a Send?"""
        out: dict[int, bool] = {}
        for r, per in self.first.items():
            done = [s for s in per if s < self.last_step.get(r, -1)]
            if done:
                out[r] = per[max(done)][1]
        return out


def _runs(*keys: np.ndarray, within: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(order, head): `np.lexsort(keys)` (the last key primary) and, over that order, whether
    each row starts a run of rows equal in every key after the first `within` (those only
    order the rows of a run). One sort, instead of `np.unique(axis=0)`, which sorts a row view
    and builds the unique rows: several times the cost on the few dozen rows of a drain."""
    order = np.lexsort(keys)
    if not order.size:
        return order, np.zeros(0, dtype=bool)
    same = np.ones(order.size - 1, dtype=bool)
    for k in keys[within:]:
        v = k[order]
        same &= v[1:] == v[:-1]
    return order, np.r_[True, ~same]


def chains_of(world: int, edges: Iterable[tuple[int, int]]) -> list[list[int]] | None:
    """The p2p graph's connected components as paths (end to end), or None when it is not a set
    of equal-length simple paths covering every rank (not a plain pipeline)."""
    adj: dict[int, set[int]] = {}
    for a, b in edges:
        if a == b or not (0 <= a < world and 0 <= b < world):
            continue
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set()).add(a)
    if len(adj) != world or any(len(n) > 2 for n in adj.values()):
        return None
    seen: set[int] = set()
    chains: list[list[int]] = []
    for start in sorted(adj):
        if start in seen or len(adj[start]) != 1:
            continue
        chain, prev, cur = [start], -1, start
        seen.add(start)
        while True:
            nxt = [n for n in adj[cur] if n != prev]
            if not nxt:
                break
            prev, cur = cur, nxt[0]
            chain.append(cur)
            seen.add(cur)
        chains.append(chain)
    if len(seen) != world or len({len(c) for c in chains}) != 1:
        return None  # a cycle (every rank of it has two neighbours), or uneven chains
    return chains


def infer_pipeline(world: int, edges: Iterable[tuple[int, int]],
                   first_is_send: Mapping[int, bool], sends_per_step: Sequence[int],
                   groups: Sequence[tuple[str, Sequence[int]]]) -> PipelineShape | None:
    """The pipeline shape (module docstring), or None when the p2p pattern is not a pipeline.

    `groups` are (kind, members) of the communicators the ranks created (the world group is
    ignored)."""
    chains = chains_of(world, edges)
    if chains is None:
        return None
    def score(rank: int) -> int:
        first = first_is_send.get(rank)
        return 0 if first is None else (1 if first else -1)

    oriented: list[tuple[int, ...]] = []
    for c in chains:
        a, b = score(c[0]), score(c[-1])
        flip = b > a or (a == b and c[-1] < c[0])
        oriented.append(tuple(c[::-1] if flip else c))
    oriented.sort()
    pp = len(oriented[0])
    stage = np.empty(world, dtype=np.int64)
    for chain in oriented:
        stage[list(chain)] = np.arange(pp)
    replicas = len(oriented)
    one_stage = [(kind, len(m)) for kind, m in groups
                 if kind != "world" and len(m) > 1
                 and len({int(stage[x]) for x in m if 0 <= x < world}) == 1]
    tp_sizes = {n for kind, n in one_stage if kind == "tp" and replicas % n == 0}
    dp_sizes = [n for kind, n in one_stage if kind != "tp" and replicas % n == 0]
    if len(tp_sizes) == 1:
        tp = tp_sizes.pop()
    elif dp_sizes:
        tp = replicas // max(dp_sizes)  # the DP groups span the replicas; the rest is TP
    else:
        tp = 1
    dp = replicas // tp
    m = int(np.median(sends_per_step)) if len(sends_per_step) else None
    megatron = bool((stage == np.arange(world) // (tp * dp)).all())
    return PipelineShape(pp, dp, tp, max(m, 1) if m is not None else None, tuple(oriented),
                         megatron)
