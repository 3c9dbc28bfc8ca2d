"""The root-cause engine: one trigger + one job's window → one conclusion → a `Diagnosis`.

Pure: numpy in, pydantic out, the clock is `now_ns`. Dispatch by trigger kind (`ANALYSES`):
failure and hang triggers run the hang analysis first (hang_rca: Mycroft Alg. 2 + Table 4,
VenusTrace halt point) and fall back to the slowdown analysis when nothing is stuck (a transient
stall that already recovered); straggler, jitter and regression triggers run the slowdown analysis
(diagnosis.slow: excess over peers on non-waiting quantities, Table 3/4, ARGUS L2/L3) after checking
that nothing is stuck — a slowdown trigger can arrive during a hang, or at the start of a stall
too young to be one yet. While a performance incident of the job is open, the slowdown analysis
keeps its culprits while their excess persists (`confirm`, as the analyst's re-checks do): a
trigger of any kind reads the same window the re-check reads, and without them the onset that
opened the incident may lie outside its judged steps.

`to_diagnosis` adds what an operator needs: hosts of the culprit ranks, the rules that fired,
one evidence entry per rule with the SQL to see its rows, and a one-line summary.
"""

from __future__ import annotations

from collections.abc import Callable

from diagnosis import hang_rca, slow
from diagnosis.conclusion import Conclusion
from diagnosis.model import Diagnosis, Evidence, Status, Suspect, TriggerRef, confidence_label
from diagnosis.triggers.base import Trigger
from diagnosis.window import Window
from ingest.records import COMM_KIND_CODES, comm_kind_code_sql, kind_code_sql

Analysis = Callable[..., Conclusion | None]


def _hang_then_slow(w: Window, now_ns: int, confirm: tuple[int, ...] = (),
                    confirm_stage: str | None = None,
                    confirm_since_ns: int | None = None) -> Conclusion | None:
    c = hang_rca.analyze(w, now_ns) or hang_rca.analyze_past_stall(w, now_ns)
    if c is not None:
        return c
    # a rank stuck in a call, not yet for the hang threshold: a stall in progress is the hang
    # analysis' to name once it is one — its waiting, read as a slowdown, is a wrong incident
    if hang_rca.stuck_ranks(w, now_ns).size:
        return None
    return slow.analyze(w, now_ns, confirm=confirm, confirm_stage=confirm_stage,
                        confirm_since_ns=confirm_since_ns)


ANALYSES: dict[str, Analysis] = {
    "failure": _hang_then_slow,
    "hang": _hang_then_slow,
    "straggler": _hang_then_slow,
    "jitter": _hang_then_slow,
    "regression": _hang_then_slow,
}


def diagnose(w: Window, trigger: Trigger, now_ns: int, confirm: tuple[int, ...] = (),
             confirm_stage: str | None = None,
             confirm_since_ns: int | None = None) -> Conclusion | None:
    """The conclusion for `trigger` over `w`, or None when nothing material is found.
    `confirm`, `confirm_stage`, `confirm_since_ns`: the culprits, stage and (for a verdict
    against the culprit's own past) onset of the job's open performance incident (module
    docstring; `slow.analyze`)."""
    return ANALYSES[trigger.kind](w, now_ns, confirm=confirm, confirm_stage=confirm_stage,
                                  confirm_since_ns=confirm_since_ns)


