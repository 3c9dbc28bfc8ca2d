"""`rankwatch bench sweep` on a small job: the sweep's read (from the judged steps) holds fewer
ops than the whole window and concludes the same, with the injected rank found."""

from __future__ import annotations

from bench.sweep import run


def test_bench_sweep_reads_less_and_concludes_the_same() -> None:
    r = run(2, 2, 4, 60, 1, lambda msg: None)
    assert r["identical"]
    assert r["runs"]["sweep"][0]["ops"] < r["runs"]["whole"][0]["ops"]
    assert r["found"] is not None and r["found"][0] == [r["victim"]]
