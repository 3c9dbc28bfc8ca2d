"""The one result type every trigger returns.

A trigger is the cheap, always-on half of diagnosis (DESIGN.md "Diagnosis", Mycroft §4.3): it
watches a sample of ranks (or a cheap per-rank signal) and says *that* something is wrong and
*when*; root-cause rules then explain it over the job's window. A trigger names the ranks on
which it saw the symptom — they are where the anomaly was observed, not necessarily its cause.

Field meanings:
- `job_id`: the job.
- `ts`: the trigger's clock reading (the `now_ns` it was evaluated at), ns.
- `kind`: one of `TRIGGER_KINDS`: failure (Mycroft: no op completed in Δ), straggler (Mycroft:
  throughput halved or op interval doubled), hang (VenusTrace: no progress for n × expected step
  time), jitter and regression (step-time triggers; heartbeat.py reports a re-baselined expected
  step time as a regression).
- `ranks`: ranks on which the symptom was observed, ascending.
- `evidence`: small JSON-able values (thresholds, baselines, the in-flight op).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

TriggerKind = Literal["failure", "straggler", "hang", "jitter", "regression"]
TRIGGER_KINDS: tuple[TriggerKind, ...] = ("failure", "straggler", "hang", "jitter", "regression")


@dataclass(frozen=True)
class Trigger:
    """One trigger firing (see the module docstring for each field)."""

    job_id: str
    ts: int
    kind: TriggerKind
    ranks: tuple[int, ...] = ()
    evidence: Mapping[str, object] = field(default_factory=dict)
