"""Incident state: open once, update when the conclusion changes, resolve on recovery.

An incident is keyed by (job_id, class) with class "hang" for hangs and "performance" for
slowdowns, jitter and regressions — a hang during an open slowdown is news, a second slowdown
trigger during an open slowdown is not. Pure and small: the agent persists every published
version in the `diagnoses` table and rebuilds this book from it on restart (`restore`), so the
state is durable without a store of its own.

Rules:
- `conclude`: no open incident → version 1, status "open"; open and the conclusion (kind,
  culprit ranks, stage, component) differs → next version, status "updated"; the same conclusion
  whose confidence rose into "high" (≥ 0.8) from a lower label → next version too (the evidence
  firmed up: e.g. the culprit's CPU could not be judged one beat after the onset and now is);
  otherwise nothing (not re-announced; a confidence that falls is not news).
- `clear`: called when a re-analysis finds nothing; after `clear_after` consecutive clears the
  incident closes with a "resolved" version carrying the last conclusion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from diagnosis.model import Diagnosis


def incident_class(kind: str) -> str:
    return "hang" if kind == "hang" else "performance"


def incident_id(job_id: str, cls: str, detected_ns: int) -> str:
    h = hashlib.blake2b(f"{job_id}:{cls}:{detected_ns}".encode(), digest_size=6).hexdigest()
    return f"{job_id}:{cls}:{h}"


@dataclass
class IncidentBook:
    clear_after: int = 2
    open: dict[tuple[str, str], Diagnosis] = field(default_factory=dict)
    clears: dict[tuple[str, str], int] = field(default_factory=dict)

    def is_open(self, job_id: str, cls: str) -> bool:
        return (job_id, cls) in self.open

    def current(self, job_id: str, cls: str) -> Diagnosis | None:
        return self.open.get((job_id, cls))

    def conclude(self, d: Diagnosis) -> Diagnosis | None:
        """`d` is a candidate version 1 ("open"); returns what to publish, if anything."""
        key = (d.job_id, incident_class(d.kind))
        self.clears.pop(key, None)
        cur = self.open.get(key)
        if cur is None:
            self.open[key] = d
            return d
        if cur.conclusion() == d.conclusion() and not (
                d.confidence_label == "high" and cur.confidence_label != "high"):
            return None
        upd = d.model_copy(update={"incident_id": cur.incident_id, "version": cur.version + 1,
                                   "status": "updated", "id": f"{cur.incident_id}/"
                                   f"{cur.version + 1}", "onset_ns": cur.onset_ns or d.onset_ns})
        self.open[key] = upd
        return upd

    def clear(self, job_id: str, cls: str, now_ns: int) -> Diagnosis | None:
        key = (job_id, cls)
        cur = self.open.get(key)
        if cur is None:
            return None
        n = self.clears.get(key, 0) + 1
        self.clears[key] = n
        if n < self.clear_after:
            return None
        del self.open[key]
        self.clears.pop(key, None)
        v = cur.version + 1
        return cur.model_copy(update={"version": v, "status": "resolved", "detected_ns": now_ns,
                                      "id": f"{cur.incident_id}/{v}"})

    def restore(self, versions: Iterable[Diagnosis]) -> None:
        """Rebuild from stored versions (any order): the newest version of each incident that
        is not resolved is open."""
        latest: dict[str, Diagnosis] = {}
        for d in versions:
            if d.incident_id not in latest or d.version > latest[d.incident_id].version:
                latest[d.incident_id] = d
        for d in latest.values():
            if d.status != "resolved":
                self.open[(d.job_id, incident_class(d.kind))] = d
