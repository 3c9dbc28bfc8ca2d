"""A rank named for a slower network path whose PCIe link is what slowed: its host-to-device
copies slowed at the same onset.

A rank's PCIe link carries two things: the host-to-device copies of each batch (inside its
`data_next_wait` phase: the loader's wait plus the copy to the device) and the NIC's reads and
writes of the device's memory for every transfer (GPUDirect RDMA). A slower NIC, or a loaded
link beyond it, slows only the transfers. So a culprit named for its network path (component
nic_rdma, one rank) whose data phase rose at the same onset, beyond that phase's own noise, has
its PCIe path degraded (pcie_host). Mycroft's evaluation (§7.1, injected faults #3 and #4)
finds a downgraded PCIe link and a GPU power limit by one signature, the rank that finishes its
collectives last, and does not tell them apart; this looks instead at the one path a PCIe link
carries and a NIC does not.

The copies are a small part of a step (6 ms of 700 in the simulated 25 % PCIe link), far
below what makes a culprit (`SlowConfig.min_share`), so the data phase is judged here against
its own noise only (`context.own_change` without a materiality floor: the rank's excess over
its stage peers rose by `z_change` σ, above its baseline's band on at least 80 % of its newest
steps), and its onset must lie within `onset_steps` of the link's. A rank starved of CPU
slows its data phase too; `cpu.refine` runs after this and names the CPU where the
scheduler's counters show it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from diagnosis.conclusion import Suspicion
from diagnosis.slow.context import Ctx, own_change, reference, stage_matrix

RULE = "rankwatch.pcie.h2d_with_link"


def refine(ctx: Ctx, top: Suspicion) -> Suspicion:
    """`top` itself, or — a one-rank network culprit whose data phase rose with its link
    (module docstring) — the same suspect with component pcie_host."""
    if top.component != "nic_rdma" or len(top.ranks) != 1 or top.whole_ring \
            or top.onset_step < 0:
        return top
    x = top.ranks[0]
    m = stage_matrix(ctx, "data_next_wait")
    if x >= m.shape[1]:
        return top
    ref = reference(m, ctx.stage_of)
    with np.errstate(invalid="ignore"):
        d = m[:, x] - ref[:, x]
    if np.isnan(d).all():
        return top
    res = own_change(ctx, d, m[:, x], ref[:, x], 0.0, ctx.cfg.min_ratio)
    if res is None:
        return top
    exc, ratio, z, since = res
    onset = int(ctx.steps[max(ctx.steps.size - since, 0)])
    if abs(onset - top.onset_step) > ctx.cfg.onset_steps:
        return top
    return replace(top, component="pcie_host", rules=(*top.rules, RULE),
                   summary=f"{top.summary}; its host-to-device copies (data phase) "
                           f"{ratio:.2f}x its peers' from step {onset}, +{exc / 1e6:.1f} "
                           f"ms/step ({z:.1f}σ of their own noise), with its transfers: its "
                           "PCIe path, which carries both")
