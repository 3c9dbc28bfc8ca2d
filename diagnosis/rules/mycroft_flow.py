"""Mycroft Table 3 op/flow-level rules for slowdowns, and Alg. 2's AnalyzeStragglerRootCause.

Table 3 (flow level): each flow should complete; each flow should take similar execution time;
each flow should start and end at a similar time. Alg. 2 (lines 11-19) walks each group's logs
and returns the rank with "constant late starts or ends" — the paper's example threshold is one
second (§5.2). In a synchronizing collective the rank that *starts* late is the cause; every
other member then *ends* late too because it waited (Fig. 2) — so late ends alone do not blame.

`late_starts` (ops rows of finished collectives, grouped by (comm_id, op_seq)):
- Lateness is measured without cross-host clocks: a member's time inside the op
  (t_end − t_start, one host's clock) is long when it waited and short when it arrived last, so
  lag_i = max_wait − wait_i is how much later rank i arrived than the first arrival. This is
  immune to the few-ms clock offsets DESIGN.md warns about — a constant offset would otherwise
  look exactly like a "constant late start". The cross-host start lag is kept as evidence.
- A member is late in an op when lag_i > max(`min_lag_ns`, `rel_lag` × the op's transfer time,
  i.e. the smallest wait in the group), and its cross-host start lag agrees (≥ lag_i − `skew_ns`):
  the clock-free lag alone cannot tell "started late" from "the others ended early". 1 s (the
  paper) is far too coarse for ms-scale TP ops; we scale with the op instead.
- "Constant": late in ≥ `persist` of the (comm, rank)'s ops in the window, over ≥ `min_ops` ops.
- Component: if the rank enqueued on time but started late (t_start − t_enqueue, one host's
  clock, accounts for most of its lag) the NCCL proxy/host thread delayed it → host_software,
  label "late_launch" (Mycroft #7); otherwise it called late because the work before the
  collective was slow → gpu_compute, label "late_arrival" (Mycroft #3-#5; could be host CPU).
- A TP-level culprit explains its replica's lateness in DP/PP groups, so findings are ordered by
  group kind (tp first) and a rank's evidence lists every kind where it was late. When every
  rank of a pipeline replica is late, the replica was slowed inside its pipeline: one
  "replica_late" finding without a component replaces the per-rank ones (critical_path.py
  names the node and rank inside the replica).

`late_ends`: when nobody starts late, Mycroft compares completion times (#3/#4: "the abnormal
rank always finishes last"): end lag against the group's earliest end (cross-host; threshold
max(`skew_ns`, rel_lag × transfer time)), corroborated by the member's own longer time in the op
(one clock), same persistence; component left open (label "late_end"), for the chunk-state
rules to name.

`slow_flows` (flows rows): a flow taking more than (1 + `rel_flow`) × its op's median flow time
and `min_lag_ns` more, persistently on one path (rank, nic, channel, peer), blames that rank's
NIC path (nic_rdma); a flow that never completes while a sibling flow of its op did is the
failure rule (label "flow_incomplete").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnosis.columns import Columns, codes, col, group_key, ints
from diagnosis.groups import Grid
from diagnosis.rules.base import Component, Finding
from ingest.units import MILLISECOND as MS

Array = np.ndarray
KIND_ORDER = {"tp": 0, "cp": 1, "ep": 2, "pp": 3, "dp": 4, "world": 5}


@dataclass(frozen=True)
class FlowConfig:
    min_lag_ns: int = 2 * MS
    rel_lag: float = 0.5
    skew_ns: int = 5 * MS
    persist: float = 0.8
    min_ops: int = 3
    rel_flow: float = 1.0
    stuck_ns: int = 5_000 * MS


def _groups(ops: Columns, now_ns: int) -> tuple[Array, Array, int]:
    """Rows of finished collectives at `now_ns` and their (comm_id, op_seq) group ids."""
    t_end = ints(ops, "t_end")
    op = col(ops, "op", "AllReduce").astype(str)
    rows = np.flatnonzero((t_end > 0) & (t_end <= now_ns) & ~np.isin(op, ["Send", "Recv"]))
    _, cc = codes(col(ops, "comm_id"))
    cc = cc[rows]
    gid, _ = group_key(cc, ints(ops, "op_seq")[rows])
    return rows, gid, int(gid.max()) + 1 if gid.size else 0


def _persistent(flag: Array, rank: Array, comm: Array, cfg: FlowConfig,
                cc: Array | None = None) -> list[tuple[str, int, float, int]]:
    """(comm_id, rank, late fraction, ops) for (comm, rank) pairs late persistently (`cc`: the
    codes of `comm` when the caller has them)."""
    if cc is None:
        _, cc = codes(comm)
    key, first = group_key(cc, rank)
    n = np.bincount(key)
    late = np.bincount(key, weights=flag.astype(np.float64))
    frac = late / np.maximum(n, 1)
    hit = np.flatnonzero((n >= cfg.min_ops) & (frac >= cfg.persist))
    return [(str(comm[first[k]]), int(rank[first[k]]), float(frac[k]), int(n[k])) for k in hit]


def late_starts(ops: Columns, grid: Grid, now_ns: int,
                config: FlowConfig | None = None) -> list[Finding]:
    """Constant late starters (Alg. 2 lines 11-19) among finished collectives; see module doc."""
    cfg = config or FlowConfig()
    rows, gid, ng = _groups(ops, now_ns)
    if ng == 0:
        return []
    rank, comm = ints(ops, "rank")[rows], col(ops, "comm_id").astype(str)[rows]
    enq, start, end = (ints(ops, k)[rows] for k in ("t_enqueue", "t_start", "t_end"))
    wait = (end - start).astype(np.float64)
    hi, lo = np.full(ng, -np.inf), np.full(ng, np.inf)
    np.maximum.at(hi, gid, wait)
    np.minimum.at(lo, gid, wait)
    size = np.bincount(gid, minlength=ng)
    lag = hi[gid] - wait
    thr = np.maximum(cfg.min_lag_ns, cfg.rel_lag * lo[gid])
    first_start = np.full(ng, np.inf)
    np.minimum.at(first_start, gid, start.astype(np.float64))
    start_lag = start - first_start[gid]
    # the clock-free lag must agree with the cross-host start lag up to the skew tolerance;
    # otherwise the member did not start late, the others ended early (see late_ends)
    late = (lag > thr) & (size[gid] >= 2) & (start_lag >= lag - cfg.skew_ns)
    launch = (start - enq).astype(np.float64)
    by_rank: dict[int, list[tuple[str, float, int]]] = {}
    for c, r, frac, n in _persistent(late, rank, comm, cfg):
        by_rank.setdefault(r, []).append((c, frac, n))
    out: list[Finding] = []
    for r, hits in by_rank.items():
        mine = late & (rank == r) & np.isin(comm, [c for c, _, _ in hits])
        med_lag = float(np.median(lag[mine]))
        med_launch = float(np.median(launch[mine]))
        software = med_launch >= 0.5 * med_lag
        kinds = sorted({_kind_label(grid, c) for c, _, _ in hits},
                       key=lambda k: KIND_ORDER.get(k, 9))
        comp: Component = "host_software" if software else "gpu_compute"
        out.append(Finding(
            rule="mycroft.table3.late_start", culprit_ranks=(r,), kind="slowdown",
            stage=f"{kinds[0]} collectives", component=comp,
            score=max(f for _, f, _ in hits),
            labels=("late_start", "late_launch" if software else "late_arrival"),
            onset_ns=int(start[mine].min()),
            evidence={"groups": [{"comm_id": c, "late_fraction": round(f, 3), "ops": n}
                                 for c, f, n in hits][:16],
                      "kinds": kinds, "median_lag_ns": med_lag, "median_launch_ns": med_launch,
                      "median_start_lag_ns": float(np.median(start_lag[mine])),
                      "thresholds": {"min_lag_ns": cfg.min_lag_ns, "rel_lag": cfg.rel_lag,
                                     "persist": cfg.persist}},
        ))
    return _collapse_replicas(out, grid)


def _collapse_replicas(found: list[Finding], grid: Grid) -> list[Finding]:
    """A whole replica late in its DP collectives was delayed inside its pipeline: one finding
    for the replica (label "replica_late", no component) instead of blaming every rank; the
    critical-path rule names the node and rank inside it."""
    late = {f.culprit_ranks[0] for f in found}
    out: list[Finding] = []
    folded: set[int] = set()
    for d in range(grid.dp):
        members = {int(r) for r in np.flatnonzero(grid.dp_index == d)}
        if len(members) > 1 and members <= late:
            folded |= members
            out.append(Finding(rule="mycroft.table3.late_start", kind="slowdown",
                               culprit_ranks=tuple(sorted(members)), stage="pipeline replica",
                               score=0.5 * min(f.score for f in found
                                               if f.culprit_ranks[0] in members),
                               labels=("late_start", "replica_late"),
                               evidence={"replica": d, "see": "venustrace.critical_path"}))
    out += [f for f in found if f.culprit_ranks[0] not in folded]
    return sorted(out, key=lambda f: (KIND_ORDER.get(_first_kind(f), 9), -f.score))


def _kind_label(grid: Grid, comm: str) -> str:
    """How a finding names a communicator's kind: its kind (`Grid.kind_of`), and "world" for
    one of no known kind — a group of ranks the job did not say more about (KIND_ORDER puts it
    last)."""
    return grid.kind_of(comm) or "world"


def _first_kind(f: Finding) -> str:
    kinds = f.evidence.get("kinds")
    return str(kinds[0]) if isinstance(kinds, list) and kinds else "world"


def late_ends(ops: Columns, grid: Grid, now_ns: int,
              config: FlowConfig | None = None) -> list[Finding]:
    """Constant last finishers (Mycroft #3/#4) in groups where nobody starts late."""
    cfg = config or FlowConfig()
    rows, gid, ng = _groups(ops, now_ns)
    if ng == 0:
        return []
    rank, comm = ints(ops, "rank")[rows], col(ops, "comm_id").astype(str)[rows]
    start, end = ints(ops, "t_start")[rows], ints(ops, "t_end")[rows]
    wait = (end - start).astype(np.float64)
    lo_end, lo_wait = np.full(ng, np.inf), np.full(ng, np.inf)
    np.minimum.at(lo_end, gid, end.astype(np.float64))
    np.minimum.at(lo_wait, gid, wait)
    lag = end - lo_end[gid]
    # corroborated by the member's own (one-clock) time in the op, so a clock offset is not late
    late = (lag > np.maximum(cfg.skew_ns, cfg.rel_lag * lo_wait[gid])) \
        & (wait - lo_wait[gid] >= lag - cfg.skew_ns)
    starters = [r for f in late_starts(ops, grid, now_ns, cfg) for r in f.culprit_ranks]
    waited = {str(c) for c in np.unique(comm[np.isin(rank, starters)])}
    out: list[Finding] = []
    for c, r, frac, n in _persistent(late, rank, comm, cfg):
        if c in waited:  # a late starter explains every late end of its groups
            continue
        mine = late & (rank == r) & (comm == c)
        out.append(Finding(
            rule="mycroft.table3.late_end", culprit_ranks=(r,), kind="slowdown",
            stage=f"{_kind_label(grid, c)} collectives", component=None, score=frac,
            labels=("late_end",), onset_ns=int(end[mine].min()),
            evidence={"comm_id": c, "late_fraction": round(frac, 3), "ops": n,
                      "median_end_lag_ns": float(np.median(lag[mine])),
                      "thresholds": {"skew_ns": cfg.skew_ns, "rel_lag": cfg.rel_lag}},
        ))
    return sorted(out, key=lambda f: -f.score)


def _group_median(gid: Array, x: Array, ng: int) -> Array:
    """Median of the non-nan `x` of each group, vectorized (nan for a group with none)."""
    order = np.lexsort((x, gid))  # nan sorts last within each group
    g, v = gid[order], x[order]
    start = np.searchsorted(g, np.arange(ng))
    k = np.bincount(gid[~np.isnan(x)], minlength=ng)
    a = np.minimum(start + np.maximum(k - 1, 0) // 2, g.size - 1)
    b = np.minimum(start + k // 2, g.size - 1)
    return np.where(k > 0, (v[a] + v[b]) / 2, np.nan)


def slow_flows(flows: Columns, now_ns: int, config: FlowConfig | None = None) -> list[Finding]:
    """Table 3 flow rules: similar flow times (persistent outliers) and every flow completes."""
    cfg = config or FlowConfig()
    t_start, t_end = ints(flows, "t_start"), ints(flows, "t_end")
    _, cc = codes(col(flows, "comm_id"))
    gid, _ = group_key(cc, ints(flows, "op_seq"))
    if gid.size == 0:
        return []
    ng = int(gid.max()) + 1
    rank = ints(flows, "rank")
    nic_names, nic = codes(col(flows, "nic", ""))
    done = (t_end > 0) & (t_end <= now_ns)
    dur = np.where(done, t_end - t_start, np.nan).astype(np.float64)
    med = _group_median(gid, dur, ng)
    slow = done & (dur > (1 + cfg.rel_flow) * med[gid]) & (dur - med[gid] > cfg.min_lag_ns)
    any_done = np.bincount(gid, weights=done.astype(np.float64), minlength=ng) > 0
    stuck = ~done & (now_ns - t_start > cfg.stuck_ns) & any_done[gid]
    out: list[Finding] = []
    # one (nic, channel, peer) path: a persistent flow; its name is formatted once per path
    chan, dest = ints(flows, "channel", 0), ints(flows, "peer", -1)
    pkey, pfirst = group_key(nic, chan, dest)
    names = np.asarray([f"{nic_names[nic[i]]}|{chan[i]}|{dest[i]}" for i in pfirst.tolist()],
                       dtype=object)
    _, pcode = codes(names)
    for c, r, frac, n in _persistent(slow, rank, names[pkey], cfg, pcode[pkey]):
        nic_name, channel, peer = c.split("|")
        out.append(Finding(rule="mycroft.table3.slow_flow", culprit_ranks=(r,), kind="slowdown",
                           component="nic_rdma", score=frac, labels=("slow_flow",),
                           evidence={"nic": nic_name, "channel": int(channel), "peer": int(peer),
                                     "slow_fraction": round(frac, 3), "flows": n}))
    for r in np.unique(rank[stuck]).tolist():
        s = stuck & (rank == r)
        out.append(Finding(rule="mycroft.table3.flow_incomplete", culprit_ranks=(int(r),),
                           kind="hang", component="nic_rdma", score=1.0,
                           labels=("flow_incomplete",), onset_ns=int(t_start[s].min()),
                           evidence={"peers": sorted(set(ints(flows, "peer")[s].tolist()))[:16],
                                     "nics": sorted(set(nic_names[nic[s]].tolist()))[:8]}))
    return sorted(out, key=lambda f: -f.score)
