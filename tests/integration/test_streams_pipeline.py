"""Derived streams end to end: simulator records -> broker -> worker -> iterations, progress and
kernel summaries in ClickHouse (and rw.progress), across a worker restart."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from ingest.batch import TIME_COLUMN
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect
from ingest.units import SECOND as SEC
from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from streams.windows import WatermarkParams
from tests.conftest import KafkaService, SettingsFactory
from tests.integration.test_ingest_pipeline import Pipeline

STAGES = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step",
          "step_other")
LATENESS_S = 1.0


@pytest.fixture
def derived_pipeline(kafka: KafkaService, settings_factory: SettingsFactory
                     ) -> Iterator[Pipeline]:
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"d{uuid.uuid4().hex[:10]}", kafka_partitions=3,
                                derived_lateness_s=LATENESS_S, iteration_window_s=5.0,
                                kernel_window_s=10.0)
    p = Pipeline(settings)
    try:
        p.start_worker()
        yield p
    finally:
        stack.down(settings, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [s.name for s in settings.topics.specs(3)])


def publish(p: Pipeline, batches: list[tuple[float, str, bytes]]) -> None:
    pub = p.publisher()
    for i, (_, kind, data) in enumerate(batches):
        pub.publish(kind, data, key=str(i % 7))
    assert pub.flush(60) == 0


def wait_for(p: Pipeline, query: str, want: int, timeout: float = 90) -> int:
    deadline, got = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        got = int(p.sql(query) or 0)
        if got >= want:
            return got
        time.sleep(0.5)
    return got


def truth_steps(tables: dict[str, dict[str, np.ndarray]]) -> dict[tuple[int, int], tuple[int, int]]:
    st = tables["stages"]
    end = st["t_start"] + sum(st[k] for k in STAGES)
    return {(int(r), int(s)): (int(a), int(b))
            for r, s, a, b in zip(st["rank"], st["step"], st["t_start"], end, strict=True)}


def closed_steps(truth: dict[tuple[int, int], tuple[int, int]], max_ns: int, width_ns: int
                 ) -> set[tuple[int, int]]:
    """Steps whose iteration window must be closed once every record was seen and the job's
    sources have been quiet for a while (streams/windows.py: then the windows close up to the
    largest event time minus the smallest lateness)."""
    wm = max_ns - WatermarkParams().min_lateness_ns
    return {k for k, (_, end) in truth.items() if (end // width_ns + 1) * width_ns <= wm}


def max_event(tables: dict[str, dict[str, np.ndarray]]) -> int:
    return max(int(c[TIME_COLUMN[k]].max()) for k, c in tables.items() if k != "jobs")


def test_simulated_job_gets_iterations_progress_and_kernel_summaries(
        derived_pipeline: Pipeline) -> None:
    p = derived_pipeline
    cfg = JobConfig(job_id="sim-a", tp=2, pp=2, dp=2, steps=40, microbatches=4, seed=5)
    batches = list(Simulation(cfg).batches())
    tables = collect(batches)
    truth = truth_steps(tables)
    want = closed_steps(truth, max_event(tables), 5_000_000_000)
    assert len(want) > 100
    # the whole job's kernel records first, as when a worker reads a backlog and its kernels
    # topic runs ahead: the windows of the other kinds must start at their own first records
    publish(p, [b for b in batches if b[1] == "kernels"])
    assert wait_for(p, "SELECT count() FROM kernel_windows WHERE job_id = 'sim-a'", 1) >= 1
    publish(p, [b for b in batches if b[1] != "kernels"])
    got_n = wait_for(p, "SELECT count() FROM iterations FINAL WHERE job_id = 'sim-a'", len(want))
    assert got_n == len(want)
    # a window that closed before a rank's stage records were read (the stages topic read
    # behind the ops topic; a source silent for 2 s is not waited for) stores that rank's
    # steps from its gradient collectives; the late stage records mark the window late, and
    # its recomputation replaces them: wait for that, then every row is the stage records' step
    query = ("SELECT rank, step, source, toUnixTimestamp64Nano(t_start), "
             "toUnixTimestamp64Nano(t_end), step_ns, dp_comm_ns > 0, ops > 0 "
             "FROM iterations FINAL WHERE job_id = 'sim-a'")
    deadline = time.monotonic() + 60
    rows = p.sql(query).splitlines()
    while time.monotonic() < deadline and any(
            line.split("\t")[2] != "stages" for line in rows):
        time.sleep(0.5)
        rows = p.sql(query).splitlines()
    for line in rows:
        r, s, src, t0, t1, dur, dp, ops = line.split("\t")
        assert (int(t0), int(t1)) == truth[(int(r), int(s))]
        assert src == "stages" and int(dur) == int(t1) - int(t0) and dp == ops == "1"
    # kernel summaries: every closed window summarized with a compression ratio
    assert wait_for(p, "SELECT count() FROM kernel_windows WHERE job_id = 'sim-a'", 1) >= 1
    ratio, events = p.sql("SELECT min(compression_ratio), sum(events) FROM kernel_windows "
                          "WHERE job_id = 'sim-a'").split("\t")
    assert float(ratio) > 5
    assert p.sql("SELECT sum(count) FROM kernel_summaries WHERE job_id = 'sim-a'") == events
    # progress: one row per rank and communicator per window; op_seq only grows
    assert wait_for(p, "SELECT count() FROM progress WHERE job_id = 'sim-a'", 100) >= 100
    # the first window holds the job's first record, in whatever order the partitions were read
    first = min(int(c[TIME_COLUMN[k]].min()) for k, c in tables.items() if k != "jobs")
    assert int(p.sql("SELECT toUnixTimestamp64Nano(min(window_end)) FROM progress "
                     "WHERE job_id = 'sim-a'")) == (first // SEC + 1) * SEC
    last = p.sql("SELECT max(last_op_seq) FROM progress WHERE job_id = 'sim-a' "
                 "AND comm_id LIKE 'dp%'")
    assert int(last) >= 10
    bad = p.sql("SELECT count() FROM (SELECT rank, comm_id, "
                "arrayDifference(arrayMap(x -> x.2, arraySort(groupArray((window_end, "
                "last_op_seq))))) AS d FROM progress FINAL WHERE job_id = 'sim-a' "
                "GROUP BY rank, comm_id) WHERE arrayMin(d) < 0")
    assert bad == "0"
    # the example rollup view answers
    assert int(p.sql("SELECT count() FROM job_minute WHERE job_id = 'sim-a'")) >= 1


def test_restart_loses_and_duplicates_nothing_and_late_batches_land(
        derived_pipeline: Pipeline) -> None:
    p = derived_pipeline
    cfg = JobConfig(job_id="sim-r", tp=2, pp=2, dp=2, steps=40, microbatches=4, seed=9)
    batches = list(Simulation(cfg).batches())
    tables = collect(batches)
    truth = truth_steps(tables)
    want = closed_steps(truth, max_event(tables), 5_000_000_000)
    # hold back the stage records of step 3 on every rank: a late batch after its window closed
    late = [b for b in batches if b[1] == "stages" and _has_step(b[2], 3)]
    rest = [b for b in batches if b not in late]
    half = len(rest) // 2
    publish(p, rest[:half])
    time.sleep(3)
    if stack.worker_daemon(p.settings).pid() is None:
        log = p.settings.home / "logs" / "worker.log"
        pytest.fail(f"the worker died; its log ends:\n{log.read_text()[-4000:]}")
    p.kill_worker()
    publish(p, rest[half:])
    p.start_worker()
    assert wait_for(p, "SELECT count() FROM iterations FINAL WHERE job_id = 'sim-r'",
                    len(want)) == len(want)
    n3 = p.sql("SELECT count(), countIf(source = 'stages') FROM iterations FINAL "
               "WHERE job_id = 'sim-r' AND step = 3")
    assert n3 == "8\t0"  # inferred from the DP AllReduce while the stage records are missing
    publish(p, late)
    assert wait_for(p, "SELECT countIf(source = 'stages') FROM iterations FINAL "
                    "WHERE job_id = 'sim-r' AND step = 3", 8) == 8
    rows = p.sql("SELECT rank, step, toUnixTimestamp64Nano(t_start), "
                 "toUnixTimestamp64Nano(t_end) FROM iterations FINAL WHERE job_id = 'sim-r'")
    for line in rows.splitlines():
        r, s, t0, t1 = (int(x) for x in line.split("\t"))
        assert (t0, t1) == truth[(r, s)]
    # no duplicates: progress windows and kernel summaries are stored once
    assert p.sql("SELECT count() - uniqExact(window_end, rank, comm_id) FROM progress "
                 "WHERE job_id = 'sim-r'") == "0"
    assert p.sql("SELECT count() - uniqExact(window_start, rank, stream, kernel, cluster) "
                 "FROM kernel_summaries WHERE job_id = 'sim-r'") == "0"
    # no gaps: consecutive progress windows from the first to the last
    first, last, n = p.sql("SELECT min(window_end), max(window_end), uniqExact(window_end) "
                           "FROM progress WHERE job_id = 'sim-r'").split("\t")
    span = (np.datetime64(last.replace(" ", "T")) - np.datetime64(first.replace(" ", "T")))
    assert int(n) == int(span / np.timedelta64(1, "s")) + 1


def _has_step(data: bytes, step: int) -> bool:
    from ingest.batch import decode_batch
    return bool((decode_batch(data).cols["step"] == step).any())
