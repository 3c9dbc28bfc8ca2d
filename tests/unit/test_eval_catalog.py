"""`rankwatch eval --catalog`: which scenarios a run covers, and the false-alarm briefs."""

from __future__ import annotations

import pytest

from diagnosis.model import Diagnosis
from ingest.sim.scenario import load_catalog
from rankwatch.commands.eval import REAL_SUBSET, _names, incident_brief


def test_names_per_catalog() -> None:
    realistic = list(load_catalog("realistic"))
    assert _names("", real=False, catalog="realistic") == realistic
    assert _names("", real=True, catalog="realistic") == realistic
    assert _names("all", real=True, catalog="standard") == list(load_catalog())
    assert _names("", real=True, catalog="standard") == list(REAL_SUBSET)
    assert _names("real-control-dp4, real-bwd-x4-pp2dp2", False, "realistic") == [
        "real-control-dp4", "real-bwd-x4-pp2dp2"]
    with pytest.raises(KeyError, match="unknown scenarios in catalog 'realistic': control-8"):
        _names("control-8", False, "realistic")


def _diag(incident: str, version: int, status: str, ranks: list[int], ts: int) -> Diagnosis:
    return Diagnosis.model_validate({
        "id": f"{incident}-{version}", "job_id": "j", "incident_id": incident,
        "version": version, "status": status, "kind": "slowdown", "culprit_ranks": ranks,
        "culprit_hosts": [], "stage": "dp_allreduce", "component": "nic_rdma",
        "onset_ns": None, "detected_ns": ts, "confidence": 0.95, "confidence_label": "high",
        "rules": ["venustrace.ar_node"], "summary": "pg1 slower",
        "trigger": {"kind": "straggler", "ts": ts, "ranks": [], "rule": "r"}})


def test_incident_brief_keeps_each_incidents_last_open_version() -> None:
    briefs = incident_brief([_diag("b", 1, "open", [1], 5), _diag("a", 1, "open", [2], 1),
                             _diag("a", 2, "updated", [3], 2), _diag("a", 3, "resolved", [3], 3)])
    assert [(b["ranks"], b["version"]) for b in briefs] == [([3], 2), ([1], 1)]
    assert briefs[0]["evidence"] == "pg1 slower" and briefs[0]["confidence"] == 0.95
