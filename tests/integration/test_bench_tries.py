"""`rankwatch bench tries` on its simulated job: the worker's reads (the topology kept for a
second, the stage records from the stored batches' copy) conclude what reads that query
everything conclude, try by try, and the tries name the slowed rank."""

from __future__ import annotations

import json
from pathlib import Path

from bench.tries import _simulated, run, scan
from ingest.units import SECOND


def test_bench_tries_concludes_the_same_on_both_read_paths(tmp_path: Path) -> None:
    db, jobs = _simulated(str(tmp_path), lambda msg: None)
    try:
        r = run(db, jobs, rounds=2, tries=3, say=lambda msg: None)
    finally:
        db.close()
    assert r["identical"] and r["tries"] == 6
    assert r["named"] == 3  # every try of the slowed job names a culprit


def test_bench_tries_scan_names_the_fault_and_nothing_before_it(tmp_path: Path) -> None:
    """`--scan` on a report whose one fault is the simulated job's GPU slowdown (rank 3 from
    15 s) and whose one control is the same job's first 14 s: the fault is named right within
    its 4 s, the stretch before its onset at no moment."""
    db, jobs = _simulated(str(tmp_path / "store"), lambda msg: None)
    job, tried_from = jobs[0]
    first = int(db.query("SELECT toUnixTimestamp64Nano(min(t_start)) FROM stages "
                         "WHERE job_id = {j:String}", {"j": job}).result_rows[0][0])
    onset = first + 15 * SECOND
    report = tmp_path / "run.json"
    report.write_text(json.dumps({"cases": [
        {"case": "slow", "job": job, "traced": True, "control": False,
         "truth": {"kind": "slowdown", "ranks": [3], "onset_ns": onset},
         "run": {"start_ns": first, "end_ns": first + 60 * SECOND}},
        {"case": "quiet", "job": job, "traced": True, "control": True, "truth": None,
         "run": {"start_ns": first, "end_ns": first + 14 * SECOND}}]}))
    try:
        got = scan(db, report, None, lambda msg: None)
    finally:
        db.close()
    assert tried_from > onset
    assert got["controls"] == {"quiet": []}
    named = got["faults"]["slow"]
    assert named is not None and 0 <= named[0] <= 4.0
    assert got["tries"] == 121 + int(named[0] * 10) + 1
