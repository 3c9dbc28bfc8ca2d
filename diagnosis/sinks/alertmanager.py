"""Prometheus Alertmanager (`POST /api/v2/alerts`).

One alert per incident. Its labels — `alertname`, `job_id`, `kind`, `severity`, `incident_id` —
are fixed for the incident's life (taken from the first version this sink delivered, kept in the
ledger), so Alertmanager sees one alert that changes, never a new one per version; everything
that changes goes in annotations (summary, culprit ranks and hosts, stage, component, the
current kind, confidence, the first SQL, the incident page). `startsAt` is the onset.

Alertmanager forgets an alert that is not re-sent before its `endsAt` (or its resolve_timeout):
while an incident is open, the alert is posted with `endsAt` = now + 4 × resend_s and re-sent
every resend_s (`refresh`), as Prometheus does; if rankwatch notify stops, the alert expires on
its own. The `resolved` version posts the alert with `endsAt` = when it resolved.

API: https://github.com/prometheus/alertmanager/blob/main/api/v2/openapi.yaml (postableAlerts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from diagnosis.model import Diagnosis
from diagnosis.sinks import text
from diagnosis.sinks.base import Request, Verdict, http_verdict, iso
from diagnosis.sinks.state import Ledger


def labels(d: Diagnosis) -> dict[str, str]:
    """The fixed labels of the incident `d` opens (or is first seen in)."""
    name = "RankwatchHang" if d.kind == "hang" else "RankwatchSlowdown"
    return {"alertname": name, "job_id": d.job_id, "kind": d.kind,
            "severity": text.severity(d.kind, d.confidence), "incident_id": d.incident_id}


def alert_annotations(d: Diagnosis, page: str) -> dict[str, str]:
    a = {"summary": text.summary(d), "status": d.status, "version": str(d.version),
         "current_kind": d.kind, "culprit_ranks": text.ranks_text(d.culprit_ranks),
         "culprit_hosts": text.hosts_text(d.culprit_hosts), "stage": str(d.stage),
         "component": str(d.component), "confidence": f"{d.confidence:.2f}",
         "confidence_label": d.confidence_label,
         "description": "\n".join(text.evidence_lines(d)), "sql": text.first_sql(d),
         "diagnosis_id": d.id}
    if page:
        a["incident_page"] = page
    return a


class AlertmanagerSink:
    kind = "alertmanager"

    def __init__(self, name: str, url: str, ledger: Ledger, resend_s: float,
                 page_url: str = "") -> None:
        self.name = name
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.ledger = ledger
        self.resend_s = resend_s
        self.page_url = page_url

    def alert(self, d: Diagnosis, now_ns: int) -> dict[str, Any]:
        known = self.ledger.alert(self.name, d.incident_id)
        fixed = known["labels"] if known else labels(d)
        page = text.page_link(self.page_url, d)
        starts = d.onset_ns or d.detected_ns
        if d.status == "resolved":
            ends = max(starts, min(d.detected_ns, now_ns))
        else:
            ends = max(starts, now_ns) + int(4 * self.resend_s * 1e9)
        out: dict[str, Any] = {"labels": fixed, "annotations": alert_annotations(d, page),
                               "startsAt": iso(starts), "endsAt": iso(ends)}
        if page:
            out["generatorURL"] = page
        return out

    def requests(self, d: Diagnosis, raw: bytes, now_ns: int) -> list[Request]:
        known = self.ledger.alert(self.name, d.incident_id)
        if known and known["version"] > d.version:
            return []  # an older version arriving late: the alert already says more
        body = orjson.dumps([self.alert(d, now_ns)])
        return [Request(self.url, body, {"Content-Type": "application/json"})]

    def delivered(self, d: Diagnosis, now_ns: int) -> None:
        """Remember the alert: re-sent while open, never reopened once resolved."""
        known = self.ledger.alert(self.name, d.incident_id)
        if known and known["version"] > d.version:
            return
        self.ledger.put_alert(self.name, d.incident_id, d.version, d.status != "resolved",
                              self.alert(d, now_ns))

    def refresh(self, now_ns: int) -> Request | None:
        """Every open alert again, its endsAt pushed forward; None when none is open."""
        alerts = self.ledger.open_alerts(self.name)
        if not alerts:
            return None
        ends = iso(now_ns + int(4 * self.resend_s * 1e9))
        body = orjson.dumps([{**a, "endsAt": ends} for a in alerts])
        return Request(self.url, body, {"Content-Type": "application/json"})

    def classify(self, status: int, headers: Mapping[str, str], body: bytes) -> Verdict:
        return http_verdict(status, headers, body)
