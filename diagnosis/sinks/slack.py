"""Slack incoming webhook: one readable message per version (Block Kit: a header, the summary,
culprit / stage / component / confidence fields, evidence lines, the SQL to run next, and the
incident id and page in a footer), with a plain `text` fallback for notifications.

Slack takes about one message per second per webhook: the sink's `min_interval_s` (default 1 s
for slack sinks) spaces requests, and a 429 is retried after its Retry-After. Text from the
diagnosis is escaped (&, <, >) so it cannot form links or mentions, and clipped to Block Kit's
limits (header 150, section 3,000 characters).

API: https://api.slack.com/messaging/webhooks, https://api.slack.com/reference/block-kit/blocks
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from diagnosis.model import Diagnosis
from diagnosis.sinks import text
from diagnosis.sinks.base import Request, Verdict, clip, http_verdict

DEFAULT_MIN_INTERVAL_S = 1.0


def esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _section(md: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": clip(md, 3000)}}


def message(d: Diagnosis, page_url: str = "") -> dict[str, Any]:
    icon = {"open": ":rotating_light:", "updated": ":warning:",
            "resolved": ":white_check_mark:"}[d.status]
    fields = [("Culprit ranks", text.ranks_text(d.culprit_ranks)),
              ("Hosts", text.hosts_text(d.culprit_hosts)), ("Stage", str(d.stage)),
              ("Component", str(d.component)),
              ("Confidence", f"{d.confidence:.2f} ({d.confidence_label})"),
              ("Kind", d.kind)]
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "emoji": True,
                                    "text": clip(f"{icon} {text.headline(d)}", 150)}},
        _section(esc(text.summary(d))),
        {"type": "section", "fields": [{"type": "mrkdwn", "text": clip(f"*{k}*\n{esc(v)}", 2000)}
                                       for k, v in fields]},
    ]
    ev = text.evidence_lines(d)
    if ev:
        blocks.append(_section("*Evidence*\n" + "\n".join(f"• {esc(x)}" for x in ev)))
    sql = text.first_sql(d)
    if sql:
        blocks.append(_section("*Next query*\n```" + esc(clip(sql, 2800)) + "```"))
    page = text.page_link(page_url, d)
    foot = f"incident `{esc(d.incident_id)}` · version {d.version}"
    if page:
        foot += f" · <{page}|incident page>"
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": clip(foot, 3000)}]})
    return {"text": clip(esc(f"{text.headline(d)}: {text.summary(d)}"), 3000), "blocks": blocks}


class SlackSink:
    kind = "slack"

    def __init__(self, name: str, url: str, page_url: str = "") -> None:
        self.name = name
        self.url = url
        self.page_url = page_url

    def requests(self, d: Diagnosis, raw: bytes, now_ns: int) -> list[Request]:
        body = orjson.dumps(message(d, self.page_url))
        return [Request(self.url, body, {"Content-Type": "application/json"})]

    def classify(self, status: int, headers: Mapping[str, str], body: bytes) -> Verdict:
        return http_verdict(status, headers, body)
