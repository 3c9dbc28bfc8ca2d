"""Simulator building blocks: fault specs, 1F1B schedule, Megatron rank order, catalog."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ingest.sim.faults import FAMILIES, FaultSpecError, parse_duration, parse_fault
from ingest.sim.scenario import load_catalog
from ingest.sim.schedule import global_order, stage_order
from ingest.sim.topology import Layout


def test_parse_hang_spec() -> None:
    f = parse_fault("hang rank=13 stage=bwd mb=3 at=30s")
    assert f.family == "hang" and f.ranks == (13,) and f.at == 30.0 and f.duration is None
    assert f.stage == "bwd" and f.mb == 3  # type: ignore[attr-defined]
    g = parse_fault("nic_bw host=1,2 factor=0.25 at=500ms for=2m expect=no")
    assert g.hosts == (1, 2) and g.at == 0.5 and g.end == 120.5 and not g.expect


@pytest.mark.parametrize("spec, needle", [
    ("hung rank=1", "valid families"),
    ("hang rank=1 colour=red", "valid keys: rank, host, at, for, expect, stage, mb"),
    ("hang rank=1 stage=sideways", "fwd|bwd|optim|data"),
    ("nic_bw rank=1 factor=3", "bandwidth fraction"),
    ("gpu_slow factor=2", "needs rank= or host="),
    ("hang rank=x", "expected integers"),
    ("hang rank=1 at=soon", "not a duration"),
    ("", "valid families"),
])
def test_bad_specs_say_what_is_valid(spec: str, needle: str) -> None:
    with pytest.raises(FaultSpecError) as e:
        parse_fault(spec)
    assert needle in str(e.value)
    if "families" in needle:
        assert all(name in str(e.value) for name in FAMILIES)


def test_rank_outside_world_is_rejected() -> None:
    with pytest.raises(FaultSpecError, match=r"outside 0\.\.63"):
        parse_fault("hang rank=64").target(Layout(2, 4, 8))


def test_durations() -> None:
    assert parse_duration("250ms") == 0.25 and parse_duration("2m") == 120
    assert parse_duration("inf") is None and parse_duration("3") == 3.0


def test_host_level_fault_covers_the_host() -> None:
    f = parse_fault("cpu_contention rank=9 factor=2")
    assert f.target(Layout(2, 4, 8)).tolist() == list(range(8, 16))


@pytest.mark.parametrize("pp, m", [(1, 4), (2, 3), (4, 8), (8, 4)])
def test_1f1b_shape(pp: int, m: int) -> None:
    for s in range(pp):
        order = stage_order(pp, m, s)
        warm = min(pp - s - 1, m)
        assert [k for k, _ in order[:warm]] == ["F"] * warm
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        fwd = [mb for k, mb in order if k == "F"]
        assert fwd == sorted(fwd)
    glob = global_order(pp, m)
    seen = set()
    for s, kind, mb in glob:  # dependencies come first
        if kind == "F" and s > 0:
            assert (s - 1, "F", mb) in seen
        if kind == "B":
            assert (s + 1, "B", mb) in seen if s < pp - 1 else (s, "F", mb) in seen
        seen.add((s, kind, mb))


def test_megatron_rank_order_and_topology() -> None:
    lay = Layout(tp=2, pp=4, dp=8)
    assert lay.grid[3, 1, 1] == 1 + 2 * (3 + 8 * 1)
    assert lay.position(23) == (3, 1, 1)
    assert sorted(lay.grid.ravel().tolist()) == list(range(64))
    topo = lay.topology("j", 1, 8)
    assert topo.world_size == 64 and topo.hosts[8] == "node0001"
    kinds = {c.kind for c in topo.communicators}
    assert kinds == {"tp", "pp", "dp", "world"}
    tp = next(c for c in topo.communicators if c.comm_id == "tp:pp1:dp3")
    assert tp.members == [22, 23]


def test_catalog_covers_families_sizes_controls() -> None:
    cat = load_catalog()
    families = {parse_fault(f).family for c in (cat, load_catalog("realistic"))
                for sc in c.values() for f in sc.faults}
    assert families == set(FAMILIES)
    sizes = {sc.config.world for sc in cat.values()}
    assert min(sizes) == 8 and max(sizes) == 4096
    assert any(not sc.faults for sc in cat.values())
    assert any(len(sc.faults) > 1 for sc in cat.values())
    small = [sc for sc in cat.values() if any(not parse_fault(f).expect for f in sc.faults)]
    assert len(small) >= 8
    assert all(math.isfinite(sc.config.hang_tail_s) for sc in cat.values())
    assert np.all([sc.config.job_id == name for name, sc in cat.items()])
