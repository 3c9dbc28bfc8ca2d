"""Ground truth of injected faults: what a diagnosis should find. Never part of the records.

One `TruthRecord` per fault: the job, the family, the spec it came from, the ranks and hosts it
acted on, a stage label in the words a diagnosis uses ("bwd mb=3 pp=1", "dp_allreduce", "data",
"callbacks", "compute", "kernel attn", "host cpu", "process"), the component (gpu, nic, pcie,
host, dataloader, software), onset and end in ns of true job time (no host clock offset; end 0
when permanent), a magnitude (factor, added delay or hang length in seconds; inf for a permanent
hang) and `expect_diagnosis`, false for faults too small to matter.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ingest.sim import faults as F
from ingest.sim.topology import Layout

Component = Literal["gpu", "nic", "pcie", "host", "dataloader", "software"]


class TruthRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    fault: str
    spec: str
    ranks: list[int]
    hosts: list[str]
    stage: str
    component: Component
    start_ns: int
    end_ns: int
    magnitude: float | None  # None: unbounded (a permanent hang)
    expect_diagnosis: bool


def component_of(fault: F.Fault) -> Component:
    if isinstance(fault, (F.Hang, F.StageSlow)) and fault.stage == "data":
        return "dataloader"
    c = fault.component
    assert c in ("gpu", "nic", "pcie", "host", "dataloader", "software")
    return c  # type: ignore[return-value]


def truth_records(job_id: str, layout: Layout, faults: F.FaultSet, onsets: dict[int, float],
                  epoch_ns: int) -> list[TruthRecord]:
    out = []
    for i, (f, ranks) in enumerate(zip(faults.faults, faults.targets, strict=True)):
        onset = onsets.get(i, f.at)
        end = 0 if f.duration is None else epoch_ns + round((onset + f.duration) * 1e9)
        hosts = sorted({int(layout.host_of[r]) for r in ranks})
        mag = f.magnitude
        out.append(TruthRecord(
            job_id=job_id, fault=f.family, spec=f.spec, ranks=[int(r) for r in ranks],
            hosts=[layout.host_name(h) for h in hosts], stage=f.stage_label(layout),
            component=component_of(f), start_ns=epoch_ns + round(onset * 1e9), end_ns=end,
            magnitude=None if math.isinf(mag) else mag, expect_diagnosis=f.expect,
        ))
    return out
