"""PagerDuty Events API v2 (`POST https://events.pagerduty.com/v2/enqueue`).

`open` and `updated` versions send `trigger`, `resolved` sends `resolve`, all with the same
`dedup_key` — the incident_id, or `rankwatch-<sha256 of it>` when it is longer than PagerDuty's
255 characters — so PagerDuty keeps one alert per incident. Severity from kind and confidence
(diagnosis.sinks.text.severity); `custom_details` carries the culprit, stage, component,
confidence, labels, rules, evidence and SQL. 202 is accepted; 429 and 5xx are retried (PagerDuty
asks for backoff on both); 400 (an invalid event) is refused for good.

API: https://developer.pagerduty.com/docs/events-api-v2/trigger-events/
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from diagnosis.model import Diagnosis
from diagnosis.sinks import text
from diagnosis.sinks.base import Request, Verdict, clip, http_verdict, iso

MAX_DEDUP_KEY = 255


def dedup_key(incident_id: str) -> str:
    if len(incident_id) <= MAX_DEDUP_KEY:
        return incident_id
    return "rankwatch-" + hashlib.sha256(incident_id.encode()).hexdigest()


def event(d: Diagnosis, routing_key: str, page_url: str = "") -> dict[str, Any]:
    key = dedup_key(d.incident_id)
    if d.status == "resolved":
        return {"routing_key": routing_key, "event_action": "resolve", "dedup_key": key}
    details = {"id": d.id, "status": d.status, "version": d.version, "kind": d.kind,
               "culprit_ranks": d.culprit_ranks[:64], "culprit_hosts": d.culprit_hosts[:32],
               "stage": d.stage, "stages": d.stages[:5], "component": d.component,
               "confidence": round(d.confidence, 3), "confidence_label": d.confidence_label,
               "labels": d.labels, "rules": d.rules,
               "evidence": [{"rule": e.rule, "summary": e.summary, "sql": e.sql}
                            for e in d.evidence[:8]],
               "sql": d.sql[:3]}
    out: dict[str, Any] = {
        "routing_key": routing_key, "event_action": "trigger", "dedup_key": key,
        "payload": {"summary": clip(text.summary(d), 1024),
                    "source": clip(d.culprit_hosts[0] if d.culprit_hosts else d.job_id, 255),
                    "severity": text.severity(d.kind, d.confidence),
                    "timestamp": iso(d.onset_ns or d.detected_ns),
                    "component": str(d.component), "group": clip(d.job_id, 255),
                    "class": d.kind, "custom_details": details},
        "client": "rankwatch"}
    page = text.page_link(page_url, d)
    if page:
        out["client_url"] = page
        out["links"] = [{"href": page, "text": "rankwatch incident page"}]
    return out


class PagerDutySink:
    kind = "pagerduty"

    def __init__(self, name: str, url: str, routing_key: str, page_url: str = "") -> None:
        self.name = name
        self.url = url
        self.routing_key = routing_key
        self.page_url = page_url

    def requests(self, d: Diagnosis, raw: bytes, now_ns: int) -> list[Request]:
        body = orjson.dumps(event(d, self.routing_key, self.page_url))
        return [Request(self.url, body, {"Content-Type": "application/json"})]

    def classify(self, status: int, headers: Mapping[str, str], body: bytes) -> Verdict:
        return http_verdict(status, headers, body, retryable_4xx=frozenset({408, 429}))
