"""The real catalog's quick subset, end to end: real PyTorch training (gloo, CPU, torchrun) traced
through ring, `rankwatch agent`, the broker, the worker and rw.diagnoses, scored against the
ground truth the jobs write (bench.real.harness — the code `rankwatch eval --real` runs).

Cases: a 4-rank DDP control; a 2-stage × 2 pipeline control beside two busy processes (more
runnable processes than cores); rank 3 of that pipeline with its backward 4× slower from step 40;
rank 2 of a DDP job hanging inside its backward at step 30.

Asserted: every case ran and wrote its truth; the report scores each case; no incident on the
two controls (the contended one too); the hung rank named as a hang inside its backward
(stage bwd, component gpu_compute: the tracer's stage entry in its beats); the slowed rank 3
named alone, after the onset, for its backward (stage bwd pp=1 counts as compute) on
gpu_compute. The agents' tees replay in process (`harness.rescore`) to the same hang verdict.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from bench.real import catalog, harness
from rankwatch.kafka.admin import delete_topics
from tests.conftest import KafkaService, SettingsFactory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def torch_ready(pytestconfig: pytest.Config) -> None:
    from ingest.torch import provision

    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        site = provision.torch_site()
    if site is None:
        pytest.skip(f"no CPU torch: {provision.last_error}")


def test_quick_subset_scored_end_to_end(kafka: KafkaService, settings_factory: SettingsFactory,
                                        tmp_path: Path) -> None:
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"r{uuid.uuid4().hex[:10]}", kafka_partitions=2)
    cases = catalog.select("", quick=True)
    assert [c.name for c in cases] == ["ctl-ddp4-100", "ctl-pp4-contended", "ddp4-hang-bwd",
                                       "pp4-slow-bwd-x4"]
    log: list[str] = []
    try:
        results, summary = harness.run_catalog(cases, log.append, home=tmp_path,
                                               settings=settings)
    finally:
        delete_topics(kafka.bootstrap, [s.name for s in settings.topics.specs(2)])
    by = {r.case: r for r in results}
    assert list(by) == [c.name for c in cases]
    assert all(f"] {c.name}:" in "\n".join(log) for c in cases)  # progress per case
    for r in results:
        assert not r.error, (r.case, r.error)
        assert r.agent_records and r.agent_records > 0, r.case  # records went through the agent
        assert r.agent_cpu_s is not None
    for name in ("ctl-ddp4-100", "ctl-pp4-contended"):
        r = by[name]
        assert r.control and r.exit_code == 0 and r.run is not None and r.run["traced"]
        assert r.false_alarms == r.incidents  # on a control every incident is a false alarm
        assert r.incidents == 0, (name, r.diagnoses)
    assert by["pp4-slow-bwd-x4"].step_ms_p50 is not None

    hang = by["ddp4-hang-bwd"]
    assert hang.truth is not None and hang.truth["ranks"] == [2]
    assert hang.truth["kind"] == "hang" and hang.truth["stage"] == "bwd mb=0 pp=0"
    assert hang.detected and hang.kind_ok and hang.ranks_ok, hang.diagnoses
    assert hang.stage_ok and hang.component_ok, hang.diagnoses
    assert hang.latency_s is not None and hang.latency_s > 0

    slow = by["pp4-slow-bwd-x4"]
    assert slow.truth is not None and slow.truth["ranks"] == [3]
    assert (slow.truth["kind"], slow.truth["stage"]) == ("slowdown", "compute")
    assert slow.truth["onset_ns"] > 0 and slow.run is not None
    assert slow.detected and slow.kind_ok and slow.ranks_ok, slow.diagnoses
    assert slow.stage_ok and slow.component_ok, slow.diagnoses

    # the agents teed what they published: the same jobs replay in process (`--rescore`)
    assert (tmp_path / "cases" / hang.job / harness.CAPTURE).stat().st_size > 0
    replayed, _ = harness.rescore(harness.report(results, summary), tmp_path, log.append)
    again = {r.case: r for r in replayed}["ddp4-hang-bwd"]
    assert again.detected and again.ranks_ok and again.stage_ok, again.diagnoses

    assert summary["cases"] == 4 and summary["faults"] == 2 and summary["controls"] == 2
    assert summary["recall"] is not None and summary["false_alarms_per_control_hour"] is not None
    text = harness.table(results, summary)
    assert all(c.name in text for c in cases) and "false alarms" in text
    assert harness.report(results, summary)["cases"][2]["case"] == "ddp4-hang-bwd"
