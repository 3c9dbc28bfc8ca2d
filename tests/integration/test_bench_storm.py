"""`rankwatch bench storm`, briefly: it measures ingest pace and hang-to-trigger latency on a
quiet worker and under a storm of heavy and stuck queries beyond the SQL endpoint's concurrency
limit, and the worker is healthy afterwards. Figures only: no timed assertions."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_storm_gives_figures_for_both_runs_and_the_worker_stays_healthy() -> None:
    r = subprocess.run([sys.executable, "-m", "rankwatch.cli", "bench", "storm", "--storm", "12",
                        "--limit-s", "2", "--burst-dp", "2", "--burst-steps", "20",
                        "--hang-at", "4", "--wait-s", "120", "--repeat", "1", "--settle-s", "3",
                        "--stuck-elements", "4000000",
                        "--json"],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    for run in (out["quiet"], out["storm"]):
        assert run["burst_records"] > 10_000 and run["records_per_s"] > 0
        assert run["derived_s"] is not None and run["derived_s"] >= run["burst_s"]
        assert run["trigger_s"] is not None and run["diagnosis_s"] is not None
        assert run["diagnosis"].startswith("hang ranks [5]"), run
        assert run["pings_failed"] == 0  # /ping answered throughout
    q = out["queries"]
    assert q["answered"] >= 2 and q["refused"] >= 1 and q["failed"] == 0  # beyond the limit
    assert all(v is not None for v in out["ratios"].values())
    assert out["healthy_after"] is True, out["detail_after"]
    print(f"\nquiet {out['quiet']}\nstorm {out['storm']}\nratios {out['ratios']}")


def test_a_hanging_jobs_publisher_that_fails_is_reported_not_waited_for(kafka, topics,
                                                                       monkeypatch) -> None:
    """The bench's own failure (here every publish raises) is in the run's errors, and the
    wait for a trigger ends with it instead of running out its `wait_s`."""
    import time

    from bench import storm

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("no route to the broker")

    monkeypatch.setattr(storm, "publish", broken)
    prefix = topics.triggers.rsplit(".", 1)[0]
    settings = kafka.settings.model_copy(update={"topic_prefix": prefix})
    run = storm.Run("quiet")
    t0 = time.monotonic()
    storm.fault_job(settings, run, hang_at=2.0, wait_s=120.0)
    assert time.monotonic() - t0 < 60  # 1 s before the job's epoch, then the first publish
    assert run.trigger_s is None and run.diagnosis_s is None
    assert run.errors == ["quiet: the hanging job's publisher failed: OSError: no route to "
                          "the broker"]
