"""A culprit rank starved of CPU: the scheduler's own account, from the counters in its beats.

The host agent copies each rank's training-thread schedstat into every beat
(`ingest.records.Beat`: `sched_run_ns`, `sched_wait_ns`, cumulative). The share of wall time a
rank spent runnable but waiting for a CPU is Δwait / Δts between two of its beats. A rank whose
work got slower because other processes took its CPU (a busy neighbour, data-loader workers,
another job on the host) waits where it used to run; a rank whose device or code got slower
does not. Nothing else in the records separates the two on a host whose "device" work is CPU
work, and on a GPU host it separates a starved launcher from a slower GPU.

`refine` re-labels a slowdown suspect "host cpu" / host_software when, over the steps since its
onset, its wait share (for a suspect naming a host's ranks, each rank's) is at least `rise` ×
its own share before the onset plus `margin` and at least `rise` × its peers' median share
since the onset plus `margin` (peers under the same
contention — more runnable processes than cores everywhere — are not starved *relative* to
each other: no re-label), and its extra waiting accounts for at least half of its excess time
per step: the cause must be big enough to be the cause (a rank of 50 ms steps waiting 20 % of
the time where its peers wait 3 % loses about 9 ms a step to its CPU; a fixed floor on the
share would miss it on short steps and admit noise on long ones). "Before" is the time of the
judged baseline steps (from `base_from_ns`, the first judged step's start, taken from the
last beat at or before it): the same steps the slowdown verdict compared against. A baseline
reaching back to the process's start-up — imports, communicator set-up, every rank runnable
at once — would measure the start-up's contention, not the rank's steady state (on a real
4-rank job, 0.51 of the wall clock waiting in the first seconds against 0.06 in the steps
before the onset), and hide a starved rank behind it. Needs beats with counters on both sides
of the onset; otherwise the suspect is returned as it is.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from diagnosis.columns import Columns, ints
from diagnosis.conclusion import Suspicion

RULE = "rankwatch.cpu_starved"
MIN_SHARE = 0.2
EXPLAIN = 0.5
RISE = 2.0
MARGIN = 0.05


def wait_shares(beats: Columns, since_ns: int, base_from_ns: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, wait share before `since_ns`, wait share from it) per rank with counters on
    both sides (nan where a side has fewer than two beats). With `base_from_ns`, "before"
    starts at each rank's last beat at or before it (module docstring). One beat row per
    communicator repeats the same counters: rows are reduced to one per (rank, ts)."""
    wait = ints(beats, "sched_wait_ns", -1)
    ok = wait >= 0
    if not ok.any():
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    rank, ts, wait = ints(beats, "rank")[ok], ints(beats, "ts")[ok], wait[ok]
    order = np.lexsort((ts, rank))
    rank, ts, wait = rank[order], ts[order], wait[order]
    ranks, first = np.unique(rank, return_index=True)
    before, after = np.full(ranks.size, np.nan), np.full(ranks.size, np.nan)
    bounds = [*first.tolist(), rank.size]
    for i in range(ranks.size):  # per rank (not per record): a few thousand at most
        t, wt = ts[bounds[i]:bounds[i + 1]], wait[bounds[i]:bounds[i + 1]]
        first = t.min()
        if base_from_ns is not None and (t <= base_from_ns).any():
            first = t[t <= base_from_ns].max()
        for out, sel in ((before, (t < since_ns) & (t >= first)), (after, t >= since_ns)):
            if sel.sum() >= 2:
                tt, ww = t[sel], wt[sel]
                span = int(tt[-1] - tt[0])
                if span > 0:
                    out[i] = max(float(ww[-1] - ww[0]), 0.0) / span
    return ranks, before, after


def refine(beats: Columns, top: Suspicion, since_ns: int | None,
           base_from_ns: int | None = None, step_ns: float | None = None) -> Suspicion:
    """`top`, re-labelled as its host's CPU when its rank (each of its ranks, for a suspect
    naming several: a host's) was starved since `since_ns` against the baseline from
    `base_from_ns` (module docstring); unchanged otherwise. With the
    job's step time `step_ns`, "starved" also means its extra waiting per step explains at least
    `EXPLAIN` of the suspect's excess (`top.score`, ns per step); without it, a share of at
    least `MIN_SHARE`."""
    if not beats or since_ns is None or not top.ranks or top.stage == "host cpu" \
            or "sched_wait_ns" not in beats:
        return top
    ranks, before, after = wait_shares(beats, since_ns, base_from_ns)
    mask = np.isin(ranks, top.ranks)
    if mask.sum() != len(set(top.ranks)):
        return top
    peers = after[~mask]
    peers = peers[~np.isnan(peers)]
    # several ranks (a host's): each must be starved, so the least starved one is judged
    mine, base = float(np.min(after[mask])), float(np.max(before[mask]))
    if top.how == "confirm":
        # the re-check of an open culprit (`context`, "confirm"): its change was judged when
        # the incident opened, and the steps judged now may all lie after the onset, where
        # its own "before" is the starved state itself; its peers are the reference
        base = 0.0
    if np.isnan(mine) or np.isnan(base) or not peers.size:
        return top
    peer = float(np.median(peers))
    if mine < RISE * base + MARGIN or mine < RISE * peer + MARGIN:
        return top
    if step_ns is None:
        if mine < MIN_SHARE:
            return top
    elif (mine - max(base, peer)) * step_ns < EXPLAIN * top.score:
        return top  # its extra waiting is too small a part of its excess to be the cause
    who = f"rank {top.ranks[0]}" if len(top.ranks) == 1 else \
        f"each of ranks {', '.join(map(str, top.ranks))}"
    return replace(top, stage="host cpu", component="host_software",
                   rules=(*top.rules, RULE),
                   summary=f"{top.summary}; {who} waited for a CPU {mine:.0%} of the time "
                           f"since (before: {base:.0%}, its peers: {peer:.0%}): starved of CPU, "
                           "not slower work")


def unjudged(beats: Columns, top: Suspicion, since_ns: int | None) -> bool:
    """Whether `top` is one rank whose beats carry scheduler counters but too few of them since
    `since_ns` (fewer than two beats) for `refine` to tell a starved CPU from slower work: the
    cause is not judged yet. (Without counters at all — a tracer that sends none — there is
    nothing to wait for.)"""
    if not beats or since_ns is None or len(top.ranks) != 1 or top.stage == "host cpu" \
            or "sched_wait_ns" not in beats:
        return False
    ranks, _, after = wait_shares(beats, since_ns)
    hit = np.flatnonzero(ranks == top.ranks[0])
    return bool(hit.size) and bool(np.isnan(after[int(hit[0])]))
