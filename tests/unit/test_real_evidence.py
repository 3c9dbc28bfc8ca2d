"""bench.real.evidence: a capture replayed with its records stored as they were made names a
slowdown once its slow steps stand out, not before the onset, and says when."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.real.evidence import evidence_ready, load
from ingest.agent.capture import CaptureWriter
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation
from ingest.units import SECOND as S


def capture(tmp_path: Path, fault: str) -> tuple[Path, JobConfig]:
    cfg = JobConfig(job_id="ev", tp=2, pp=4, dp=2, steps=24)
    w = CaptureWriter(tmp_path / "cap")
    for _, kind, data in Simulation(cfg, [fault]).batches():
        w.publish(kind, data, key="ev")
    w.close()
    return tmp_path / "cap", cfg


def test_a_slowdown_is_named_once_its_slow_steps_are_made(tmp_path: Path) -> None:
    cap, cfg = capture(tmp_path, "gpu_slow rank=9 factor=2 at=6s")
    topo, tables = load(cap)
    assert topo is not None and tables["stages"]["rank"].size
    onset = cfg.epoch_ns + 6 * S
    ready = evidence_ready(cap, onset, [9], step_ends_ms=[100.0 * i for i in range(1, 100)])
    assert ready is not None and 9 in ready.conclusion.ranks
    assert 0 < ready.after_s < 8.0
    # the steps rank 0 ended by then (100 ms each)
    assert ready.steps == round(ready.after_s * 1000) // 100
    # the fault goes on to the horizon: named from then on, in one burst
    assert ready.bursts == 1
    assert ready.visible_ms == pytest.approx((8.0 - ready.after_s) * 1000, abs=40)
    assert evidence_ready(cap, onset, [3]) is None  # another rank is never named


def test_a_capture_without_stage_records_has_no_evidence(tmp_path: Path) -> None:
    w = CaptureWriter(tmp_path / "cap")
    w.close()
    assert evidence_ready(tmp_path / "cap", 0, [0]) is None


def test_the_command_needs_a_kept_run_and_skips_a_damaged_capture(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from rankwatch.cli import main

    assert main(["eval", "--real", "--evidence"]) == 2  # nothing to replay: no training run
    assert "--rescore" in capsys.readouterr().err
    case = {"case": "c", "job": "c-1", "traced": True, "latency_s": 1.0, "latency_steps": 9,
            "truth": {"kind": "slowdown", "onset_ns": 0, "ranks": [1]}}
    (tmp_path / "run.json").write_text(json.dumps({"cases": [case]}))
    (tmp_path / "cases" / "c-1").mkdir(parents=True)
    (tmp_path / "cases" / "c-1" / "cap.rwcap").write_bytes(b"not a capture")
    assert main(["eval", "--real", "--rescore", str(tmp_path / "run.json"), "--workdir",
                 str(tmp_path), "--evidence"]) == 1
    err = capsys.readouterr().err
    assert "cannot replay" in err and "no slowdown case" in err
