"""Diagnosis versions of one incident's life, for the notify tests."""

from __future__ import annotations

import time

from diagnosis.model import Diagnosis, Evidence, Status, TriggerRef, confidence_label


def version(incident_id: str, v: int, status: Status, *, job_id: str = "prod-llm-7",
            kind: str = "hang", ranks: tuple[int, ...] = (141,), stage: str = "bwd mb=2 pp=1",
            confidence: float = 0.93, onset_ns: int | None = None,
            detected_ns: int | None = None) -> Diagnosis:
    now = time.time_ns()
    hosts = [f"node{r // 8:04d}" for r in ranks]
    return Diagnosis(
        id=f"{incident_id}/{v}", job_id=job_id, incident_id=incident_id, version=v,
        status=status, kind=kind,  # type: ignore[arg-type]
        culprit_ranks=list(ranks), culprit_hosts=hosts, stage=stage,
        stages=[stage, "tp_collectives"], component="gpu_compute",
        onset_ns=onset_ns if onset_ns is not None else now - 5_000_000_000,
        detected_ns=detected_ns if detected_ns is not None else now, confidence=confidence,
        confidence_label=confidence_label(confidence), labels=["min_op", "live_hang"],
        rules=["mycroft.alg2.min_op"],
        trigger=TriggerRef(kind="hang", ts=now, ranks=[3, 4], rule="venustrace.heartbeat"),
        evidence=[Evidence(rule="mycroft.alg2.min_op",
                           summary=f"rank {ranks[0]} never reached the op its peers wait in <x>",
                           sql="SELECT 1")],
        sql=[f"SELECT rank, op_seq FROM ops WHERE job_id = '{job_id}' AND rank IN "
             f"({', '.join(map(str, ranks))}) ORDER BY t_enqueue DESC LIMIT 20"],
        summary=f"{kind} — rank {ranks[0]} on {hosts[0]}: stage {stage}, component gpu_compute "
                f"(confidence {confidence:.2f})")


def life(incident_id: str, **kw: object) -> list[Diagnosis]:
    """open → updated (another stage) → resolved."""
    v1 = version(incident_id, 1, "open", **kw)  # type: ignore[arg-type]
    v2 = version(incident_id, 2, "updated", **{**kw, "stage": "dp_allreduce",  # type: ignore[arg-type]
                                                "onset_ns": v1.onset_ns})
    v3 = v2.model_copy(update={"id": f"{incident_id}/3", "version": 3, "status": "resolved",
                               "detected_ns": time.time_ns()})
    return [v1, v2, v3]
