"""Topic names, prefixes and the shapes `rankwatch up` creates (ingest/topics.py)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from ingest.records import KINDS
from ingest.topics import Topics
from rankwatch.settings import Settings

YEAR_MS = 365 * 24 * 3600 * 1000
RAW = ("ops", "flows", "chunks", "stages", "kernels", "wr", "beats")
JOB_KEYED = ("progress", "iterations", "kernel_summaries", "triggers", "stored")


def test_default_names_follow_the_design():
    t = Topics()
    assert t.ops == "rw.ops"
    assert t.diagnoses == "rw.diagnoses"
    assert all(getattr(t, f.name) == f"rw.{f.name}" for f in fields(t))


def test_with_prefix_renames_every_topic():
    t = Topics.with_prefix("t1234")
    names = [getattr(t, f.name) for f in fields(t)]
    assert all(n.startswith("t1234.") for n in names)
    assert len(set(names)) == len(names)
    assert t.kernel_summaries == "t1234.kernel_summaries"


def test_for_kind_maps_every_record_kind_to_its_raw_topic():
    t = Topics.with_prefix("p")
    for kind in KINDS:
        assert t.for_kind(kind) == f"p.{kind}"


@pytest.mark.parametrize("partitions", [1, 2, 6, 7])
def test_specs_cover_each_topic_once_with_its_shape(partitions):
    t = Topics.with_prefix("x")
    specs = {s.name: s for s in t.specs(partitions)}
    assert set(specs) == {getattr(t, f.name) for f in fields(t)}
    jobs = specs["x.jobs"]
    assert (jobs.partitions, jobs.compacted, jobs.retention_ms) == (1, True, -1)
    for k in RAW:
        assert specs[f"x.{k}"].partitions == partitions
        assert not specs[f"x.{k}"].compacted
    for k in JOB_KEYED:  # job-keyed: one owner per job (streams.ownership)
        assert specs[f"x.{k}"].partitions == partitions
    assert specs["x.dlq"].partitions == max(1, partitions // 2)
    assert specs["x.diagnoses"].retention_ms == YEAR_MS
    assert all(s.partitions >= 1 for s in specs.values())


def test_settings_choose_the_prefix():
    assert Settings.load(env={}).topics == Topics()
    assert Settings.load(env={"RANKWATCH_TOPIC_PREFIX": "dev"}).topics.ops == "dev.ops"
