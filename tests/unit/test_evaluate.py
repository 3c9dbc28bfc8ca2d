"""Scoring diagnoses against ground truth (diagnosis.evaluate): which incident a fault is scored
from when several name it, and what counts as a false alarm."""

from __future__ import annotations

from types import SimpleNamespace

from diagnosis.evaluate import score_scenario
from diagnosis.model import Diagnosis, Suspect, TriggerRef, confidence_label
from ingest.units import SECOND as S


def diag(iid: str, detected_s: float, ranks: list[int], stage: str, kind: str = "hang",
         version: int = 1, suspects: list[Suspect] | None = None) -> Diagnosis:
    return Diagnosis(id=f"{iid}/{version}", job_id="j", incident_id=iid, version=version,
                     status="open" if version == 1 else "updated", kind=kind,  # type: ignore[arg-type]
                     culprit_ranks=ranks, culprit_hosts=[], stage=stage, stages=[stage],
                     component="gpu_compute", onset_ns=None, detected_ns=int(detected_s * S),
                     confidence=0.9, confidence_label=confidence_label(0.9),
                     trigger=TriggerRef(kind="hang", ts=0, ranks=ranks, rule="r"),
                     suspects=suspects or [])


TRUTH = SimpleNamespace(expect_diagnosis=True, spec="hang rank=5 stage=data at=10s", ranks=[5],
                        start_ns=10 * S, end_ns=0, fault="hang", stage="data", component="gpu")


def test_the_earliest_primary_incident_is_scored_and_a_later_one_is_no_false_alarm() -> None:
    right = diag("a", 13.0, [5], "data")
    later_wrong = diag("b", 20.0, [5], "optim", kind="jitter")
    sc = score_scenario("s", [], [TRUTH], [later_wrong, right])
    f = sc.faults[0]
    assert f.detected and f.stage_top1 and f.hang_kind
    assert f.latency_s == 3.0
    assert sc.false_alarms == 0 and sc.incidents == 2


def test_a_primary_match_outranks_an_earlier_suspect_match_but_latency_is_the_first() -> None:
    other = Suspect(ranks=[5], hosts=[], stage="optim", component="gpu_compute", score=1.0)
    as_suspect = diag("a", 12.0, [9], "bwd mb=1 pp=0", suspects=[other])
    as_primary = diag("b", 15.0, [5], "data")
    f = score_scenario("s", [], [TRUTH], [as_suspect, as_primary]).faults[0]
    assert f.diagnosis is not None and f.diagnosis["primary"] and f.stage_top1
    assert f.latency_s == 2.0


def test_an_incident_naming_no_faulty_rank_is_a_false_alarm() -> None:
    sc = score_scenario("s", [], [TRUTH], [diag("a", 12.0, [7], "data")])
    assert not sc.faults[0].detected and sc.false_alarms == 1
