"""The real catalog's pure parts: case selection, the expected labels, and the scoring of
diagnoses against a job's truth (bench.real; the end-to-end run is tests/e2e/test_real_catalog)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.real import catalog
from bench.real.harness import (
    CaseResult,
    score,
    stage_ok,
    step_ratio,
    steps_after,
    summarize,
)
from diagnosis.model import Diagnosis, Status, Suspect, TriggerRef
from diagnosis.rules.base import Component, Kind
from ingest.units import SECOND as S

ONSET = 1_000 * S


def diag(inc: str, version: int, ranks: list[int], stage: str | None, comp: Component | None,
         at_s: float, kind: Kind = "hang", status: Status = "open", conf: float = 0.9,
         suspects: list[int] | None = None) -> Diagnosis:
    return Diagnosis(
        id=f"{inc}/{version}", job_id="j", incident_id=inc, version=version,
        status=status, kind=kind, culprit_ranks=ranks, culprit_hosts=["h"], stage=stage,
        component=comp, onset_ns=None, detected_ns=ONSET + int(at_s * S), confidence=conf,
        confidence_label="high", trigger=TriggerRef(kind="hang", ts=0, ranks=[], rule="r"),
        suspects=[Suspect(ranks=suspects, hosts=["h"], stage=None, component=None, score=1.0)]
        if suspects else [])


def fault_result(**truth: object) -> CaseResult:
    t = {"fault": "hang", "kind": "hang", "ranks": [2], "stage": "bwd mb=0 pp=0",
         "accept": ["bwd mb=0 pp=0", "bwd *"], "component": "gpu_compute", "onset_ns": ONSET,
         "end_ns": 0}
    t.update(truth)
    return CaseResult("c", "c-1", "ddp", 4, "", control=False, traced=True, truth=t,
                      step_ms_p50=50.0, step_ends_ms=[50.0 * i for i in range(1, 201)])


def test_latency_counts_to_the_topic_not_to_the_analysis_start() -> None:
    """A version's latency runs to its moment on rw.diagnoses, where the user gets it: the
    analysis that began at 4.8 s and was published at 6.3 s is 6.3 s late (126 steps of 50
    ms), not 4.8. Without a publication moment (a replay) `detected_ns` counts."""
    r = fault_result()
    first = diag("a", 1, [2], "bwd mb=0 pp=0", "gpu_compute", 4.8)
    score(r, [first], {first.id: ONSET + int(6.3 * S)})
    assert r.latency_s == 6.3 and r.latency_steps == 126.0
    assert r.diagnoses[0]["published_ns"] == ONSET + int(6.3 * S)
    score(r, [first], {"another/1": ONSET})
    assert r.latency_s == 4.8 and r.diagnoses[0]["published_ns"] is None


def test_stage_accept_prefix_and_exact() -> None:
    assert stage_ok(["bwd *"], "bwd mb=3 pp=1")
    assert not stage_ok(["bwd *"], "fwd mb=0 pp=0")
    assert stage_ok(["data"], "data") and not stage_ok(["data"], "dataloader")
    assert not stage_ok(["compute"], None)


def test_right_hang_scored_on_last_unresolved_version() -> None:
    r = fault_result()
    score(r, [diag("a", 1, [2], "fwd mb=0 pp=0", "gpu_compute", 4.8),
              diag("a", 2, [2], "bwd mb=0 pp=0", "gpu_compute", 6.0, status="updated"),
              diag("a", 3, [2], "bwd mb=0 pp=0", "gpu_compute", 9.0, status="resolved")])
    assert r.detected and r.kind_ok and r.ranks_ok and r.stage_ok and r.component_ok
    assert r.latency_s == 4.8 and r.latency_steps == 96.0 and r.resolved
    assert r.incidents == 1 and r.false_alarms == 0


def test_wrong_stage_extra_ranks_and_false_alarms() -> None:
    r = fault_result()
    score(r, [diag("early", 1, [2], "data", "data_loader", -1.0),  # before the onset
              diag("b", 1, [1, 2], "data", "data_loader", 5.0),
              diag("c", 1, [0], "optim", "gpu_compute", 6.0, kind="slowdown")])
    assert r.detected and r.kind_ok and not r.ranks_ok and not r.stage_ok
    assert not r.component_ok and r.got is not None and r.got["ranks"] == [1, 2]
    assert r.incidents == 3 and r.false_alarms == 2


def test_primary_culprit_preferred_to_a_suspect_and_missed_fault() -> None:
    r = fault_result()
    score(r, [diag("s", 1, [0], "dp_allreduce", "nic_rdma", 2.0, suspects=[2]),
              diag("p", 1, [2], "bwd mb=0 pp=0", "gpu_compute", 3.0)])
    assert r.got is not None and r.got["ranks"] == [2] and r.latency_s == 3.0
    assert r.false_alarms == 1  # the incident that only suspected rank 2


def test_an_incident_of_the_wrong_kind_is_not_about_the_fault() -> None:
    r = fault_result()
    score(r, [diag("j", 1, [0, 2], "optim", "gpu_compute", 1.0, kind="jitter"),
              diag("h", 1, [2], "data", "data_loader", 5.0)])
    assert r.got is not None and r.got["kind"] == "hang" and r.latency_s == 5.0
    assert r.ranks_ok and not r.stage_ok and r.false_alarms == 1
    missed = fault_result()
    score(missed, [diag("x", 1, [0], "data", "data_loader", 1.0)])
    assert not missed.detected and missed.false_alarms == 1 and missed.latency_s is None


def test_stall_may_be_named_a_slowdown() -> None:
    r = fault_result(fault="stall", stage="fwd mb=0 pp=0", accept=["fwd mb=0 pp=0", "fwd *"])
    score(r, [diag("a", 1, [2], "fwd mb=0 pp=0", "gpu_compute", 1.0, kind="slowdown")])
    assert r.kind_ok and r.stage_ok


def test_summary_counts_control_false_alarms_per_hour() -> None:
    ctl = CaseResult("ctl", "ctl-1", "ddp", 4, "", control=True, traced=True, job_s=36.0)
    score(ctl, [diag("z", 1, [0, 3], "data", "data_loader", 1.0, kind="jitter")])
    f = fault_result()
    score(f, [diag("a", 1, [2], "bwd mb=0 pp=0", "gpu_compute", 5.0)])
    s = summarize([ctl, f])
    assert s["control_false_alarms"] == 1 and s["false_alarms_per_control_hour"] == 100.0
    assert s["recall"] == 1.0 and s["precision"] == 0.5 and s["all_right"] == 1.0
    assert s["by_fault"]["hang"] == {"cases": 1, "detected": 1, "ranks_right": 1,
                                     "stage_right": 1, "component_right": 1, "all_right": 1}


def test_select_quick_prefix_and_unknown() -> None:
    assert [c.name for c in catalog.select("", quick=True)] == [
        "ctl-ddp4-100", "ctl-pp4-contended", "ddp4-hang-bwd", "pp4-slow-bwd-x4"]
    assert all(c.name.startswith("tp8-") for c in catalog.select("tp8-*", quick=False))
    held = catalog.select("heldout", quick=False)
    assert held and all("heldout" in c.tags for c in held)
    assert not {c.name for c in held} & {c.name for c in catalog.select("", quick=False)}
    with pytest.raises(ValueError, match="unknown case 'nope'"):
        catalog.select("nope", quick=False)
    controls = [c for c in catalog.CASES if c.control]
    assert len(controls) >= 20 and {c.shape for c in controls} == {"ddp", "pipeline", "tp"}
    assert any(c.contention for c in controls) and {c.nproc for c in controls} == {4, 8}


def test_expected_labels_follow_the_vocabulary() -> None:
    from bench.real.labels import expected
    from diagnosis.rules.base import COMPONENTS

    for kind, stage in (("hang", "bwd"), ("hang", "data"), ("slow", "optim"), ("link", ""),
                        ("kill", ""), ("hog", ""), ("desync", ""), ("stall", "fwd")):
        for shape in ("ddp", "pipeline", "tp"):
            e = expected(kind, stage, shape, 1, 3)
            assert e["component"] in COMPONENTS and e["stage"] in e["accept"]
    assert expected("hang", "bwd", "pipeline", 1, 3)["accept"] == ["bwd mb=3 pp=1"]
    assert expected("link", "", "pipeline", 0, 0)["stage"] == "pp_p2p"


def test_every_version_is_graded_for_the_calibration_table() -> None:
    """Each published version counts once: right only when kind, ranks, stage and component
    all match; resolutions carry no claim; on a control every version is wrong."""
    from bench.real.harness import graded_versions

    r = fault_result()
    score(r, [diag("a", 1, [2], "fwd mb=0 pp=0", "gpu_compute", 4.8, conf=0.75),
              diag("a", 2, [2], "bwd mb=0 pp=0", "gpu_compute", 6.0, status="updated",
                   conf=0.95),
              diag("a", 3, [2], "bwd mb=0 pp=0", "gpu_compute", 9.0, status="resolved")])
    ctl = CaseResult("k", "k-1", "ddp", 4, "", control=True, traced=True)
    score(ctl, [diag("b", 1, [1], "data", "data_loader", 3.0, kind="slowdown", conf=0.95)])
    assert graded_versions([r, ctl]) == [(0.75, False), (0.95, True), (0.95, False)]
    bins = {b["confidence"]: b for b in summarize([r, ctl])["calibration"]}
    assert bins["[0.90, 1.00]"]["versions"] == 2 and bins["[0.90, 1.00]"]["right"] == 0.5


def test_steps_after_counts_the_jobs_own_steps() -> None:
    run = {"step_end_ns": [ONSET - 10, ONSET + 5_000_000, ONSET + 300_000_000], "end_ns": 0}
    assert steps_after(run, ONSET) == [5.0, 300.0]
    r = fault_result(kind="slowdown", fault="slow")
    r.step_ends_ms = steps_after(run, ONSET)
    score(r, [diag("a", 1, [2], "bwd mb=0 pp=0", "gpu_compute", 0.2, kind="slowdown")])
    assert r.latency_steps == 1.0  # one step finished in the 0.2 s: the slowed one is not


def test_steps_after_rebuilds_end_times_from_durations() -> None:
    # three 100 ms steps back to back ending at ONSET + 250 ms: ends at -50, +50, +150... +250
    run = {"step_ns": [100_000_000] * 3, "end_ns": ONSET + 250_000_000}
    assert steps_after(run, ONSET) == [50.0, 150.0, 250.0]


def test_slowdowns_the_job_absorbed_are_counted_apart() -> None:
    """The latency of the slowdowns its user feels (the job's step time ≥ 5 % longer from the
    onset) is reported beside that of all: a slower optimizer a pipeline bubble hides is named,
    but nothing waited for it."""
    assert step_ratio({"step_ns": [50] * 40 + [60] * 40}, 40) == 1.2
    assert step_ratio({"step_ns": [50] * 40}, 40) is None  # no step from the onset on
    out = []
    for ratio, at_s in ((1.4, 0.2), (1.0, 1.0)):
        r = fault_result(kind="slowdown", fault="slow")
        r.job_slowdown = ratio
        score(r, [diag("a", 1, [2], "bwd mb=0 pp=0", "gpu_compute", at_s, kind="slowdown")])
        out.append(r)
    s = summarize(out)
    assert s["slowdown_latency_steps"]["p90"] == 18.4  # 4 and 20 steps
    felt = s["felt_slowdown_latency_steps"]
    assert (felt["p50"], felt["p90"], felt["cases"], felt["absorbed"]) == (4.0, 4.0, 1, 1)


def test_a_catalog_the_tracer_cannot_attach_to_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without the ring library every traced case would train untraced and score as missed:
    the run is refused before any stack starts, saying what to build."""
    from bench.real import harness
    from ingest import ring
    from ingest.torch import provision

    def missing(*_a: object) -> None:
        raise ring.RingLibraryMissing("native/build/librankwatch_ring.so not found")

    monkeypatch.setattr(provision, "torch_site", lambda: tmp_path)
    monkeypatch.setattr(ring, "load_library", missing)
    monkeypatch.setattr(harness, "Runner", None)  # a stack started would fail on calling it
    with pytest.raises(RuntimeError, match=r"tracer cannot attach.*make build"):
        harness.run_catalog(catalog.select("", quick=True), lambda m: None, home=tmp_path)


