"""The incident page as one self-contained HTML document (inline CSS and SVG, no script, no
external resource), and the index of incidents the worker serves at `/`.

Every value that comes from a diagnosis or the database is HTML-escaped: job ids, summaries and
evidence are producer-controlled text.
"""

from __future__ import annotations

import datetime as dt
from html import escape
from typing import Any
from urllib.parse import quote

from diagnosis.model import Diagnosis
from diagnosis.page import svg
from diagnosis.page.data import STAGE_COLUMNS, IncidentData

STAGE_NAMES = ("data wait", "forward+loss", "backward", "callbacks", "optimizer", "other")
assert len(STAGE_NAMES) == len(STAGE_COLUMNS)

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:980px;color:#1b1b1b;background:#fff;padding:0 16px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.status{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-size:12px}
.open{background:#d62728}.updated{background:#e67e22}.resolved{background:#2ca02c}
.summary{font-size:16px;margin:10px 0;padding:10px 12px;background:#fbeaea;
border-left:4px solid #d62728}
table{border-collapse:collapse} td,th{padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{color:#555;font-weight:600} .culprit{color:#d62728;font-weight:700}
pre{background:#f6f8fa;padding:8px 10px;overflow-x:auto;font-size:12px;white-space:pre-wrap}
.muted{color:#666}
"""


def _time(ns: int | None) -> str:
    if not ns:
        return "unknown"
    t = dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d} UTC"


def _facts(d: Diagnosis, data: IncidentData) -> str:
    rows = [("Kind", d.kind), ("Culprit ranks", ", ".join(map(str, d.culprit_ranks)) or "—"),
            ("Hosts", ", ".join(d.culprit_hosts) or "—"), ("Stage", d.stage or "undecided"),
            ("Other stages", ", ".join(d.stages[1:]) or "—"),
            ("Component", d.component or "undecided"),
            ("Confidence", f"{d.confidence:.2f} ({d.confidence_label})"),
            ("Onset", _time(d.onset_ns)), ("Detected", _time(data.versions[0].detected_ns)),
            ("Labels", ", ".join(d.labels) or "—"), ("Rules", ", ".join(d.rules) or "—"),
            ("World size", str(data.world_size))]
    body = "".join(f"<tr><th>{escape(k)}</th><td{' class=culprit' if k == 'Culprit ranks' else ''}"
                   f">{escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='facts'>{body}</table>"


def _suspects(d: Diagnosis) -> str:
    if not d.suspects:
        return "<p class='muted'>No further suspects.</p>"
    rows = "".join(f"<tr><td>{escape(', '.join(map(str, s.ranks)))}</td>"
                   f"<td>{escape(', '.join(s.hosts))}</td><td>{escape(str(s.stage))}</td>"
                   f"<td>{escape(str(s.component))}</td><td>{s.score / 1e6:.1f} ms/step</td></tr>"
                   for s in d.suspects)
    return ("<table><tr><th>Ranks</th><th>Hosts</th><th>Stage</th><th>Component</th>"
            f"<th>Excess</th></tr>{rows}</table>")


def _evidence(d: Diagnosis) -> str:
    if not d.evidence:
        return "<p class='muted'>No evidence recorded.</p>"
    items = []
    for e in d.evidence:
        sql = f"<pre>{escape(e.sql)}</pre>" if e.sql else ""
        items.append(f"<li><b>{escape(e.rule)}</b>: {escape(e.summary)}{sql}</li>")
    return f"<ul>{''.join(items)}</ul>"


def _history(data: IncidentData) -> str:
    rows = "".join(f"<tr><td>v{v.version}</td><td><span class='status {v.status}'>{v.status}"
                   f"</span></td><td>{escape(_time(v.detected_ns))}</td>"
                   f"<td>{escape(v.summary)}</td></tr>" for v in data.versions)
    return f"<table>{rows}</table>"


def incident_page(data: IncidentData) -> str:
    d = data.latest
    heat = svg.progress_heatmap(data.progress, d.culprit_ranks, data.t0_ns, data.bin_ns,
                                data.onset_ns)
    shares = svg.stage_shares(data.stages, d.culprit_ranks)
    stages = (svg.stage_bars(shares[0], shares[1], STAGE_NAMES) if shares is not None else
              "<p class='muted'>No stage records for the culprit and its peers in this span.</p>")
    sql = "".join(f"<pre>rankwatch sql \"{escape(q)}\"</pre>" for q in d.sql) or (
        "<p class='muted'>None.</p>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(d.kind)} in {escape(d.job_id)} — rankwatch incident</title>
<style>{CSS}</style></head>
<body>
<h1>{escape(d.kind.capitalize())} in job {escape(d.job_id)}
<span class="status {d.status}">{d.status} · v{d.version}</span></h1>
<div class="muted">incident {escape(d.incident_id)}</div>
<div class="summary">{escape(d.summary or "no summary")}</div>
{_facts(d, data)}
<h2>Every rank's progress around the onset</h2>
{heat}
<h2>Stage shares: culprit vs peers</h2>
{stages}
<h2>Suspects</h2>
{_suspects(d)}
<h2>Evidence</h2>
{_evidence(d)}
<h2>Next SQL</h2>
{sql}
<h2>Versions</h2>
{_history(data)}
<p class="muted">rankwatch · generated {escape(_time(data.latest.detected_ns))}</p>
</body></html>
"""


def index_page(rows: list[dict[str, Any]], base: str = "/incidents/") -> str:
    items = "".join(
        f"<tr><td>{escape(str(r['job_id']))}</td><td><a href='{base}"
        f"{quote(str(r['incident_id']), safe='')}'>{escape(str(r['incident_id']))}</a></td>"
        f"<td><span class='status {escape(str(r['status']))}'>{escape(str(r['status']))}"
        f"</span></td><td>{escape(str(r['kind']))}</td><td>{escape(str(r['summary']))}</td></tr>"
        for r in rows)
    body = (f"<table><tr><th>Job</th><th>Incident</th><th>Status</th><th>Kind</th>"
            f"<th>Summary</th></tr>{items}</table>" if rows else
            "<p class='muted'>No incidents yet.</p>")
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>rankwatch "
            f"incidents</title><style>{CSS}</style></head><body><h1>rankwatch incidents</h1>"
            f"{body}</body></html>")
