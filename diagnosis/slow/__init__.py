"""Root cause of a slowdown or jitter: which rank's *own* time grew, in which component.

Every analysis below measures, per (step, unit), a quantity that contains no waiting and
hands it to one verdict (`context.judge`): a unit is a suspect only when its excess over the
units doing the same work is material *and* stands out of that quantity's own noise — a change
against its own recent baseline while the job's step time rose too, or, in a peer set large
enough to show it, a persistent outlier. Each analysis is a module with one function
`suspects(ctx) -> list[Suspicion]` (`ANALYSES`):

- `compute`: GPU kernel time (kernel records; CUPTI);
- `own_time`: forward/backward stage time with the rank's calls' time inside taken out (ranks
  without kernel records: CPU training);
- `phases`: data loader wait, callbacks, other, optimizer (the `stages` record);
- `launch`: call start delay after enqueue (Mycroft Table 3);
- `network`: DP and TP ring transfer time, narrowed to a member (VenusTrace AR node, Mycroft
  Table 4);
- `p2p`: PP link transfer time (its own signature: it skips ranks already named);
- `cpu`: the steps' CPU wait (the tracer's scheduler counters), a change only: a rank starved
  of CPU loses a little in every phase, none of which names it.

Suspects of one host with one (stage, component) merge into a host-level suspect. The suspect
explaining the most excess ns per step is the culprit; the stage of the next is the top-2 route.
ARGUS L3 on the stored kernel summaries (`kernel_dist`) confirms a GPU-compute culprit. A culprit
rank whose beats show it waiting for a CPU since the onset, more than before and more than its
peers (`cpu`: the scheduler's counters), is its host's CPU, not its work; a rank named for its
network path whose host-to-device copies slowed with it is its PCIe link (`pcie`).
StageFrontier's frontier accounting (`diagnosis.rules.frontier_labels`, §3–4) runs over the
same steps' stage vectors: its labels (direct_exposure, co_critical, telemetry_limited…) and
stage shares go into the conclusion, and whether its blame falls on the culprit sets part of
the confidence.

Confidence (`confidence`) is built from what separates a right answer from a wrong one: how far
the culprit's evidence stands out of its noise, how far it is ahead of the next suspect, and
whether the frontier's blame agrees; docs/diagnoses.md has its calibration on the catalogs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from diagnosis.columns import Columns, codes, col, ints
from diagnosis.conclusion import Conclusion, Suspicion
from diagnosis.rules import frontier_labels
from diagnosis.rules.base import Component, Finding, Kind
from diagnosis.slow import (
    compute,
    cpu,
    kernel_dist,
    launch,
    network,
    own_time,
    p2p,
    pcie,
    phases,
)
from diagnosis.slow.context import (
    LINK_STAGES,
    STAGE_COLS,
    Z_SHIFT,
    Ctx,
    SlowConfig,
    in_steps,
    judged_steps,
    reach_start,
    stage_matrix,
    stage_total,
)
from diagnosis.window import Window
from ingest.agent.shape import infer_pipeline

__all__ = ["MAX_RECENT", "OWN_PAST", "SlowConfig", "analyze", "reach_back", "reach_start"]

ANALYSES = (compute.suspects, own_time.suspects, phases.suspects, launch.suspects,
            network.suspects, cpu.suspects)


#: the most recent steps an analysis that reaches back judges (`reach_back`): bounds its read
#: and its cost at short steps
MAX_RECENT = 200


def reach_back(cfg: SlowConfig, stages: Columns | None, since_ns: int | None) -> SlowConfig:
    """`cfg` with its `recent` steps reaching back to the steps begun after `since_ns` (and
    `onset_steps` more; at most `MAX_RECENT`), so that a change from then on is judged with
    its baseline before it: a sweep's since the previous sweep, a re-check's since its
    incident's onset (`analyze`, `confirm_since_ns`). `cfg` unchanged without either."""
    if since_ns is None or not stages:
        return cfg
    new = np.unique(ints(stages, "step")[ints(stages, "t_start") > since_ns]).size
    return replace(cfg, recent=min(max(cfg.recent, new + cfg.onset_steps), MAX_RECENT))


