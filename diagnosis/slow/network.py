"""DP and TP communicators: per ring and step, the transfer time of its collectives — the
*shortest* time any member spent in each (the last arriver's; everyone else's includes waiting:
Mycroft Fig. 2, VenusTrace's AR node duration, §3.2.2) — compared across the job's rings of the
same kind (`judge`). Being the shortest member time, it does not rise when one member's compute
is slower (the others wait inside the op, the late one does not); a rise that follows some
rank's own slowdown is that rank's effect (`slow._explained_links`). TP groups are compared
only in jobs without chunk counters (`suspects`).
A job with fewer than `min_peers` rings gives no cross-ring verdict, only a change of a ring's
transfer time against its own noise (two rings are two samples). A job with one ring (DDP: its
default group is its DP ring, `data_parallel_only`) has nothing like it to compare: its change
must account for the job's rise while the ranks' CPU waits stayed as they were
(`context.lone_change`).

A ring flagged as slow is narrowed to one member (`ring_member`): the member that arrives last
while the others wait in its collectives (Mycroft Table 3 late start, clock-free: its time
inside the op is the shortest) is that member's host starting the op late; otherwise by its
chunk counters (Mycroft §5.3, Table 4 read over time): the member whose RDMA completions lag its
posts (② > ③) has a loaded link (nic_rdma); the member whose posts lag its staged data (① > ②)
has a slow NIC — unless its receiver is the ring's laggard in progress while staging nothing
ahead (①≈②), then the receiver's host side is slow (pcie_host). Without chunk counters the
whole ring is the suspect (`Suspicion.whole_ring`: the conclusion's confidence says so).
"""

from __future__ import annotations

import numpy as np

from diagnosis.columns import Columns, codes, col, ints
from diagnosis.conclusion import Suspicion
from diagnosis.rules.base import Component
from diagnosis.slow.context import BASELINE_FACTOR, Array, Ctx, from_job_start, judge

#: communicator kinds whose collectives are compared, and the stage a slower one names
KINDS = (("dp", "dp_allreduce"), ("tp", "tp_collectives"))


def suspects(ctx: Ctx) -> list[Suspicion]:
    """Slower DP rings; slower TP groups only in a job without chunk counters. A TP group
    inside a host (NVLink) slows with any member's PCIe or proxy as well as with its links,
    and no NIC carries it for the counters to narrow it: where counters exist, the member's
    DP ring names the member (its counters) better than its whole group could, and the group
    would outrun it — TP collectives are many per step, so their excess shows first (a
    simulated PCIe fault was named as its host's TP group this way). Without counters (gloo,
    a job traced without the NCCL plugin) the group's own rise is the only evidence there is
    of a slower link between its members, and it is named as a whole."""
    counters = bool(ctx.w.get("chunks"))
    return [s for kind, stage in KINDS if kind != "tp" or not counters
            for s in _rings(ctx, kind, stage)]


def _rings(ctx: Ctx, kind: str, stage: str) -> list[Suspicion]:
    ops = ctx.w.get("ops")
    if not ops:
        return []
    sel = ctx.ops_of_kind(kind) & ctx.ops_recent()
    if kind == "dp" and not sel.any() and data_parallel_only(ctx):
        sel = ctx.ops_of_kind("world") & ctx.ops_recent()
    if not sel.any():
        return []
    uniq, code = codes(col(ops, "comm_id"))
    used, ci = np.unique(code[sel], return_inverse=True)
    cu = uniq[used]
    step = ints(ops, "step", -1)[sel]
    dur = (ints(ops, "t_end") - ints(ops, "t_start"))[sel].astype(np.float64)
    # transfer time per (comm, op_seq): the shortest member time; then summed per (step, comm)
    seq = ints(ops, "op_seq")[sel]
    key = ci.astype(np.int64) * (int(seq.max()) + 1) + seq
    uk, kinv = np.unique(key, return_inverse=True)
    mn = np.full(uk.size, np.inf)
    np.minimum.at(mn, kinv, dur)
    first = np.zeros(uk.size, dtype=np.int64)
    first[kinv] = np.arange(kinv.size)
    m = comm_matrix(ctx, step[first], ci[first], mn, cu.size)
    members = ctx.w.grid.comm_members
    mine = np.asarray([ctx.confirm_links and bool(
        ctx.confirm & set(members.get(str(c), np.zeros(0)).tolist())) for c in cu.tolist()],
        dtype=bool)
    # peers: the rings of the same pipeline stage (other stages carry other gradients)
    pp_stage = np.asarray([int(ctx.stage_of[members[str(c)][0]]) if str(c) in members and
                           members[str(c)].size else -1 for c in cu.tolist()], dtype=np.int64)
    # at a job's start the ranks' threads are still being placed on the cores, and a CPU
    # transport's transfers with them: a ring's first steps show one placement, not its noise,
    # and its change needs twice the baseline a later one does, as a rank's CPU wait does
    # (`diagnosis.slow.cpu`). An 8-rank TP job's group of ranks 6 and 7, 3-13 ms a step over
    # the job's first 10 steps and 9-21 ms over the next 8, its job's step time unmoved, was
    # named `[6, 7] tp_collectives` at 0.6 ("absorbed", 6σ) 1.3 s before the job's fault
    least = BASELINE_FACTOR * ctx.cfg.min_baseline if from_job_start(ctx) else None
    v = judge(ctx, m, ctx.cfg.net_ratio, pp_stage, floor=ctx.cfg.net_abs_ns, job_gate=False,
              confirmable=mine, sparse=True, min_baseline=least)
    out = []
    against = "the other rings'" if cu.size > 1 else "its own before"
    for c in np.flatnonzero(v.flag).tolist():
        name = str(cu[c])
        x, comp, why, rule = ring_member(ctx, name)
        out.append(Suspicion(x, stage, comp, float(v.exc[c]),
                             ("venustrace.ar_node", *((rule,) if rule else ())),
                             f"{name}: transfer {v.ratio[c]:.2f}x {against}, "
                             f"+{v.exc[c] / 1e6:.1f} ms/step ({v.how[c]} {v.z[c]:.1f}σ); {why}",
                             float(v.z[c]), str(v.how[c]),
                             int(ctx.steps[v.since[c]]), whole_ring=len(x) > 1,
                             own_past=cu.size == 1 and v.how[c] == "change"))
    return out


