"""The small protocol every sink implements, and the HTTP request/answer types it speaks.

A sink turns one diagnosis version into the HTTP requests that deliver it (`requests`) and says
what an answer means (`classify`): delivered, worth retrying (after at least a given delay), or
refused for good (a payload the receiver will never take: retrying would only repeat the
refusal). Sinks do no I/O; `diagnosis.sinks.delivery` sends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from diagnosis.model import Diagnosis


@dataclass(frozen=True)
class Request:
    """One HTTP POST."""

    url: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


class Outcome(Enum):
    DELIVERED = "delivered"
    RETRY = "retry"
    REFUSED = "refused"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str = ""
    #: the receiver asked to wait at least this long (Retry-After), seconds
    retry_after_s: float = 0.0


class Sink(Protocol):
    """One destination. `name` is the config's; `kind` its type (alertmanager, pagerduty, …)."""

    name: str
    kind: str

    def requests(self, d: Diagnosis, raw: bytes, now_ns: int) -> list[Request]:
        """The requests that deliver version `d` (`raw`: its bytes as published)."""
        ...

    def classify(self, status: int, headers: Mapping[str, str], body: bytes) -> Verdict:
        """What HTTP `status` (0: no answer, connection failed) means for this sink."""
        ...


def retry_after(headers: Mapping[str, str]) -> float:
    """Seconds from a Retry-After header given in seconds (HTTP dates are ignored), else 0."""
    for k, v in headers.items():
        if k.lower() == "retry-after":
            try:
                return max(0.0, min(float(v), 3600.0))
            except ValueError:
                return 0.0
    return 0.0


def http_verdict(status: int, headers: Mapping[str, str], body: bytes,
                 retryable_4xx: frozenset[int] = frozenset({408, 425, 429})) -> Verdict:
    """The common reading: 2xx delivered; no answer, 5xx and `retryable_4xx` retried; any
    other answer refused."""
    text = body[:200].decode(errors="replace").strip()
    if 200 <= status < 300:
        return Verdict(Outcome.DELIVERED)
    if status == 0 or status >= 500 or status in retryable_4xx:
        why = "no answer" if status == 0 else f"HTTP {status} {text}".strip()
        return Verdict(Outcome.RETRY, why, retry_after(headers))
    return Verdict(Outcome.REFUSED, f"HTTP {status} {text}".strip())


def iso(ns: int) -> str:
    """RFC 3339 UTC with milliseconds, as Alertmanager and PagerDuty take it."""
    import datetime as dt

    t = dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: max(0, n - 1)] + "…"
