"""streams.ownership: Kafka's murmur2 partitioner and one owner per job."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from streams.ownership import Ownership, job_partition, murmur2, owned_jobs


@pytest.mark.parametrize(("data", "expected"), [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
])
def test_murmur2_matches_the_java_clients_values(data: bytes, expected: int) -> None:
    assert murmur2(data) == expected


@given(st.text(min_size=1, max_size=80), st.integers(1, 64))
def test_home_partition_is_where_faust_producers_put_a_job_keyed_message(job: str,
                                                                         partitions: int) -> None:
    key = job.encode()
    assert job_partition(job, partitions) == DefaultPartitioner()(
        key, list(range(partitions)), list(range(partitions)))


def test_every_job_has_exactly_one_owner() -> None:
    jobs = [f"job-{i}" for i in range(200)]
    workers = [{0, 3}, {1, 4}, {2, 5}]
    owned = [owned_jobs(jobs, w, 6) for w in workers]
    assert sum(len(o) for o in owned) == len(jobs)
    assert set().union(*owned) == set(jobs)
    assert all(len(o) > 30 for o in owned)  # spread, not all on one worker
    assert owned_jobs(jobs, set(range(6)), 6) == frozenset(jobs)
    assert owned_jobs(jobs, set(), 6) == frozenset()


def test_refusals() -> None:
    with pytest.raises(ValueError, match="partitions"):
        job_partition("j", 0)
    with pytest.raises(ValueError, match="empty"):
        job_partition("", 6)
    with pytest.raises(ValueError, match="outside"):
        owned_jobs(["j"], {6}, 6)


def test_ownership_follows_assignments() -> None:
    jobs = [f"job-{i}" for i in range(50)]
    standalone = Ownership()
    assert all(standalone.owns(j) for j in jobs) and standalone.generation == 0
    w = Ownership(standalone=False)
    assert not any(w.owns(j) for j in jobs)  # nothing before the first assignment
    w.assign([0, 2], 4)
    assert w.generation == 1
    assert frozenset(j for j in jobs if w.owns(j)) == owned_jobs(jobs, {0, 2}, 4)
    w.assign([1], 4)  # a rebalance: the cached answers are dropped
    assert w.generation == 2
    assert frozenset(j for j in jobs if w.owns(j)) == owned_jobs(jobs, {1}, 4)
    with pytest.raises(ValueError, match="outside"):
        w.assign([4], 4)
