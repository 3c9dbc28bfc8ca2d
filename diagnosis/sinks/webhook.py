"""Generic webhook: the diagnosis JSON exactly as published on rw.diagnoses, signed.

Headers:
- `Idempotency-Key: <id>` — the version's id (`<incident_id>/<version>`): a receiver that sees a
  key twice has the version already;
- `X-Rankwatch-Timestamp: <unix seconds>` and
  `X-Rankwatch-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>." + body)>` — the
  receiver recomputes it with the shared secret, compares in constant time, and rejects
  timestamps far from its clock (a replayed request). `verify` below is that check.

2xx is delivered; no answer, 408, 425, 429 and 5xx are retried; any other 4xx is refused.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from diagnosis.model import Diagnosis
from diagnosis.sinks.base import Request, Verdict, http_verdict
from ingest.units import SECOND

SIGNATURE_HEADER = "X-Rankwatch-Signature"
TIMESTAMP_HEADER = "X-Rankwatch-Timestamp"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(secret: str, headers: Mapping[str, str], body: bytes, now_s: float,
           tolerance_s: float = 300.0) -> bool:
    """The receiver's check: a valid signature over a timestamp within `tolerance_s`."""
    h = {k.lower(): v for k, v in headers.items()}
    ts, sig = h.get(TIMESTAMP_HEADER.lower(), ""), h.get(SIGNATURE_HEADER.lower(), "")
    try:
        fresh = abs(now_s - int(ts)) <= tolerance_s
    except ValueError:
        return False
    return fresh and hmac.compare_digest(signature(secret, ts, body), sig)


class WebhookSink:
    kind = "webhook"

    def __init__(self, name: str, url: str, secret: str) -> None:
        self.name = name
        self.url = url
        self.secret = secret

    def requests(self, d: Diagnosis, raw: bytes, now_ns: int) -> list[Request]:
        ts = str(now_ns // SECOND)
        return [Request(self.url, raw, {"Content-Type": "application/json",
                                        IDEMPOTENCY_HEADER: d.id, TIMESTAMP_HEADER: ts,
                                        SIGNATURE_HEADER: signature(self.secret, ts, raw)})]

    def classify(self, status: int, headers: Mapping[str, str], body: bytes) -> Verdict:
        return http_verdict(status, headers, body)
