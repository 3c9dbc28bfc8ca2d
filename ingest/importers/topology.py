"""The job topology of an import: from the communicators the files show, or `--tp/--pp/--dp`.

Diagnosis needs a job's topology (`rw.jobs`) before it looks at the job, and imported files carry
no topology record — but they name communicators and their members: Flight Recorder's
`pg_config`, Kineto's process-group ranks, NCCL's commId, MegaTrace's groupHash or linked streams
(ingest/importers/megatrace.py). `infer` turns that into a `JobTopology` and says in words how.

A communicator's kind, first match wins:
1. sizes known (given, or inferred in step 2): its members equal a TP, DP or PP group of the
   Megatron rank order (TP fastest, then DP, PP slowest — `ingest.records` `rank_order`);
2. its description names it (Megatron's "TENSOR_MODEL_PARALLEL_GROUP", "tp", "pipeline", …);
3. its shape: Send/Recv only → pp; every rank → world (dp when it is the only kind); a run of
   consecutive ranks → tp; otherwise dp.
Sizes: tp, dp, pp from the size of their communicators; the dimension no communicator showed
takes what is left of the world size — pp when the files hold Send/Recv calls, dp otherwise.
The inference is a best guess from what was logged; the printed line says what it assumed, and
`--tp/--pp/--dp` replace it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ingest.importers.common import Collected
from ingest.records import Communicator, JobTopology

_DESC = (("tp", re.compile(r"tensor|(^|[^a-z])tp([^a-z]|$)", re.I)),
         ("pp", re.compile(r"pipeline|(^|[^a-z])pp([^a-z]|$)", re.I)),
         ("ep", re.compile(r"expert|(^|[^a-z])ep([^a-z]|$)", re.I)),
         ("cp", re.compile(r"context|(^|[^a-z])cp([^a-z]|$)", re.I)),
         ("dp", re.compile(r"data|(^|[^a-z])dp([^a-z]|$)", re.I)))


#: comm_id of the every-rank communicator listed when the files name none
ALL_RANKS = "rankwatch:all-ranks"


class TopologyError(ValueError):
    """Sizes that do not fit the ranks seen (says which and what to pass instead)."""


@dataclass(frozen=True)
class Inferred:
    topology: JobTopology
    how: str  # one line for people


def _groups(world: int, tp: int, pp: int, dp: int) -> dict[str, set[tuple[int, ...]]]:
    """Megatron order: rank = t + tp·(d + dp·s)."""
    r = np.arange(world).reshape(pp, dp, tp)
    return {"tp": {tuple(map(int, r[s, d, :])) for s in range(pp) for d in range(dp)},
            "dp": {tuple(map(int, r[s, :, t])) for s in range(pp) for t in range(tp)},
            "pp": {tuple(map(int, r[:, d, t])) for d in range(dp) for t in range(tp)}}


def _shape_kind(members: list[int], world: int, p2p_only: bool) -> str | None:
    n = len(members)
    if n < 2:
        return None
    if p2p_only:
        return "pp"
    if n == world:
        return "world"
    if members == list(range(members[0], members[0] + n)):
        return "tp"
    return "dp"


def _kinds(c: Collected, world: int, sizes: tuple[int, int, int] | None,
           p2p: set[str]) -> dict[str, str]:
    grid = _groups(world, *sizes) if sizes else {}
    out: dict[str, str] = {}
    for comm, ranks in c.members.items():
        members = sorted(ranks)
        if len(members) < 2 or members[-1] >= world:
            continue
        key = tuple(members)
        kind = next((k for k in ("tp", "dp", "pp") if key in grid.get(k, ())), None)
        if kind is None and len(members) == world and world > 1:
            kind = "world"
        if kind is None and not sizes:
            desc = c.descs.get(comm, "")
            kind = next((k for k, rx in _DESC if rx.search(desc)), None) \
                or _shape_kind(members, world, comm in p2p)
        if kind is not None:
            out[comm] = kind
    return out


def _size(c: Collected, kinds: dict[str, str], kind: str) -> int | None:
    n = Counter(len(c.members[m]) for m, k in kinds.items() if k == kind)
    return n.most_common(1)[0][0] if n else None


def infer(c: Collected, job: str, ts: int, *, tp: int | None = None, pp: int | None = None,
          dp: int | None = None) -> Inferred:
    ops = c.cols.get("ops") or {}
    ranks = set(ops.get("rank", ())) | set((c.cols.get("kernels") or {}).get("rank", ()))
    world = max([c.world, max(ranks, default=-1) + 1]
                + [max(m) + 1 for m in c.members.values() if m])
    if world < 1:
        raise TopologyError("no ranks in the files")
    names, comm = np.asarray(ops.get("op", []), dtype=object), ops.get("comm_id", [])
    p2p_rows = np.isin(names, ("Send", "Recv"))
    has_p2p = bool(p2p_rows.any())
    coll = {str(x) for x, p in zip(comm, p2p_rows, strict=True) if not p}
    p2p = {str(x) for x in comm} - coll
    given = {"tp": tp, "pp": pp, "dp": dp}
    how: list[str] = []
    kinds = _kinds(c, world, None, p2p)
    found = {k: _size(c, kinds, k) for k in ("tp", "pp", "dp")}
    only_world = set(kinds.values()) == {"world"}
    if only_world:
        found["dp"] = world
    size = {k: given[k] or found[k] for k in ("tp", "pp", "dp")}
    for k in ("tp", "pp", "dp"):
        if given[k]:
            how.append(f"{k} {given[k]} (given)")
        elif found[k] and k == "dp" and only_world:
            how.append(f"dp {world} (the only communicator holds every rank)")
        elif found[k]:
            n = sum(1 for v in kinds.values() if v == k)
            how.append(f"{k} {found[k]} ({n} {k.upper()} communicator(s))")
    unknown = [k for k in ("tp", "pp", "dp") if not size[k]]
    known = int(np.prod([size[k] or 1 for k in ("tp", "pp", "dp")]))
    if world % known:
        raise TopologyError(f"tp×pp×dp = {known} does not divide the world size {world} "
                            "seen in the files; pass --tp, --pp and --dp")
    rest = world // known
    if "tp" in unknown:
        size["tp"] = 1
        how.append("tp 1 (no TP communicator)")
    if "pp" in unknown and "dp" in unknown:
        # p2p calls beside a known TP grid are a pipeline; with nothing known, the commonest
        # job (plain data parallel) is assumed
        pipeline = has_p2p and "tp" not in unknown
        fill, other = ("pp", "dp") if pipeline else ("dp", "pp")
        size[fill], size[other] = rest, 1
        why = "Send/Recv calls beside the TP groups" if pipeline else \
            "assumed data parallel: no PP or DP communicator identified"
        how.append(f"{fill} {rest} (the rest of {world} ranks; {why})")
    elif unknown and unknown != ["tp"]:
        k = next(k for k in unknown if k != "tp")
        size[k] = rest
        how.append(f"{k} {rest} (the rest of {world} ranks)")
    elif rest != 1:
        raise TopologyError(f"tp×pp×dp = {known} but the files show {world} ranks; "
                            "pass --tp, --pp and --dp")
    sizes = (size["tp"] or 1, size["pp"] or 1, size["dp"] or 1)
    kinds = {**kinds, **_kinds(c, world, sizes, p2p)}
    if sizes[0] == sizes[1] == 1:
        kinds = {k: "dp" if v == "world" else v for k, v in kinds.items()}
    comms = [Communicator(comm_id=k, kind=v, members=sorted(c.members[k]))  # type: ignore[arg-type]
             for k, v in sorted(kinds.items())]
    if not comms:
        # a topology without communicators is valid, but the worker cannot store one (its
        # empty arrays fail the jobs insert): list the group of every rank, which no rule reads
        comms = [Communicator(comm_id=ALL_RANKS, kind="world", members=list(range(world)))]
    hosts = [c.hosts.get(r, "unknown") for r in range(world)]
    topo = JobTopology(job_id=job, ts=ts, world_size=world, tp=sizes[0], pp=sizes[1],
                       dp=sizes[2], schedule="1f1b" if sizes[1] > 1 else "none", hosts=hosts,
                       communicators=comms)
    listed = Counter(v for v in kinds.values())  # what the files showed (not ALL_RANKS)
    comm_words = ", ".join(f"{n} {k}" for k, n in sorted(listed.items())) or "none"
    missing = sorted(set(range(world)) - ranks)
    line = (f"world {world} = tp {sizes[0]} × pp {sizes[1]} × dp {sizes[2]}: "
            + "; ".join(how) + f"; communicators: {comm_words}"
            + (f"; no records from {len(missing)} rank(s)" if missing else ""))
    return Inferred(topo, line)
