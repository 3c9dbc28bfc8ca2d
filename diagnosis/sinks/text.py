"""What every sink says about a diagnosis version, in one place: severity, the headline, the
culprit line, the evidence lines, the first SQL, the incident page link."""

from __future__ import annotations

from diagnosis.model import Diagnosis

#: PagerDuty's scale (critical > error > warning > info); Alertmanager labels use the same words.
Severity = str


def severity(kind: str, confidence: float) -> Severity:
    """A hang stops the job: critical. A slowdown or regression costs throughput: error when
    rankwatch is sure (confidence ≥ 0.8), warning when fairly sure (≥ 0.5), else info. Jitter
    is at most a warning."""
    if kind == "hang":
        return "critical"
    level = "error" if confidence >= 0.8 else "warning" if confidence >= 0.5 else "info"
    if kind == "jitter" and level == "error":
        return "warning"
    return level


def headline(d: Diagnosis) -> str:
    return f"[{d.status} v{d.version}] {d.kind} in job {d.job_id}"


def ranks_text(ranks: list[int], n: int = 16) -> str:
    head = ", ".join(str(r) for r in ranks[:n])
    return head + (f" … ({len(ranks)} ranks)" if len(ranks) > n else "") if ranks else "none"


def hosts_text(hosts: list[str], n: int = 8) -> str:
    head = ", ".join(hosts[:n])
    return head + (f" … ({len(hosts)} hosts)" if len(hosts) > n else "") if hosts else "unknown"


def summary(d: Diagnosis) -> str:
    if d.summary:
        return d.summary
    return (f"{d.kind} — ranks {ranks_text(d.culprit_ranks)} on {hosts_text(d.culprit_hosts)}: "
            f"stage {d.stage}, component {d.component} (confidence {d.confidence:.2f})")


def evidence_lines(d: Diagnosis, n: int = 6) -> list[str]:
    return [f"{e.rule}: {e.summary}" for e in d.evidence[:n]]


def first_sql(d: Diagnosis) -> str:
    return d.sql[0] if d.sql else ""


def page_link(template: str, d: Diagnosis) -> str:
    """The incident page URL from the config's template (`{incident_id}`, `{job_id}`, `{id}`);
    "" when no template is configured."""
    from urllib.parse import quote

    if not template:
        return ""
    return (template.replace("{incident_id}", quote(d.incident_id, safe=""))
            .replace("{job_id}", quote(d.job_id, safe="")).replace("{id}", quote(d.id, safe="")))
