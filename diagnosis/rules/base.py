"""The one result type every root-cause rule returns.

A rule is a pure function over arrays (plus an explicit clock where time matters) that returns a
list of `Finding` values; an empty list means "nothing to report". Agents turn findings into
diagnoses; rules never do I/O. Keep this module small: it is shared by the ARGUS, StageFrontier,
Mycroft and VenusTrace rules.

Field meanings:
- `rule`: dotted rule name, e.g. "argus.l2" or "stagefrontier"; stable, shown in diagnoses.
- `culprit_ranks`: ranks the rule blames (not the ranks that merely waited), ascending.
- `stage`: the stage it points to (a stage name of the `stages` record, an event name, a kernel
  name, ...) or None.
- `component`: one of `COMPONENTS` or None when the rule cannot tell.
- `score`: rule-specific strength, larger is stronger; its meaning is in the rule's docstring.
- `labels`: evidence labels (e.g. StageFrontier's "co_critical"); order is not significant.
- `onset_ns`: when the anomaly began (producer realtime clock, ns) if the rule knows it.
- `evidence`: small JSON-able values an operator can check (thresholds used, per-rank numbers).
- `kind`: what the rule concluded about the job — one of `KINDS` (hang, slowdown, jitter,
  regression) — or None when the rule does not say (optional; added for the Mycroft and
  VenusTrace rules, which know whether they explain a hang or a slowdown).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Component = Literal["gpu_compute", "nic_rdma", "pcie_host", "data_loader", "host_software"]
COMPONENTS: tuple[Component, ...] = (
    "gpu_compute",
    "nic_rdma",
    "pcie_host",
    "data_loader",
    "host_software",
)

Kind = Literal["hang", "slowdown", "jitter", "regression"]
KINDS: tuple[Kind, ...] = ("hang", "slowdown", "jitter", "regression")


@dataclass(frozen=True)
class Finding:
    """One conclusion of one rule (see the module docstring for each field)."""

    rule: str
    culprit_ranks: tuple[int, ...] = ()
    stage: str | None = None
    component: Component | None = None
    score: float = 0.0
    labels: tuple[str, ...] = ()
    onset_ns: int | None = None
    evidence: Mapping[str, object] = field(default_factory=dict)
    kind: Kind | None = None
