"""A culprit rank starved of CPU: the scheduler's own account, from the counters in its beats.

The host agent copies each rank's training-thread schedstat into every beat
(`ingest.records.Beat`: `sched_run_ns`, `sched_wait_ns`, cumulative). The share of wall time a
rank spent runnable but waiting for a CPU is Δwait / Δts between two of its beats. A rank whose
work got slower because other processes took its CPU (a busy neighbour, data-loader workers,
another job on the host) waits where it used to run; a rank whose device or code got slower
does not. Nothing else in the records separates the two on a host whose "device" work is CPU
work, and on a GPU host it separates a starved launcher from a slower GPU.

`refine` re-labels a slowdown suspect "host cpu" / host_software when, over the judged steps
since its onset, its wait share (for a suspect naming a host's ranks, each rank's) exceeds its
own share before the onset and its peers' median share since the onset each by more than the
shares' own scatter allows (`NOISE_K` × the RMS deviation of the per-beat-interval shares from
their rank's and side's share, pooled; at least `MARGIN` of the wall clock) — peers under the
same contention (more runnable processes than cores everywhere) are not starved *relative* to
each other: no re-label — and its extra waiting accounts for at least half of its excess time
per step: the cause must be big enough to be the cause (a rank of 50 ms steps waiting 20 % of
the time where its peers wait 3 % loses about 9 ms a step to its CPU; a fixed floor on the
share would miss it on short steps and admit noise on long ones). "Before" is the time of the
judged baseline steps (from `base_from_ns`, the first judged step's start, taken from the
last beat at or before it): the same steps the slowdown verdict compared against. A baseline
reaching back to the process's start-up — imports, communicator set-up, every rank runnable
at once — would measure the start-up's contention, not the rank's steady state (on a real
4-rank job, 0.51 of the wall clock waiting in the first seconds against 0.06 in the steps
before the onset), and hide a starved rank behind it. "Since" ends with the judged steps
(`until_ns`): the beats after them are not what the verdict measured, and a job's end — every
rank runnable at once as it tears down, a counter that restarts — would read as everyone
starved. Needs beats with counters on both sides of the onset; otherwise the suspect is
returned as it is.

A fixed ratio (2 × the before and peer shares + 5 %) was used first and judged the rise by
nothing but its size: on a real 4-rank job whose rank 1 shared its core with two busy
processes, the rank waited 10–15 % of each second against its peers' 3–7 % (scatter ~2 %),
1 point short of the ratio's 13.4 %, and its slowdown was named by its backward.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from diagnosis.columns import Columns, ints
from diagnosis.conclusion import Suspicion

RULE = "rankwatch.cpu_starved"
MIN_SHARE = 0.2
EXPLAIN = 0.5
MARGIN = 0.05
NOISE_K = 3.0


def wait_shares(beats: Columns, since_ns: int, base_from_ns: int | None = None,
                until_ns: int | None = None, noise: list[np.ndarray] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, wait share before `since_ns`, wait share from it) per rank with counters on
    both sides (nan where a side has fewer than two beats). With `base_from_ns`, "before"
    starts at each rank's last beat at or before it (module docstring); with `until_ns`,
    "after" ends at its first beat at or after it. One beat row per communicator repeats the
    same counters: rows are reduced to one per (rank, ts). An interval whose counter went
    back (a new process behind the rank, a reset) is left out of the share. `noise`, when
    given, receives per rank its per-interval shares on each side, each less its side's
    share: the scatter the shares are judged against (`refine`)."""
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
        keep = np.ones(t.size, dtype=bool)
        keep[1:] = t[1:] != t[:-1]  # one row per beat
        t, wt = t[keep], wt[keep]
        first = t.min()
        if base_from_ns is not None and (t <= base_from_ns).any():
            first = t[t <= base_from_ns].max()
        last = t.max()
        if until_ns is not None and (t >= until_ns).any():
            last = t[t >= until_ns].min()
        for out, sel in ((before, (t < since_ns) & (t >= first)),
                         (after, (t >= since_ns) & (t <= last))):
            if sel.sum() < 2:
                continue
            dt, dw = np.diff(t[sel]), np.diff(wt[sel])
            good = (dt > 0) & (dw >= 0)
            if good.any():
                out[i] = float(dw[good].sum()) / float(dt[good].sum())
                if noise is not None:
                    noise.append(dw[good] / dt[good] - out[i])
    return ranks, before, after


def refine(beats: Columns, top: Suspicion, since_ns: int | None,
           base_from_ns: int | None = None, step_ns: float | None = None,
           until_ns: int | None = None) -> Suspicion:
    """`top`, re-labelled as its host's CPU when its rank (each of its ranks, for a suspect
    naming several: a host's) was starved since `since_ns` against the baseline from
    `base_from_ns` (module docstring); unchanged otherwise. With the
    job's step time `step_ns`, "starved" also means its extra waiting per step explains at least
    `EXPLAIN` of the suspect's excess (`top.score`, ns per step); without it, a share of at
    least `MIN_SHARE`."""
    if not beats or since_ns is None or not top.ranks or top.stage == "host cpu" \
            or "sched_wait_ns" not in beats:
        return top
    scatter: list[np.ndarray] = []
    ranks, before, after = wait_shares(beats, since_ns, base_from_ns, until_ns, scatter)
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
    # the rise must stand out of the shares' own scatter from one beat interval to the next
    # (pooled over every rank and side), and be at least MARGIN of the wall clock
    dev = np.concatenate(scatter) if scatter else np.zeros(0)
    need = max(MARGIN, NOISE_K * float(np.sqrt(np.mean(dev ** 2)))) if dev.size else MARGIN
    if mine - base < need or mine - peer < need:
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
