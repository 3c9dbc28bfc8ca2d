"""The derived runner's rw.<kind> messages stay under the size limit, whatever the row width
(`encoded_parts`: wide rows, e.g. a 1,024-rank job's kernel summaries with long kernel names,
would otherwise make one message over the Faust producer's request limit, and the window's
publish would fail on every tick); and a job whose windows keep failing is retried with backoff.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import numpy as np
import pytest

from ingest.batch import decode_batch
from streams.db import Database
from streams.derived import DerivedConfig, DerivedRunner, encoded_parts


def summaries(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    names = np.array([f"ampere_sgemm_{i}_" + "x" * 120 for i in range(64)], dtype=object)
    return {"window_start": np.full(n, 60 * 10**9, np.int64),
            "rank": rng.integers(0, 1024, n).astype(np.int32),
            "stream": rng.integers(0, 4, n).astype(np.int64),
            "kernel": names[rng.integers(0, 64, n)],
            "cluster": rng.integers(0, 3, n).astype(np.int32),
            "count": rng.integers(1, 1000, n).astype(np.int64),
            "p50_ns": rng.integers(1000, 10**6, n).astype(np.int64),
            "p99_ns": rng.integers(10**6, 10**7, n).astype(np.int64)}


def publish(cols: dict[str, np.ndarray], *, publish_rows: int, publish_max_bytes: int
            ) -> list[bytes]:
    sent = list(encoded_parts("kernel_summaries", "j", 60 * 10**9, cols, rows=publish_rows,
                              max_bytes=publish_max_bytes))
    for m in sent:
        b = decode_batch(m)
        assert (b.kind, b.job_id) == ("kernel_summaries", "j")
    return sent


def test_wide_rows_are_split_under_the_size_limit_and_nothing_is_lost() -> None:
    cols = summaries(5_000)
    sent = publish(cols, publish_rows=20_000, publish_max_bytes=64 * 1024)
    assert len(sent) > 1
    assert max(len(m) for m in sent) <= 64 * 1024
    parts = [decode_batch(m) for m in sent]
    for k, v in cols.items():
        got = np.concatenate([p.cols[k] for p in parts])
        assert np.array_equal(got, v), k  # every row once, in order


def test_small_batches_go_in_row_chunks_as_before() -> None:
    cols = summaries(250)
    sent = publish(cols, publish_rows=100, publish_max_bytes=1 << 20)
    assert [len(decode_batch(m).cols["rank"]) for m in sent] == [100, 100, 50]


class NoCheckpoints:
    """A store with no `stream_state` rows: the runner's only read before its jobs' windows."""

    async def aquery_columns(self, sql: str, params: Any = None) -> dict[str, np.ndarray]:
        return {"job_id": np.array([], object), "kind": np.array([], object),
                "next_start": np.array([], np.int64), "max_ns": np.array([], np.int64)}


async def discard(kind: str, job: str, data: bytes) -> None:
    """A publish that sends nothing."""


def test_a_job_whose_windows_keep_failing_is_retried_with_backoff(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lasting failure (here: every tick raises) is retried after tick_s, then 2x, 4x … up to
    max_retry_s, not recomputed on every tick; the other jobs go on."""
    now = [1000.0]
    monkeypatch.setattr("streams.derived.time.monotonic", lambda: now[0])
    runner = DerivedRunner(cast(Database, NoCheckpoints()), discard,
                           DerivedConfig(tick_s=0.25, max_retry_s=2.0))
    asyncio.run(runner.restore())
    runner.windows.observe("bad", 10**9, 2 * 10**9)
    runner.windows.observe("good", 10**9, 2 * 10**9)
    calls: list[tuple[float, str]] = []

    async def job(name: str) -> int:
        calls.append((now[0], name))
        if name == "bad":
            raise RuntimeError("publish failed")
        return 0

    monkeypatch.setattr(runner, "_job", job)
    for _ in range(40):  # 10 s of ticks
        asyncio.run(runner.tick())
        now[0] += 0.25
    bad = [t - 1000.0 for t, n in calls if n == "bad"]
    assert bad == [0.0, 0.25, 0.75, 1.75, 3.75, 5.75, 7.75, 9.75]
    assert sum(n == "good" for _, n in calls) == 40
    assert runner.stats.errors == len(bad)


def test_a_year_old_batch_costs_a_few_windows_and_the_skip_is_checkpointed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose first batch is a year old and whose next is live: the runner closes the old
    batch's windows, skips the year between (streams/windows.py, "Gaps") and stores the
    checkpoint, so a restart does not walk the year either."""
    sec, now = 10**9, 1_700_000_000 * 10**9
    runner = DerivedRunner(cast(Database, NoCheckpoints()), discard,
                           DerivedConfig(preview_iterations=False))
    asyncio.run(runner.restore())
    runner.windows.observe("j", now - 365 * 86400 * sec, now - 365 * 86400 * sec + sec,
                           kind="ops")
    runner.windows.observe("j", now, now + 30 * sec, kind="ops")
    closed: list[tuple[str, int]] = []
    checkpoints: list[int] = []

    async def emit(kind: str, job: str, ws: int, cols: Any, token_suffix: str = "") -> None:
        closed.append((kind, ws))

    async def nothing(job: str, ws: int) -> dict[str, np.ndarray]:
        return {}

    async def checkpoint(job: str) -> None:
        checkpoints.append(runner.windows.jobs[job].kinds["progress"].next_start)

    monkeypatch.setattr(runner, "_emit", emit)
    monkeypatch.setattr(runner.progress, "compute", nothing)
    monkeypatch.setattr(runner, "_window_iterations", nothing)
    monkeypatch.setattr(runner, "_checkpoint", checkpoint)
    monkeypatch.setattr("streams.derived._last_steps", lambda bounds, rows: bounds)
    for _ in range(4):
        asyncio.run(runner.tick())
    progress = [ws for kind, ws in closed if kind == "progress"]
    assert len(progress) == 2 + 28 and progress[-1] == now + 27 * sec
    # iterations: the old batch's window and those a step starting in it may end in (60 s)
    assert len([1 for kind, _ in closed if kind == "iterations"]) == 7 + 2
    assert checkpoints and checkpoints[-1] == now + 28 * sec
