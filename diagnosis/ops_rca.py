"""Root cause from op records alone, for jobs traced without stage records (imported NCCL logs,
Flight Recorder dumps, Kineto traces, the NCCL plugin without the stage timers).

The slowdown analysis (diagnosis.slow) works on stage vectors and returns nothing without them; the
hang analysis (hang_rca) needs only ops and beats. `analyze` runs:
1. `hang_rca.analyze`: the op sequence numbers tell a rank that never reached the call its
   peers wait in (Mycroft Alg. 2's waits-for graph over op_seq);
2. else the persistent last arriver per TP/DP collective (rules/arrival_order.py, VenusTrace
   §3.2.1 / Alg. 2 line 26), its stage named from the communicator's kind (tp_collectives,
   dp_allreduce); the component is left open — the ops say who was late, not why;
3. Mycroft's straggler measures (§4.3, Alg. 1 line 6: throughput halved or op interval doubled)
   on the culprit's communicator, first half of the window against the second, as evidence
   and labels: they say whether the slowdown grew within the window, not who caused it.

Confidence is modest by design (0.5–0.8): arrival order is indirect evidence.
"""

from __future__ import annotations

import numpy as np

from diagnosis import hang_rca
from diagnosis.columns import col, ints
from diagnosis.conclusion import Conclusion, Suspicion
from diagnosis.rules.arrival_order import DEFAULT, ArrivalConfig, last_arrivers
from diagnosis.rules.base import Finding
from diagnosis.window import Window

#: the raw kinds this analysis reads
KINDS = ("ops", "beats")
MYCROFT_RULE = "mycroft.interval"


def mycroft_measures(t_start: np.ndarray, t_end: np.ndarray, nbytes: np.ndarray
                     ) -> dict[str, float] | None:
    """Mycroft Alg. 1's two measures, first half of the calls against the second: the ratio of
    mean op interval (later / earlier) and of busy throughput (later / earlier). None with
    fewer than 8 completed calls per half."""
    done = t_end > 0
    ts, te, b = t_start[done], t_end[done], nbytes[done]
    order = np.argsort(ts, kind="stable")
    ts, te, b = ts[order], te[order], b[order]
    half = ts.size // 2
    if half < 8:
        return None
    parts = [(ts[:half], te[:half], b[:half]), (ts[half:], te[half:], b[half:])]
    interval = [float(np.mean(np.diff(p[0]))) for p in parts]
    busy = [float(np.sum(p[1] - p[0])) for p in parts]
    thr = [float(np.sum(p[2])) / x if x > 0 else 0.0 for p, x in zip(parts, busy, strict=True)]
    return {"interval_ratio": round(interval[1] / interval[0], 3) if interval[0] > 0 else 0.0,
            "throughput_ratio": round(thr[1] / thr[0], 3) if thr[0] > 0 else 0.0}


def slowdown(w: Window, now_ns: int, cfg: ArrivalConfig = DEFAULT
             ) -> Conclusion | None:
    ops = w.get("ops")
    if not ops:
        return None
    upto = ints(ops, "t_start") <= now_ns
    rank, comm = ints(ops, "rank")[upto], col(ops, "comm_id").astype(str)[upto]
    grid = w.grid
    found = last_arrivers(rank, comm, ints(ops, "op_seq")[upto], col(ops, "op")[upto],
                          ints(ops, "t_start")[upto], grid.comm_members, grid.comm_kind,
                          grid.hosts, cfg)
    if not found:
        return None
    top = found[0]
    findings: list[Finding] = [top]
    labels = ["ops_only", *top.labels]
    mine = (comm == str(top.evidence["comm_id"])) & (rank == top.culprit_ranks[0])
    m = mycroft_measures(ints(ops, "t_start")[upto][mine], ints(ops, "t_end")[upto][mine],
                         ints(ops, "bytes")[upto][mine])
    if m is not None:
        grew = m["interval_ratio"] >= 2.0 or 0 < m["throughput_ratio"] <= 0.5
        if grew:
            labels.append("mycroft_straggler")
        findings.append(Finding(rule=MYCROFT_RULE, culprit_ranks=top.culprit_ranks,
                                stage=top.stage, kind="slowdown", score=m["interval_ratio"],
                                evidence={**m, "comm_id": top.evidence["comm_id"],
                                          "triggered": grew}))
    ev = top.evidence
    share, chance = float(str(ev["share"])), float(str(ev["chance"]))
    ratio = float(str(ev["lead_ms"])) / max(float(str(ev["noise_ms"])), 1e-6)
    confidence = min(0.8, 0.5 + 0.3 * min(1.0, (share - chance) / 0.4)
                     * min(1.0, np.log2(max(ratio, 1.0)) / 2))
    suspects = tuple(Suspicion(ranks=f.culprit_ranks, stage=f.stage, component=None,
                               score=f.score, rules=(f.rule,)) for f in found[1:4])
    summary = (f"rank {top.culprit_ranks[0]} called last in {ev['last']} of {ev['calls']} "
               f"calls of {ev['comm_id']} (chance {ev['chance']}, p=1e{ev['log10_p']}), "
               f"{ev['lead_ms']} ms after the next member (noise {ev['noise_ms']} ms)")
    return Conclusion(kind="slowdown", ranks=top.culprit_ranks, stage=top.stage,
                      component=None, confidence=float(confidence), onset_ns=top.onset_ns,
                      labels=tuple(labels), findings=tuple(findings),
                      summaries=((top.rule, summary),), suspects=suspects)


def analyze(w: Window, now_ns: int) -> Conclusion | None:
    """A hang from the op sequence numbers, else a slowdown from arrival order (docstring)."""
    return hang_rca.analyze(w, now_ns) or slowdown(w, now_ns)
