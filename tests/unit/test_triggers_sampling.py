"""Sampling (Mycroft §4.3): ≥ 1 rank per DP group, ≤ 10 per job, deterministic, re-sampling."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnosis.groups import grid_of
from diagnosis.triggers.sampling import needs_resample, sample_ranks
from tests.unit.topo_fixtures import megatron_topology

sizes = st.tuples(st.sampled_from([1, 2, 4, 8]), st.integers(1, 6), st.integers(1, 16))


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(sizes, st.booleans(), st.integers(0, 2**16))
def test_covers_every_dp_group_and_never_exceeds_ten(size, with_comms, dead_seed):
    tp, pp, dp = size
    topo = megatron_topology(tp, pp, dp, with_comms=with_comms)
    grid = grid_of(topo)
    dead = {dead_seed % topo.world_size} if dp > 1 else set()
    sample = sample_ranks(topo, dead=dead)
    assert 1 <= len(sample.ranks) <= 10
    assert not set(sample.ranks) & dead
    groups = grid.comms("dp")
    if len(groups) <= 10:
        for c in groups:
            assert set(grid.comm_members[c].tolist()) & set(sample.ranks), c
        assert sample.full_coverage
    if pp <= 10:  # beyond ten groups every PP stage is still watched
        assert sample.stages == tuple(range(pp))


def test_deterministic_and_resample_replaces_only_the_dead_rank():
    topo = megatron_topology(2, 2, 4)
    a = sample_ranks(topo)
    assert a == sample_ranks(topo)
    victim = a.ranks[0]
    assert needs_resample(a, [victim]) and not needs_resample(a, [r for r in range(16)
                                                                 if r not in a.ranks])
    b = sample_ranks(topo, dead=[victim])
    assert victim not in b.ranks
    assert len(set(a.ranks) - set(b.ranks)) == 1
    assert b.full_coverage


def test_more_groups_than_cap_spreads_over_stages():
    topo = megatron_topology(8, 2, 2)  # Mycroft's testbed: 16 DP groups
    s = sample_ranks(topo)
    assert len(s.ranks) == 10 and s.stages == (0, 1) and s.dp_groups == 16
    assert not s.full_coverage
