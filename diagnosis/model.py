"""The public output of diagnosis: `Diagnosis` (rw.diagnoses, table `diagnoses`) and the trigger
record (`TriggerRecord`, rw.triggers). Schema version 1; docs/diagnoses.md documents both and
embeds their JSON schema (`rankwatch eval` and `rankwatch tail diagnoses` read them back).

A diagnosis is one version of one incident. The first version of an incident has status "open";
a later version with a different conclusion (culprit, stage, component or kind) has status
"updated"; when the job recovers (progress resumes, step times return to normal) a last version
with status "resolved" closes it. `id` is `<incident_id>/<version>`, so a consumer can de-dup
redelivered messages by id and order them by version.

Vocabulary (also what `rankwatch eval` scores against the simulator's ground truth):
- `kind`: hang | slowdown | jitter | regression (diagnosis.rules.base.KINDS);
- `stage`: a 1F1B node "fwd mb=3 pp=1" / "bwd mb=0 pp=2", or one of "dp_allreduce",
  "pp_p2p", "tp_collectives", "data", "optim", "callbacks", "host cpu", "compute",
  "kernel <class>" (gemm, attn, elementwise, optimizer), "process" (the process died),
  "between_steps"; `stages` ranks the candidates (top-1 first, then alternatives);
- `component`: gpu_compute | nic_rdma | pcie_host | data_loader | host_software
  (diagnosis.rules.base.COMPONENTS), None when undecided.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from diagnosis.rules.base import Component, Kind
from diagnosis.triggers.base import TriggerKind

SCHEMA_VERSION = 1
Status = Literal["open", "updated", "resolved"]
ConfidenceLabel = Literal["high", "medium", "low"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Evidence(_Model):
    """What one rule saw: a one-line summary, small JSON values, and SQL an operator can run."""

    rule: str
    summary: str
    data: dict[str, Any] = Field(default_factory=dict)
    sql: str = ""


class Suspect(_Model):
    """A further culprit of the same incident (several faults at once), ranked by excess time."""

    ranks: list[int]
    hosts: list[str]
    stage: str | None
    component: Component | None
    score: float


class TriggerRef(_Model):
    kind: TriggerKind
    ts: int
    ranks: list[int]
    rule: str


class Diagnosis(_Model):
    """One version of one incident (see the module docstring)."""

    v: Literal[1] = 1
    id: str
    job_id: str
    incident_id: str
    version: int = Field(ge=1)
    status: Status
    kind: Kind
    culprit_ranks: list[int]
    culprit_hosts: list[str]
    stage: str | None
    stages: list[str] = Field(default_factory=list)
    component: Component | None
    onset_ns: int | None
    detected_ns: int
    confidence: float = Field(ge=0.0, le=1.0)
    confidence_label: ConfidenceLabel
    labels: list[str] = Field(default_factory=list)
    rules: list[str] = Field(default_factory=list)
    trigger: TriggerRef
    suspects: list[Suspect] = Field(default_factory=list)
    evidence: list[Evidence] = Field(default_factory=list)
    sql: list[str] = Field(default_factory=list)
    summary: str = ""
    analysis_ms: float = 0.0

    def conclusion(self) -> tuple[object, ...]:
        """What makes two versions different (an update is published only when this changes):
        the primary culprit, and which further hosts are suspected of what — a second,
        independent fault found on a later check is news even when the primary stays."""
        others = frozenset((tuple(sorted(s.hosts)), s.component) for s in self.suspects)
        return (self.kind, tuple(self.culprit_ranks), self.stage, self.component, others)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


class TriggerRecord(_Model):
    """One trigger firing on rw.triggers (diagnosis.triggers.base.Trigger on the wire)."""

    v: Literal[1] = 1
    job_id: str
    ts: int
    kind: TriggerKind
    ranks: list[int] = Field(default_factory=list)
    evidence: dict[str, Any] = Field(default_factory=dict)


def confidence_label(c: float) -> ConfidenceLabel:
    return "high" if c >= 0.8 else "medium" if c >= 0.5 else "low"


def json_schemas() -> str:
    """The JSON schemas of both records, as docs/diagnoses.md embeds them."""
    return json.dumps({"Diagnosis": Diagnosis.model_json_schema(),
                       "TriggerRecord": TriggerRecord.model_json_schema()}, indent=2)