def data_parallel_only(ctx: Ctx) -> bool:
    """Whether the job is data parallel and nothing else: no TP or PP declared, no pipeline
    its p2p pattern shows (`slow.peer_stages`) and no DP communicator of its own. Its ranks'
    default group ("world": a DDP job that names no group) is then its DP ring — as the trace
    importer reads it (ingest/importers/topology.py), and as the gradient all-reduce is."""
    g = ctx.w.grid
    return g.tp == 1 and g.pp == 1 and not g.comms("dp") and \
        bool(ctx.stage_of.size) and bool((ctx.stage_of == ctx.stage_of[0]).all())


def comm_matrix(ctx: Ctx, step: Array, comm: Array, value: Array, n_comms: int) -> Array:
    """float64 [recent steps, comms]: Σ value per (step, communicator), nan where none."""
    flat = ctx.step_index(step) * n_comms + comm
    n = ctx.steps.size * n_comms
    acc = np.bincount(flat, weights=value, minlength=n)
    seen = np.bincount(flat, minlength=n) > 0
    return np.where(seen, acc, np.nan).reshape(ctx.steps.size, n_comms)


def ring_member(ctx: Ctx, comm: str) -> tuple[tuple[int, ...], Component | None, str, str]:
    members = ctx.w.grid.comm_members.get(comm)
    ch = ctx.w.get("chunks")
    if members is None:
        return (), "nic_rdma", "no members", ""
    late = late_arriver(ctx, comm, members)
    if late is not None:
        return (late,), "host_software", (
            "it arrives last at the ring's collectives while the others wait in them (Mycroft "
            "Table 3 late start, clock-free: its time inside the op is the shortest) with no "
            "compute excess: its host/proxy starts the op late"), "mycroft.table3.late_start"
    if not ch:
        return tuple(int(r) for r in members), "nic_rdma", "no chunk counters: the whole ring", ""
    if len({ctx.w.grid.hosts[int(r)] for r in members}) == 1:
        # no NIC carries a ring inside one host: its counters cannot name a NIC
        return (tuple(int(r) for r in members), None,
                "the ring stays inside one host: no NIC to name, the whole ring", "")
    sel = is_comm(ch, comm) & (ints(ch, "ts") >= ctx.lo_ns)
    r = ints(ch, "rank")[sel]
    tot = np.maximum(ints(ch, "total_chunks")[sel], 1).astype(np.float64)
    g, t, d = (ints(ch, k)[sel] for k in ("gpu_ready", "rdma_transmitted", "rdma_done"))
    n = members.size
    pos = np.full(ctx.w.grid.world, -1)
    pos[members] = np.arange(n)
    p = pos[r]
    ok = p >= 0
    cnt = np.maximum(np.bincount(p[ok], minlength=n), 1)
    gt = np.bincount(p[ok], weights=((g - t) / tot)[ok], minlength=n) / cnt
    td = np.bincount(p[ok], weights=((t - d) / tot)[ok], minlength=n) / cnt
    prog = np.bincount(p[ok], weights=(d / tot)[ok], minlength=n) / cnt
    i_td = int(np.argmax(td))
    if td[i_td] >= 0.02 and td[i_td] >= 3 * np.median(td) + 1e-9:
        return (int(members[i_td]),), "nic_rdma", "its RDMA completions lag its posts (2 > 3)", \
            "mycroft.table4.temporal"
    i_gt = int(np.argmax(gt))
    recv = (i_gt + 1) % n
    if prog[recv] <= prog.min() + 1e-9 and gt[recv] <= np.median(gt):
        return (int(members[recv]),), "pcie_host", (
            "it is the ring's laggard with its posts keeping up with staging (1 = 2): the host "
            "side (PCIe) of the rank, its kernels are normal"), "mycroft.table4.temporal"
    return ((int(members[i_gt]),), "nic_rdma", "its NIC posts lag its staged data (1 > 2)",
            "mycroft.table4.temporal")


def is_comm(cols: Columns, comm: str) -> Array:
    """Mask of the rows on communicator `comm` (through the column's memoized codes)."""
    uniq, code = codes(col(cols, "comm_id"))
    j = int(np.searchsorted(uniq, comm))
    if j >= uniq.size or str(uniq[j]) != comm:
        return np.zeros(code.size, dtype=bool)
    return np.asarray(code == j)


def late_arriver(ctx: Ctx, comm: str, members: Array) -> int | None:
    """The member whose median time inside the ring's recent ops is below half the others'."""
    ops = ctx.w.get("ops")
    sel = is_comm(ops, comm) & ctx.ops_recent()
    r = ints(ops, "rank")[sel]
    inside = (ints(ops, "t_end") - ints(ops, "t_start"))[sel].astype(np.float64)
    med = np.asarray([np.median(inside[r == m]) if (r == m).any() else np.nan
                      for m in members.tolist()])
    if np.isnan(med).any() or med.size < 2:
        return None
    i = int(np.argmin(med))
    others = np.delete(med, i)
    return int(members[i]) if med[i] < 0.5 * float(np.median(others)) else None