def analyze(w: Window, now_ns: int, config: SlowConfig | None = None,
            confirm: tuple[int, ...] = (), confirm_stage: str | None = None,
            beats: Callable[[], Columns | None] | None = None,
            confirm_since_ns: int | None = None) -> Conclusion | None:
    """The slowdown conclusion over `w`, or None. `confirm`: the culprit ranks of an incident
    already open, kept while their excess persists, `confirm_stage` its stage (module
    docstring of `context`). `beats`: where `w` has none, reads the job's beats over `w`, and
    is called only for a culprit the steps' own scheduler counters cannot judge (most tries
    find no suspect, and the tracer's stage records carry the counters).
    `confirm_since_ns`: the onset of an open incident judged against its culprit's own past
    alone (label `own_past`: a DDP job's one ring, no like unit to compare with): the judged
    steps reach back to it (`reach_back`). Such a unit's excess is its rise over its own
    baseline, and once the judged steps no longer reach back to that baseline there is none
    to keep it by: a real DDP job's slower ring was resolved 5 s after its baseline slid out,
    and opened again as a second incident by the next sweep, whose steps reached back."""
    cfg = reach_back(config or SlowConfig(), w.get("stages"), confirm_since_ns)
    if not w.get("stages"):
        return None
    steps, step_ns, job_step = judged_steps(w, cfg)
    if steps.size < 2 * cfg.onset_steps or step_ns <= 0:  # too few steps to know the noise
        return None
    st = w.get("stages")
    lo = int(ints(st, "t_start")[in_steps(ints(st, "step"), steps)].min())
    ctx = Ctx(w, cfg, steps, step_ns, peer_stages(w), lo, job_step, frozenset(confirm),
              confirm_stage in LINK_STAGES, confirm_stage=confirm_stage)
    sus: list[Suspicion] = [s for fn in ANALYSES for s in fn(ctx)]
    sus += p2p.suspects(ctx, {r for x in sus for r in x.ranks})
    sus = _merge_hosts(w, sus)
    # every rank waiting more for a CPU since a suspect's onset: the host's contention rose,
    # the suspect's excess is its share of it (`cpu.crowded`)
    sus = [s for s in sus if not cpu.crowded(ctx, s)]
    if not sus:
        return None
    sus.sort(key=lambda s: -s.score)
    sus, explained = _explained_links(sus, cfg)
    sus += explained
    # a starved CPU: judged on the steps' own counters where the stage records carry them,
    # else on the beats'
    refined, by_steps = cpu.refine_steps(ctx, pcie.refine(ctx, sus[0]))
    if refined is None:  # starved of CPU, not yet for as long as a crowding can last
        return None
    sus[0] = refined
    beat_cols = ctx.w.get("beats")
    if not by_steps:
        if not beat_cols and beats is not None:
            beat_cols = beats() or {}
        sus[0] = cpu.refine(beat_cols, sus[0], _onset(ctx, sus[0]), ctx.lo_ns,
                            ctx.step_ns, _judged_end(ctx))
    top = sus[0]
    # a rank whose scheduler counters cannot judge its CPU yet (one beat since the onset): a
    # starved CPU and slower work look alike until they can
    cpu_open = not by_steps and cpu.unjudged(beat_cols, top, _onset(ctx, top))
    # a rank starved of CPU over the whole span since the onset (`cpu.refine`) is a sustained
    # slowdown, however spiky the stage it showed in
    spiky = top.how == "sparse" or "intermittent" in top.summary
    kind: Kind = "jitter" if spiky and cpu.RULE not in top.rules else "slowdown"
    stages = tuple(dict.fromkeys(s.stage for s in sus if s.stage))[:3]
    front = _frontier(ctx, top)
    argus = kernel_dist.confirm(ctx, top)
    rival = next((s for s in sus[1:] if s not in explained), None)
    conf = confidence(top, rival, front, cfg, argus is not None)
    labels = ["excess_over_peers", f"evidence_{top.how}" if top.how else "evidence"]
    if cpu_open:
        conf = min(conf, CPU_UNJUDGED_CONFIDENCE)
        labels.append("cpu_unjudged")
    if top.how == "sparse":
        # a count of spikes says which rank, not why: a rank starved of CPU now and then
        # spikes in the same phases as one whose work stalls
        conf = min(conf, SPARSE_CONFIDENCE)
    if top.how == "few_peers":
        # beside 2-3 peers a persistent difference has no spread across ranks to be judged
        # by: the rank stands out, but which of its stages is the cause is less certain (a
        # simulated rank 4x slower in its backward from the 7th step first showed as its
        # forward, 1.25x from the job's start)
        conf = min(conf, FEW_PEERS_CONFIDENCE)
    if top.whole_ring:
        # the ring is known, not which of its members slowed it: the answer names them all
        conf = min(conf, WHOLE_RING_CONFIDENCE)
        labels.append("ring_member_unknown")
    if top.own_past:
        labels.append(OWN_PAST)
    if len(top.ranks) > 1:
        labels.append("host_level")
    findings = [Finding(rule=r, culprit_ranks=s.ranks, stage=s.stage, component=s.component,
                        score=s.score, kind=kind,
                        evidence={"excess_ns_per_step": s.score, "sigma": round(s.z, 2),
                                  "how": s.how})
                for s in sus[:4] for r in s.rules]
    summaries = [(s.rules[0], s.summary) for s in sus[:4]]
    if argus is not None:
        labels.append("argus_l3_outlier")
        findings.append(argus)
        summaries.append((argus.rule, f"ARGUS L3: ranks {list(argus.culprit_ranks)} run "
                          f"{argus.stage} with a deviating duration distribution (mean W1 "
                          f"{argus.score:.2f}x the IQR fence of their stage peers)"))
    if front is not None:
        labels += [lb for lb in front.labels if lb not in labels]
        findings += frontier_labels.findings(front)
        summaries.append(("stagefrontier", _frontier_summary(front, top)))
    return Conclusion(kind, top.ranks, top.stage, top.component, conf, stages=stages,
                      labels=tuple(labels), findings=tuple(findings),
                      summaries=tuple(summaries), suspects=tuple(sus[1:6]),
                      onset_ns=_onset(ctx, top))


