"""The kernel events kept in memory for the summaries (streams/kernel_summaries.KernelBuffer) and
the dense coding the summaries use; pure logic, no ClickHouse."""

from __future__ import annotations

import numpy as np

from ingest.batch import Coded, RecordBatch
from ingest.units import SECOND as SEC
from streams.kernel_summaries import KernelBuffer, dense_codes

W = 10 * SEC


def batch(job: str, t_s: list[float], names: list[str], rank: int = 0,
          dur: int = 1000) -> RecordBatch:
    n = len(t_s)
    return RecordBatch("kernels", job, "test", 0, cols={
        "rank": np.full(n, rank, np.int32), "stream": np.full(n, 7, np.int64),
        "t_start": (np.array(t_s) * SEC).astype(np.int64), "duration": np.full(n, dur, np.int64)},
        strings={"kernel": Coded.factorize(np.array(names, dtype=object))})


def fingerprint(buf: KernelBuffer, job: str, ws: int) -> tuple[int, int, int]:
    w = buf.jobs[job].windows[ws]
    return w.events, w.rank_sum, w.duration_sum


def test_events_are_kept_per_window_with_job_wide_name_codes() -> None:
    buf = KernelBuffer(W, 100)
    buf.add(batch("j", [1, 2, 11], ["gemm", "attn", "gemm"], rank=3))
    buf.add(batch("j", [12], ["attn"], rank=4, dur=5))
    got = buf.take("j", 10 * SEC, (2, 7, 1005))
    assert got is not None
    ev, names = got
    assert ev["rank"].tolist() == [3, 4] and ev["duration"].tolist() == [1000, 5]
    assert [names[int(h)] for h in ev["h"]] == ["gemm", "attn"]
    assert buf.jobs["j"].events == 0 and not buf.jobs["j"].windows  # window 0 closed with it


def test_a_fingerprint_that_differs_reads_back_and_closes_the_window() -> None:
    buf = KernelBuffer(W, 100)
    buf.add(batch("j", [1, 2], ["a", "a"]))
    assert buf.take("j", 0, (3, 0, 2000)) is None  # the table holds one more event
    assert buf.misses == 1 and not buf.jobs["j"].windows
    buf.add(batch("j", [3], ["a"]))  # late for a closed window: not kept
    assert not buf.jobs["j"].windows
    assert buf.take("other", 0, (1, 0, 1)) is None  # a job never seen (a restart)


def test_durations_are_compared_modulo_two_to_the_64() -> None:
    buf = KernelBuffer(W, 100)
    big = (1 << 62) + 1
    buf.add(batch("j", [1, 2, 3, 4], ["a"] * 4, dur=big))
    wrapped = (4 * big) - (1 << 64)  # what ClickHouse's Int64 sum returns
    assert buf.take("j", 0, (4, 0, wrapped)) is not None


def test_a_window_over_the_bound_is_dropped_and_read_back() -> None:
    buf = KernelBuffer(W, 3)
    buf.add(batch("j", [1, 2], ["a", "a"]))
    buf.add(batch("j", [11], ["a"]))
    buf.add(batch("j", [3], ["a"]))  # the job would hold 4 > 3 events: window 0 is dropped
    assert 0 in buf.jobs["j"].overflowed and buf.jobs["j"].events == 1
    buf.add(batch("j", [4], ["a"]))  # and stays out
    assert 0 not in buf.jobs["j"].windows
    assert buf.take("j", 0, (4, 0, 4000)) is None
    assert buf.take("j", W, fingerprint(buf, "j", W)) is not None


def test_events_without_a_time_are_not_kept() -> None:
    buf = KernelBuffer(W, 100)
    buf.add(batch("j", [0, 0, 5], ["a", "a", "a"]))
    assert list(buf.jobs["j"].windows) == [0] and buf.jobs["j"].events == 1


def test_close_forgets_earlier_windows() -> None:
    buf = KernelBuffer(W, 100)
    buf.add(batch("j", [1, 11, 21], ["a", "b", "c"]))
    buf.close("j", 2 * W)
    assert list(buf.jobs["j"].windows) == [2 * W] and buf.jobs["j"].events == 1


def test_dense_codes_are_np_unique_for_small_and_wide_ranges() -> None:
    rng = np.random.default_rng(1)
    for x in (rng.integers(-50, 50, 1000), rng.integers(0, 1 << 40, 1000),
              rng.integers(0, 1 << 63, 1000, dtype=np.uint64), np.zeros(0, np.int64)):
        values, codes = dense_codes(x)
        want_v, want_c = np.unique(x, return_inverse=True)
        np.testing.assert_array_equal(values, want_v)
        np.testing.assert_array_equal(codes, want_c.reshape(-1))
