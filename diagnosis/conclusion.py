"""What a root-cause analysis concludes before it becomes a versioned `Diagnosis`.

`hang_rca` and `diagnosis.slow` each return a `Conclusion` (or None: nothing to report); the engine
adds identity, trigger, hosts, SQL and incident state. `findings` are the rule outputs that
support the conclusion (their rule names become `Diagnosis.rules`); `suspects` are further
culprits when several faults act at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diagnosis.rules.base import Component, Finding, Kind


@dataclass(frozen=True)
class Suspicion:
    ranks: tuple[int, ...]
    stage: str | None
    component: Component | None
    score: float  # excess ns per step it explains (slowdowns), or rule score (hangs)
    rules: tuple[str, ...] = ()
    summary: str = ""
    z: float = 0.0  # strength of the evidence, in robust σ of the quantity's own noise
    how: str = ""  # how the excess stood out: change, outlier, sparse, confirm
    onset_step: int = -1  # the first step in excess (-1: unknown)
    #: the ranks are a ring the evidence could not narrow to the member that slowed it
    whole_ring: bool = False
    #: judged against its own past alone (a unit with no like unit: a DDP job's one ring)
    own_past: bool = False


@dataclass(frozen=True)
class Conclusion:
    kind: Kind
    ranks: tuple[int, ...]
    stage: str | None
    component: Component | None
    confidence: float
    onset_ns: int | None = None
    stages: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()
    summaries: tuple[tuple[str, str], ...] = ()  # (rule, one-line summary)
    suspects: tuple[Suspicion, ...] = field(default=())