#: the label of a conclusion whose culprit was judged against its own past alone (`analyze`)
OWN_PAST = "own_past"
#: the most a conclusion says while its culprit's CPU cannot be judged yet (`cpu.unjudged`)
CPU_UNJUDGED_CONFIDENCE = 0.65
#: the most a conclusion says whose culprit is a ring not narrowed to one member
WHOLE_RING_CONFIDENCE = 0.6
#: the most a conclusion says whose evidence is intermittent spikes (`context`, "sparse")
SPARSE_CONFIDENCE = 0.75
#: the most a conclusion says whose evidence is a persistent difference beside 2-3 peers
#: (`context`, "few_peers")
FEW_PEERS_CONFIDENCE = 0.75
LINK_RULES = ("venustrace.ar_node",)
LAUNCH_RULES = ("mycroft.table3.late_start",)


def _explained_links(sus: list[Suspicion], cfg: SlowConfig
                     ) -> tuple[list[Suspicion], list[Suspicion]]:
    """(suspects, suspects explained by a rank's own slowdown) — the dependency order of
    Mycroft §5 and VenusTrace §3: communication is the root cause when the ranks' own work is
    normal.
    - A DP/TP ring or p2p hop whose transfer time changed no earlier than `onset_steps` before
      some rank's own compute or stage time changed is taken as that rank's effect: the order
      of the two onsets is the evidence (a degraded link does not make a rank's own work slower
      first); on hosts whose CPUs the ranks share, and on a CPU-backed transport (gloo), a
      rank's slowdown shifts its peers' transfers.
    - Calls that start late on a rank whose own compute is slower are that compute's effect (a
      device busy with slow kernels starts its collectives late), not its proxy's.
    - A ring not narrowed to a member (`Suspicion.whole_ring`) is explained by any suspect
      naming some of its members only: one member's slower PCIe, proxy or NIC slows every
      collective it joins, so its TP group rises with its DP ring, and the narrower answer
      is the better one.
    The explained suspects stay in the conclusion, after the others."""
    own = [s for s in sus if not set(s.rules) & set(LINK_RULES + LAUNCH_RULES)
           and s.onset_step >= 0]
    own_ranks = {r for o in own for r in o.ranks}
    keep, explained = [], []
    for s in sus:
        link = bool(set(s.rules) & set(LINK_RULES))
        launch = not link and bool(set(s.rules) & set(LAUNCH_RULES))
        narrower = s.whole_ring and any(set(o.ranks) < set(s.ranks) for o in sus)
        if (link and any(s.onset_step >= o.onset_step - cfg.onset_steps for o in own)) or \
                (launch and set(s.ranks) <= own_ranks) or narrower:
            explained.append(s)
        else:
            keep.append(s)
    return keep, explained