def _q(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def declared_codes_sql(job: str, source: str = "jobs FINAL") -> tuple[str, str]:
    """ClickHouse SQL: the (`ids`, `codes`) arrays `comm_kind_code_sql` takes, read from the
    topology of job `job` (an SQL string literal) in `source` (a table or subquery with the jobs
    table's job_id, comm_ids and comm_kinds; empty arrays while the job has none): for a query
    that stands alone, as an operator's does."""
    where = f"FROM {source} WHERE job_id = {job}"
    return (f"(SELECT any(comm_ids) {where})",
            f"(SELECT any(arrayMap(k -> {kind_code_sql('k')}, comm_kinds)) {where})")


def operator_sql(job_id: str, c: Conclusion, start_ns: int) -> list[str]:
    """Queries an operator would run next to see the evidence rows."""
    j = _q(job_id)
    ranks = ", ".join(str(r) for r in c.ranks[:64]) or "-1"
    since = f"fromUnixTimestamp64Nano({start_ns}, 'UTC')"
    out = []
    if c.kind == "hang":
        out.append(f"SELECT rank, comm_id, op_seq, op, t_enqueue, t_start, t_end FROM ops WHERE "
                   f"job_id = {j} AND rank IN ({ranks}) ORDER BY t_enqueue DESC LIMIT 20")
        out.append(f"SELECT rank, comm_id, op_seq, count() AS ranks_waiting FROM ops WHERE "
                   f"job_id = {j} AND toUnixTimestamp64Nano(t_end) = 0 AND t_start >= {since} "
                   "GROUP BY rank, comm_id, op_seq ORDER BY ranks_waiting DESC LIMIT 20")
        out.append(f"SELECT rank, comm_id, op_seq, channel, max(ts) AS last, argMax(gpu_ready, ts)"
                   " AS ready, argMax(rdma_transmitted, ts) AS sent, argMax(rdma_done, ts) AS "
                   f"done FROM chunks WHERE job_id = {j} AND ts >= {since} AND rank IN ({ranks}) "
                   "GROUP BY rank, comm_id, op_seq, channel ORDER BY last DESC LIMIT 20")
        out.append(f"SELECT rank, max(ts) AS last_beat FROM beats WHERE job_id = {j} AND rank IN "
                   f"({ranks}) GROUP BY rank")
    else:
        # the job's dp communicators, decided as everywhere else (ingest.records, "Which kind
        # of communicator a comm_id is"): its topology, else the comm_id's name
        dp = (f"{comm_kind_code_sql('comm_id', *declared_codes_sql(j))} = "
              f"{COMM_KIND_CODES['dp']}")
        out.append(f"SELECT rank, round(avg(data_next_wait) / 1e6, 2) AS data_ms, "
                   "round(avg(model_fwd_loss) / 1e6, 2) AS fwd_ms, round(avg(model_backward) / "
                   "1e6, 2) AS bwd_ms, round(avg(callbacks) / 1e6, 2) AS cb_ms, "
                   "round(avg(step_other) / 1e6, 2) AS other_ms FROM stages WHERE job_id = "
                   f"{j} AND t_start >= {since} GROUP BY rank ORDER BY rank IN ({ranks}) DESC, "
                   "data_ms + cb_ms + other_ms DESC LIMIT 16")
        out.append(f"SELECT rank, kernel, count() AS n, quantile(0.5)(duration) AS p50, "
                   f"quantile(0.99)(duration) AS p99 FROM kernels WHERE job_id = {j} AND "
                   f"t_start >= {since} AND rank IN ({ranks}) GROUP BY rank, kernel "
                   "ORDER BY rank, kernel")
        out.append(f"SELECT comm_id, op_seq, min(t_end - t_start) AS transfer_s, "
                   f"max(t_end - t_start) AS longest_wait_s FROM ops WHERE job_id = {j} AND "
                   f"t_start >= {since} AND {dp} AND "
                   "toUnixTimestamp64Nano(t_end) > 0 GROUP BY comm_id, op_seq "
                   "ORDER BY transfer_s DESC LIMIT 20")
    return out


def to_diagnosis(c: Conclusion, w: Window, trigger: Trigger, *, incident_id: str, version: int,
                 status: Status, detected_ns: int, analysis_ms: float = 0.0) -> Diagnosis:
    hosts = w.grid.hosts
    culprit_hosts = sorted({hosts[r] for r in c.ranks if 0 <= r < len(hosts)})
    rules = list(dict.fromkeys(f.rule for f in c.findings))
    evidence = [Evidence(rule=r, summary=s) for r, s in c.summaries]
    for f in c.findings[:8]:
        data = {k: v for k, v in f.evidence.items() if _small(v)}
        ranks = list(f.culprit_ranks)[:16]
        evidence.append(Evidence(rule=f.rule, summary=f"ranks {ranks}, stage "
                                 f"{f.stage}, component {f.component}, score {f.score:.3g}",
                                 data=data))
    sql = operator_sql(w.topo.job_id, c, w.start_ns)
    where = f"rank {c.ranks[0]}" if len(c.ranks) == 1 else \
        f"ranks {list(c.ranks)[:8]}" + ("…" if len(c.ranks) > 8 else "")
    summary = (f"{c.kind} — {where} on {', '.join(culprit_hosts[:4])}: stage {c.stage}, "
               f"component {c.component} (confidence {c.confidence:.2f})")
    return Diagnosis(
        id=f"{incident_id}/{version}", job_id=w.topo.job_id, incident_id=incident_id,
        version=version, status=status, kind=c.kind, culprit_ranks=list(c.ranks),
        culprit_hosts=culprit_hosts, stage=c.stage, stages=list(c.stages or
                                                                 ((c.stage,) if c.stage else ())),
        component=c.component, onset_ns=c.onset_ns, detected_ns=detected_ns,
        confidence=round(c.confidence, 3), confidence_label=confidence_label(c.confidence),
        labels=list(c.labels), rules=rules,
        trigger=TriggerRef(kind=trigger.kind, ts=trigger.ts, ranks=list(trigger.ranks)[:64],
                           rule=str(trigger.evidence.get("rule", ""))),
        suspects=[Suspect(ranks=list(s.ranks), hosts=sorted({hosts[r] for r in s.ranks}),
                          stage=s.stage, component=s.component, score=round(s.score, 1))
                  for s in c.suspects],
        evidence=evidence, sql=sql, summary=summary, analysis_ms=round(analysis_ms, 2),
    )


def _small(v: object) -> bool:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return True
    if isinstance(v, (list, tuple)):
        return len(v) <= 64 and all(_small(x) for x in v)
    if isinstance(v, dict):
        return len(v) <= 32 and all(_small(x) for x in v.values())
    return False
