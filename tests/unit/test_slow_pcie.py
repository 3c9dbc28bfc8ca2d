"""`slow.pcie`: a rank named for its network path is its PCIe link when its host-to-device
copies slowed at the same onset — and stays its NIC when they did not. On the simulator's
16-rank job (tp2·pp2·dp4): a PCIe link at 25 % slows the rank's transfers and its data phase's
copies; a NIC at 25 % of its bandwidth slows the transfers only."""

from __future__ import annotations

import functools

from diagnosis import slow
from diagnosis.slow.pcie import RULE
from diagnosis.window import Window
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect


@functools.cache
def conclusion(fault: str) -> tuple[tuple[int, ...], str | None, tuple[str, ...]]:
    d = collect(Simulation(JobConfig(job_id="t", tp=2, pp=2, dp=4, steps=40), [fault]).batches())
    topo = d.pop("jobs")["topology"][0]
    now = int(max(d["beats"]["ts"].max(), d["ops"]["t_enqueue"].max()))
    c = slow.analyze(Window(topo, d, 0, now), now)
    assert c is not None, fault
    return c.ranks, c.component, tuple(f.rule for f in c.findings)


def test_a_slower_pcie_link_is_named_by_its_copies() -> None:
    ranks, component, rules = conclusion("pcie rank=10 factor=0.25 at=6s")
    assert ranks == (10,) and component == "pcie_host" and RULE in rules


def test_a_slower_nic_stays_the_nic() -> None:
    ranks, component, rules = conclusion("nic_bw rank=10 factor=0.25 at=6s")
    assert ranks == (10,) and component == "nic_rdma" and RULE not in rules