def peer_stages(w: Window) -> np.ndarray:
    """The pipeline stage of each rank, the peer groups every comparison uses: the topology's,
    or — when it declares no pipeline (pp 1) but the ranks send to and receive from each other
    — the one their p2p pattern shows (`ingest.agent.shape.infer_pipeline`: disjoint chains,
    stage 0 the end that sends first). Ranks of different stages do different work; compared
    as peers, a later stage's forward is an "outlier" of the first's."""
    grid = w.grid
    ops = w.get("ops")
    if grid.pp > 1 or not ops or "peer" not in ops:
        return grid.stage
    names, code = codes(col(ops, "op"))
    p2p = np.isin(names.astype(str), ("Send", "Recv"))[code] & (ints(ops, "peer", -1) >= 0)
    if not p2p.any():
        return grid.stage
    rank, peer = ints(ops, "rank")[p2p], ints(ops, "peer")[p2p]
    edges = np.unique(np.stack([np.minimum(rank, peer), np.maximum(rank, peer)], axis=1),
                      axis=0)
    send = (names.astype(str) == "Send")[code][p2p]
    t0 = ints(ops, "t_start")[p2p]
    order = np.lexsort((t0, rank))
    firsts = order[np.r_[True, rank[order][1:] != rank[order][:-1]]]
    first_is_send = {int(rank[i]): bool(send[i]) for i in firsts.tolist()}
    shape = infer_pipeline(grid.world, [tuple(e) for e in edges.tolist()], first_is_send, [], [])
    if shape is None or shape.pp < 2:
        return grid.stage
    stage = np.zeros(grid.world, dtype=np.int64)
    for chain in shape.chains:
        stage[list(chain)] = np.arange(len(chain))
    return stage


def confidence(top: Suspicion, second: Suspicion | None,
               front: frontier_labels.FrontierReport | None, cfg: SlowConfig,
               argus: bool = False) -> float:
    """0.5 (a guess among suspects) … 0.95: the product of
    - separation: the culprit's share of the excess it and the next suspect explain, mapped
      from [0.5, 1] to [0, 1] (two suspects alike: the evidence cannot separate them);
    - strength: how far its evidence stands out of the noise, relative to the threshold that
      admitted it (at the threshold 0.5, at twice the threshold or more 1); a unit kept only
      because its incident is open (`confirm`) has 0.5;
    - agreement: 1 when the frontier's blame includes a culprit rank (or no frontier ran),
      0.6 when it blames others;
    an ARGUS L3 outlier kernel on the culprit (`argus`) lifts the strength to its maximum: a
    second, independent comparison found the same rank."""
    sep = 1.0 if second is None else top.score / max(top.score + second.score, 1.0)
    sep = min(max((sep - 0.5) / 0.5, 0.0), 1.0)
    z_min = {"change": cfg.z_change, "shift": Z_SHIFT, "outlier": cfg.z_peers,
             "few_peers": cfg.z_peers,
             "sparse": 2.0}.get(top.how)
    strength = 0.5 if z_min is None else min(0.5 + 0.5 * (top.z / z_min - 1.0), 1.0)
    if argus:
        strength = 1.0
    agree = 1.0 if front is None or not front.culprit_ranks or \
        set(front.culprit_ranks) & set(top.ranks) else 0.6
    return float(round(0.5 + 0.45 * sep * max(strength, 0.0) * agree, 3))