def test_reap_kills_every_process_naming_the_case_dir_and_nothing_else(tmp_path: Path) -> None:
    """A torchrun stopped while it spawns ranks forgets the ones it started (each in a session of
    its own): the harness kills whatever names the case's directory, and only that."""
    import subprocess
    import sys

    from bench.real.harness import _reap

    sleep = "import sys, time; time.sleep(60)"
    mine = [subprocess.Popen([sys.executable, "-c", sleep, str(tmp_path / "case-a")],
                             start_new_session=True) for _ in range(2)]
    other = subprocess.Popen([sys.executable, "-c", sleep, str(tmp_path / "case-b")],
                             start_new_session=True)
    try:
        assert _reap(str(tmp_path / "case-a")) == 2
        assert [p.wait(10) for p in mine] == [-9, -9]
        assert other.poll() is None
        assert _reap(str(tmp_path / "case-a")) == 0
    finally:
        for p in (*mine, other):
            p.kill()
            p.wait()


def test_an_overhead_case_pauses_the_stacks_worker_and_store_until_resumed(
        tmp_path: Path) -> None:
    """`Runner._pause_backend` stops (SIGSTOP) the processes the stack's worker and store pid
    files name, and `_resume` continues them: the overhead cases train without the worker on
    the same cores (bench/real/harness.py, "Overhead")."""
    import subprocess
    import sys
    import time

    from bench.real import harness
    from rankwatch import stack

    settings = stack.private_settings(tmp_path / "stack", topic_prefix="t")
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    procs = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                     "rankwatch.cli", name]) for name in ("worker", "store")}

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def settled(pid: int, stopped: bool) -> bool:
        """Whether `pid` reaches the stopped state (or leaves it) within 10 s: a signal is
        delivered asynchronously, the state read at once may still be the old one."""
        end = time.monotonic() + 10
        while (state(pid) == "T") != stopped and time.monotonic() < end:
            time.sleep(0.01)
        return (state(pid) == "T") == stopped

    try:
        for name, p in procs.items():
            (settings.run_dir / f"{name}.pid").write_text(str(p.pid))
        runner = harness.Runner(tmp_path, lambda m: None, settings)
        paused = runner._pause_backend()
        assert sorted(paused) == sorted(p.pid for p in procs.values())
        assert all(settled(p.pid, stopped=True) for p in procs.values())
        harness._resume(paused)
        assert all(settled(p.pid, stopped=False) for p in procs.values())
        harness._resume([2 ** 22 + 1])  # gone: nothing to continue, no error
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


@pytest.mark.parametrize("host_nice", [0, 7])
def test_the_training_host_runs_at_its_own_priority(tmp_path: Path, host_nice: int) -> None:
    """The ranks, their agent and the hogs start `host_nice` below the harness (the stack's
    priority); 0 keeps one priority for everything."""
    import os
    import subprocess
    import sys

    from bench.real.harness import Runner

    runner = Runner(tmp_path, lambda m: None, host_nice=host_nice)
    p = runner.host_process([sys.executable, "-c", "import os; print(os.nice(0))"],
                            stdout=subprocess.PIPE)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0
    assert int(out) == min(19, os.nice(0) + host_nice)
