"""The persistent last arriver at a group's collectives (VenusTrace §3.2.1 and Alg. 2, line 26).

VenusTrace §3.2.1 ("Synchronous communication"): the ranks of a TP group call AllReduce when
their computation is done, and the collective is a barrier — "by comparing the start times of
the AllReduce calls, we can observe the completion status of the computations across different
ranks" (AllGather and ReduceScatter alike). Alg. 2, line 26, names the slow rank of a slow node
as the rank with the latest call in its TP group. VenusTrace applies it to one slow node of the
critical path; without stage records there is no critical path, so here every call of every
TP/DP-like communicator is one observation, and a rank is blamed only when it is last
*persistently*, judged against chance, noise and cost, over the recent half of the window's
calls (a fault that began mid-window is judged on the calls since; one that ended is not):

- **chance**: with g members and no culprit, each member is last in about 1/g of the calls. The
  number of calls k (of n) a member was last is tested with a one-sided binomial test against
  1/g, Bonferroni-corrected over every (communicator, member) tested (`alpha`). The share must
  also exceed 1/g by `min_excess` in each half of those calls, and those calls must span at
  least `min_span_ns` (15 s: several iterations of a large job) — a burst (the first
  iterations of a job, a hiccup) does not pass for a persistent straggler. VenusTrace's Alg. 2
  likewise takes no expectation from the first iteration;
- **noise**: how much later the last rank calls than the one before it (the "lead", what the
  others waited) also varies without a culprit. A candidate's mean lead when last (the wait it
  causes per call; a fault that began mid-window is diluted in a median) must be at least
  `noise_ratio` × the noise — the median lead over all calls of the other communicators of
  the same kind, or, with no other such communicator, over the calls of its own where another
  member was last (at least `min_calls` / 3 of them; otherwise no verdict);
- **cost**: the waiting it caused beyond the noise, Σ (lead − noise) over the calls where it was
  last, must be at least `min_wait_share` of the time those calls span: a rank that is
  habitually a fraction of a millisecond late costs its group nothing worth an incident.

A rank downstream of a slow one in the pipeline (it receives its activations late) is also late
at its own TP collectives, but by less than the rank it waits for; the findings are ordered by
the share of time their group waited on them (`score`), strongest first, and the analysis
names the first.

Assumptions: a call's start time is its API call time (MegaTrace, NCCL INFO lines, the
tracers' `t_start`); members compare their own clocks, so a communicator whose members' hosts
differ needs a lead above `clock_tolerance_ns` (clocks across hosts agree to a few ms only).
Unknown hosts: TP groups are taken as intra-node (Megatron places them on NVLink), other kinds
as possibly spanning hosts. Send/Recv are not barriers and are ignored; so are communicators of
every rank ("world"), whose calls gather pipeline stages that legitimately arrive at different
times. Calls not logged by every member are skipped (ring buffers drop, logs start late).

`score` is the total time the group waited on the culprit (Σ lead over calls where it was
last, ns); `evidence` holds n, k, the share, p, the lead and the noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import binom

from diagnosis.rules.base import Finding
from ingest.records import comm_kind
from ingest.units import MILLISECOND, SECOND

RULE = "venustrace.arrival_order"
#: communicator kind -> the stage its calls are (diagnosis vocabulary)
STAGE = {"tp": "tp_collectives", "cp": "tp_collectives", "ep": "tp_collectives",
         "dp": "dp_allreduce"}


@dataclass(frozen=True)
class ArrivalConfig:
    min_calls: int = 30
    alpha: float = 1e-3
    min_excess: float = 0.15
    noise_ratio: float = 2.0
    clock_tolerance_ns: int = 5 * MILLISECOND
    min_wait_share: float = 0.05
    min_span_ns: int = 15 * SECOND


DEFAULT = ArrivalConfig()


@dataclass(frozen=True)
class _Group:
    comm: str
    kind: str
    members: np.ndarray
    t: np.ndarray  # [calls, members] start times of calls every member logged


def _groups(rank: np.ndarray, comm: np.ndarray, seq: np.ndarray, t: np.ndarray,
            members: Mapping[str, np.ndarray], kinds: Mapping[str, str]) -> list[_Group]:
    out = []
    for c in np.unique(comm):
        kind, m = comm_kind(str(c), kinds), members.get(str(c))
        if kind not in STAGE or m is None or m.size < 2:
            continue
        rows = np.flatnonzero(comm == c)
        pos = np.full(int(max(m.max(), rank[rows].max())) + 1, -1, dtype=np.int64)
        pos[m] = np.arange(m.size)
        j = pos[rank[rows]]
        rows, j = rows[j >= 0], j[j >= 0]
        useq, i = np.unique(seq[rows], return_inverse=True)
        mat = np.full((useq.size, m.size), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(mat, (i, j), t[rows])
        full = (mat != np.iinfo(np.int64).max).all(axis=1)
        out.append(_Group(str(c), kind, m, mat[full]))
    return out


def _leads(g: _Group) -> tuple[np.ndarray, np.ndarray]:
    """(index of the last member, its lead over the one before) per call."""
    srt = np.sort(g.t, axis=1)
    return np.argmax(g.t, axis=1), srt[:, -1] - srt[:, -2]


def last_arrivers(rank: np.ndarray, comm: np.ndarray, seq: np.ndarray, op: np.ndarray,
                  t_start: np.ndarray, members: Mapping[str, np.ndarray],
                  kinds: Mapping[str, str], hosts: Sequence[str] = (),
                  cfg: ArrivalConfig = DEFAULT) -> list[Finding]:
    """Findings for the persistent last arrivers (module docstring), strongest first.
    `members` and `kinds`: the topology's communicators (comm_id -> ranks, declared kind)."""
    coll = ~np.isin(op.astype(str), ("Send", "Recv"))
    groups = [g for g in _groups(rank[coll], comm[coll], seq[coll], t_start[coll], members,
                                 kinds) if g.t.shape[0] >= cfg.min_calls]
    if not groups:
        return []
    leads = {g.comm: _leads(g) for g in groups}
    tests = sum(g.members.size for g in groups)
    out = []
    for g in groups:
        f = _judge(g, leads, groups, tests, hosts, cfg)
        out.extend(f)
    return sorted(out, key=lambda f: -f.score)