def _frontier(ctx: Ctx, top: Suspicion) -> frontier_labels.FrontierReport | None:
    """StageFrontier over the steps since the culprit's onset (all judged steps when unknown):
    (steps × ranks × stages) durations from the stage records, roles = PP stage."""
    steps = ctx.steps
    if top.onset_step >= 0:
        steps = steps[steps >= top.onset_step]
    if steps.size == 0:
        return None
    d = np.stack([stage_matrix(ctx, c) for c in STAGE_COLS], axis=2)
    d = d[np.isin(ctx.steps, steps)]
    ranks = np.flatnonzero(~np.isnan(d).all(axis=(0, 2)))
    if ranks.size < 2:
        return None
    d = d[:, ranks]
    return frontier_labels.diagnose(d, ranks=ranks, roles=ctx.stage_of[ranks])


def _frontier_summary(f: frontier_labels.FrontierReport, top: Suspicion) -> str:
    shares = ", ".join(f"{n} {s:.0%}" for n, s in zip(f.stage_names, f.shares.tolist(),
                                                       strict=True) if s >= 0.05)
    blamed = list(f.culprit_ranks)[:8]
    agree = "agrees" if set(blamed) & set(top.ranks) else "differs"
    return (f"frontier shares {shares}; top stage {f.top1}; blame on ranks {blamed} ({agree} "
            f"with the culprit); labels {', '.join(f.labels)}")


def _judged_end(ctx: Ctx) -> int:
    """When the last judged step ended (its latest rank)."""
    st = ctx.w.get("stages")
    sel = in_steps(ints(st, "step"), ctx.steps)
    return int(np.max((ints(st, "t_start") + stage_total(st))[sel]))


def _onset(ctx: Ctx, top: Suspicion) -> int | None:
    st = ctx.w.get("stages")
    first = top.onset_step if top.onset_step >= 0 else int(ctx.steps[0])
    sel = np.isin(ints(st, "rank"), top.ranks) & (ints(st, "step") == first)
    if not sel.any():
        sel = np.isin(ints(st, "rank"), top.ranks) & in_steps(ints(st, "step"), ctx.steps)
    return int(ints(st, "t_start")[sel].min()) if sel.any() else None


def _merge_hosts(w: Window, sus: list[Suspicion]) -> list[Suspicion]:
    """Flagged ranks of one host with the same (stage, component) → one host-level suspect."""
    hosts = w.grid.hosts
    groups: dict[tuple[str, str | None, str | None], list[Suspicion]] = {}
    for s in sus:
        h = {hosts[r] for r in s.ranks} if s.ranks else {""}
        key = (next(iter(h)) if len(h) == 1 else "", s.stage, s.component)
        groups.setdefault(key, []).append(s)
    out = []
    for (host, stage, comp), lst in groups.items():
        if host and len(lst) >= 2:
            ranks = tuple(sorted({r for s in lst for r in s.ranks}))
            merged: Component | None = "host_software" if comp == "gpu_compute" and \
                stage == "compute" else comp  # type: ignore[assignment]
            best = max(lst, key=lambda s: s.z)
            out.append(Suspicion(ranks, stage, merged,
                                 float(sum(s.score for s in lst) / len(lst)), lst[0].rules,
                                 f"host {host}: {len(ranks)} ranks alike — " + lst[0].summary,
                                 best.z, best.how, min(s.onset_step for s in lst),
                                 any(s.whole_ring for s in lst)))
        else:
            out += lst
    return out
