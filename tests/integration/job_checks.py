"""What a killed component must not cost a simulated job, checked in ClickHouse: every raw row
stored once (counted against the simulator's own per-kind counts) and derived rows without a gap;
and the job's versions read from rw.diagnoses.
Shared by the tests that kill a worker (tests/e2e/test_worker_takeover.py) and a broker
(tests/e2e/test_broker_loss_incident.py), which reach ClickHouse through different doors (the
store process; the worker's SQL endpoint), hence a query function rather than a client."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from confluent_kafka import Consumer

from diagnosis.model import Diagnosis
from ingest.records import MODELS

#: Runs one SELECT and returns its rows, every value an integer.
Query = Callable[[str], list[tuple[int, ...]]]


def poll_diagnosis(consumer: Consumer, job: str, timeout: float) -> Diagnosis | None:
    """The next version on rw.diagnoses within `timeout` if it is `job`'s, else None."""
    m = consumer.poll(timeout)
    if m is None or m.error():
        return None
    d = Diagnosis.model_validate_json(m.value() or b"{}")
    return d if d.job_id == job else None


def _job(job: str) -> str:
    """`job` as an SQL string literal; the tests name their jobs, so only plain ids are taken."""
    if not re.fullmatch(r"[A-Za-z0-9_.:-]+", job):
        raise ValueError(f"job id {job!r} is not a plain id")
    return f"'{job}'"


def published_rows(summary: Mapping[str, object]) -> dict[str, int]:
    """The raw rows per kind the simulator's `--json` summary says it published."""
    by_kind = summary["rows_by_kind"]
    assert isinstance(by_kind, dict)
    return {k: int(by_kind.get(k, 0)) for k in MODELS}


def stored_rows(query: Query, job: str) -> dict[str, int]:
    """The job's rows stored per raw kind."""
    return {k: int(query(f"SELECT count() FROM {k} WHERE job_id = {_job(job)}")[0][0])
            for k in MODELS}


def wait_stored(query: Query, job: str, want: dict[str, int], timeout: float) -> dict[str, int]:
    """Poll until the stored counts equal `want` (the worker drains what is left) or `timeout`
    passes; return the last counts, for the caller to compare."""
    deadline = time.monotonic() + timeout
    while True:
        stored = stored_rows(query, job)
        if stored == want or time.monotonic() > deadline:
            return stored
        time.sleep(1)


@dataclass(frozen=True)
class Derived:
    """The job's derived rows, as far as gaps go."""

    #: distinct progress windows (1 s each), and how many the first to the last spans
    progress_windows: int
    progress_span: int
    #: distinct (rank, step) iteration rows
    steps: int
    #: (rank, step) with stage records but no iteration row, for steps that began more than
    #: 10 s before the last iteration ended (the newest may still be open)
    missing_steps: int
    #: the progress windows missing inside the span, as seconds after its first window's end
    missing_windows: tuple[int, ...] = ()

    def problems(self, min_windows: int) -> list[str]:
        """Why the derived rows are incomplete; empty when they are not."""
        out = []
        if self.progress_windows < min_windows:
            out.append(f"{self.progress_windows} progress windows, expected {min_windows}+")
        if self.progress_windows != self.progress_span:
            out.append(f"progress: {self.progress_windows} windows over a span of "
                       f"{self.progress_span}: a gap (missing {list(self.missing_windows)} s "
                       "after the first)")
        if self.steps == 0:
            out.append("no iteration rows")
        if self.missing_steps:
            out.append(f"{self.missing_steps} (rank, step) iteration rows missing")
        return out


def derived(query: Query, job: str) -> Derived:
    j = _job(job)
    n, lo, hi = query(
        "SELECT count(DISTINCT window_end), toUnixTimestamp64Nano(min(window_end)), "
        f"toUnixTimestamp64Nano(max(window_end)) FROM progress WHERE job_id = {j}")[0]
    missing = query(
        "SELECT count() FROM (SELECT DISTINCT rank, step FROM stages WHERE "
        f"job_id = {j} AND t_start < "
        f"(SELECT max(t_end) FROM iterations WHERE job_id = {j})"
        " - INTERVAL 10 SECOND) AS s LEFT ANTI JOIN (SELECT DISTINCT rank, step FROM "
        f"iterations WHERE job_id = {j}) AS i USING (rank, step)")[0][0]
    steps = query("SELECT count() FROM (SELECT DISTINCT rank, step FROM iterations "
                  f"WHERE job_id = {j})")[0][0]
    span = (int(hi) - int(lo)) // 1_000_000_000 + 1 if n else 0
    holes: tuple[int, ...] = ()
    if n and int(n) != span:
        ends = {int(r[0]) for r in query(
            "SELECT DISTINCT toUnixTimestamp64Nano(window_end) FROM progress "
            f"WHERE job_id = {j}")}
        holes = tuple(i for i in range(span) if int(lo) + i * 1_000_000_000 not in ends)
    return Derived(int(n), span, int(steps), int(missing), holes)


def wait_derived(query: Query, job: str, min_windows: int, timeout: float) -> list[str]:
    """Poll until the job's derived rows have no problem (`Derived.problems`) or `timeout`
    passes (the worker may still be closing the job's last windows); the last problems."""
    deadline = time.monotonic() + timeout
    while True:
        gaps = derived(query, job).problems(min_windows)
        if not gaps or time.monotonic() > deadline:
            return gaps
        time.sleep(1)