def _judge(g: _Group, leads: Mapping[str, tuple[np.ndarray, np.ndarray]], groups: list[_Group],
           tests: int, hosts: Sequence[str], cfg: ArrivalConfig) -> list[Finding]:
    """The members of one group that pass every test of the module docstring."""
    last, lead = leads[g.comm]
    order = np.argsort(g.t.min(axis=1), kind="stable")
    recent = order[order.size // 2:]
    recent = recent[lead[recent] > 0]  # ties name no one
    n = int(recent.size)
    if n < cfg.min_calls:
        return []
    others = [leads[h.comm][1] for h in groups if h.kind == g.kind and h.comm != g.comm]
    chance = 1.0 / g.members.size
    span = float(g.t[recent].max() - g.t[recent].min())
    if span < cfg.min_span_ns:
        return []  # a burst of a few iterations (start-up, a hiccup) is not persistence
    out = []
    for j, r in enumerate(g.members.tolist()):
        mine = recent[last[recent] == j]
        k = int(mine.size)
        q = n // 2
        shares = [float(np.mean(last[recent[:q]] == j)), float(np.mean(last[recent[q:]] == j))]
        if min(shares) < chance + cfg.min_excess:
            continue
        log_p = float(binom.logsf(k - 1, n, chance))  # ln P(X >= k); sf underflows
        if log_p + np.log(tests) >= np.log(cfg.alpha):
            continue
        theirs = recent[last[recent] != j]
        if others:
            noise = float(np.median(np.concatenate(others)))
        elif theirs.size >= cfg.min_calls // 3:
            noise = float(np.median(lead[theirs]))
        else:
            continue  # peer set too small: no verdict
        own = float(np.mean(lead[mine]))
        if own < cfg.noise_ratio * max(noise, 1.0):
            continue
        spans = {hosts[x] for x in g.members.tolist() if x < len(hosts)} - {"unknown"}
        cross_host = len(spans) > 1 or (not spans and g.kind != "tp")
        if cross_host and own < cfg.clock_tolerance_ns:
            continue
        excess = float(np.clip(lead[mine] - noise, 0, None).sum())
        if excess < cfg.min_wait_share * span:
            continue
        out.append(Finding(
            rule=RULE, culprit_ranks=(r,), stage=STAGE[g.kind], score=excess / span,
            kind="slowdown",
            onset_ns=int(g.t[mine, j].min()), labels=("last_arriver",),
            evidence={"comm_id": g.comm, "members": g.members.tolist()[:16], "calls": n,
                      "last": k, "share": round(k / n, 3), "chance": round(chance, 3),
                      "log10_p": round(log_p / np.log(10), 1),
                      "lead_ms": round(own / 1e6, 3), "noise_ms": round(noise / 1e6, 3),
                      "wait_share": round(excess / span, 3)}))
    return out
