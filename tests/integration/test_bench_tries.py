"""`rankwatch bench tries` on its simulated job: the worker's reads (the topology kept for a
second, the stage records from the stored batches' copy) conclude what reads that query
everything conclude, try by try, and the tries name the slowed rank."""

from __future__ import annotations

from pathlib import Path

from bench.tries import _simulated, run


def test_bench_tries_concludes_the_same_on_both_read_paths(tmp_path: Path) -> None:
    db, jobs = _simulated(str(tmp_path), lambda msg: None)
    try:
        r = run(db, jobs, rounds=2, tries=3, say=lambda msg: None)
    finally:
        db.close()
    assert r["identical"] and r["tries"] == 6
    assert r["named"] == 3  # every try of the slowed job names a culprit
