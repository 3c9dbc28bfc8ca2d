"""`slow.launch`: a call's launch delay leaves out the time its rank's own device was still
busy. A GPU-slow rank's tensor-parallel all-reduces, enqueued behind its slower matmuls, start
later by its extra compute: that is its GPU, not its host — also while its kernel records are
read behind its calls."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from diagnosis import slow
from diagnosis.slow.launch import device_idle_delay
from diagnosis.window import Window
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect

MS = 1_000_000


def delays(kernels: dict[str, np.ndarray] | None, rank: list[int], enq: list[int],
           start: list[int], step_start: list[int] | None = None) -> np.ndarray:
    ctx = SimpleNamespace(w={"kernels": kernels} if kernels is not None else {})
    return device_idle_delay(cast(Any, ctx), np.array(rank), np.array(enq, np.int64),
                             np.array(start, np.int64),
                             None if step_start is None else np.array(step_start, np.int64))


def test_the_devices_own_queue_is_not_a_launch_delay() -> None:
    k = {"rank": np.array([0, 0, 1, 1, 1]),
         "kernel": np.array(["gemm", "gemm", "gemm", "ncclKernel_AllReduce", "gemm"]),
         "t_start": np.array([0, 10, 0, 12, 40], np.int64) * MS,
         "duration": np.array([10, 10, 8, 30, 5], np.int64) * MS}
    # rank 0: enqueued at 1 ms behind its kernels, started as the second ended (20 ms): no delay;
    # rank 1: its compute ended at 8 ms (its NCCL kernel is the call itself), the call started
    # at 12: 4 ms of delay; rank 1's call at 50 ms: its kernels are stored only to 45 — unknown
    got = delays(k, [0, 1, 1], [1 * MS, 2 * MS, 46 * MS], [20 * MS, 12 * MS, 50 * MS])
    assert got[0] == 0 and got[1] == 4 * MS and np.isnan(got[2])


def test_a_kernel_running_when_the_call_started_kept_the_device_busy() -> None:
    # rank 0: a short kernel ends at 2 ms, a long one (another stream) runs 1-40 ms; the call,
    # enqueued at 3 ms, started at 25 ms while the long one ran: nothing of its own idled the
    # device, no delay (counted from the short kernel's end it was 22 ms). Its call at 50 ms,
    # enqueued at 41, started 9 ms after the long kernel ended and the device idled: 9 ms
    k = {"rank": np.array([0, 0, 0]), "kernel": np.array(["gemm", "gemm", "gemm"]),
         "t_start": np.array([0, 1, 55], np.int64) * MS,
         "duration": np.array([2, 39, 5], np.int64) * MS}
    got = delays(k, [0, 0], [3 * MS, 41 * MS], [25 * MS, 50 * MS])
    assert got.tolist() == [0, 9 * MS]


def test_a_step_without_kernel_records_is_not_read_as_an_idle_device() -> None:
    """Kernels recorded on steps 0 and 2 only (dropped, or sampled): the call of step 1 (its
    step began at 20 ms), enqueued at 25 ms and started at 40 ms behind compute that was not
    recorded, has step 0's kernel as its latest — 15 ms of "late start" read off a gap in the
    records. With its step's start known it is not judged; the calls of step 2, whose compute
    is recorded, are: one queued behind its kernel (no delay), one started 10 ms after the
    device went idle."""
    k = {"rank": np.array([0, 0, 0, 0]), "kernel": np.array(["gemm"] * 4),
         "t_start": np.array([0, 60, 80, 96], np.int64) * MS,
         "duration": np.array([10, 10, 5, 10], np.int64) * MS}
    enq, start = [25 * MS, 62 * MS, 82 * MS], [40 * MS, 70 * MS, 95 * MS]
    assert delays(k, [0, 0, 0], enq, start).tolist() == [15 * MS, 0, 10 * MS]
    got = delays(k, [0, 0, 0], enq, start, [20 * MS, 55 * MS, 55 * MS])
    assert np.isnan(got[0]) and got[1:].tolist() == [0, 10 * MS]
    # a call started as it was enqueued waited for nothing, records or not; a step start not
    # known (-1) leaves the call to the other tests
    got = delays(k, [0, 0], [30 * MS, 25 * MS], [30 * MS, 40 * MS], [20 * MS, -1])
    assert got.tolist() == [0, 15 * MS]


def test_a_malformed_rank_neither_crashes_nor_lends_its_kernels() -> None:
    # a kernel of rank -1 running past the calls says nothing of rank 0's device
    k = {"rank": np.array([-1]), "kernel": np.array(["gemm"]),
         "t_start": np.array([0], np.int64), "duration": np.array([30 * MS], np.int64)}
    got = delays(k, [0, -1], [1 * MS, 1 * MS], [20 * MS, 20 * MS])
    assert np.isnan(got).all()


def test_a_rank_without_kernels_in_a_job_with_them_is_not_judged() -> None:
    k = {"rank": np.array([0]), "kernel": np.array(["gemm"]),
         "t_start": np.array([0], np.int64), "duration": np.array([10 * MS], np.int64)}
    assert np.isnan(delays(k, [1], [0], [5 * MS])[0])


def test_without_kernel_records_only_a_call_started_at_once_is_known() -> None:
    # CPU training: a call starts as it is made, no delay; a later start may be the host's or
    # an unseen device queue's
    got = delays(None, [0, 1, 2], [0, 10 * MS, 5 * MS], [3 * MS, 9 * MS, 5 * MS])
    assert np.isnan(got[0]) and got[1:].tolist() == [0, 0]


def test_a_call_started_as_it_was_enqueued_waited_for_nothing() -> None:
    k = {"rank": np.array([0]), "kernel": np.array(["gemm"]),
         "t_start": np.array([0], np.int64), "duration": np.array([1 * MS], np.int64)}
    assert delays(k, [0, 1], [5 * MS, 5 * MS], [5 * MS, 5 * MS]).tolist() == [0, 0]


@functools.cache
def conclusion(kernels_behind_s: float) -> tuple[tuple[int, ...], str, str] | None:
    """A GPU-slow rank (rank 3 of a TP 2 × PP 2 × DP 2 job, its compute ×1.8 from 5 s), judged
    when its kernel records stop `kernels_behind_s` before its calls (read behind them)."""
    d = collect(Simulation(JobConfig(job_id="t", tp=2, pp=2, dp=2, steps=40),
                           ["gpu_slow rank=3 factor=1.8 at=5s"]).batches())
    topo = d.pop("jobs")["topology"][0]
    now = int(max(d["beats"]["ts"].max(), d["ops"]["t_enqueue"].max()))
    k = d["kernels"]
    keep = k["t_start"] <= now - int(kernels_behind_s * 1e9)
    d["kernels"] = {c: v[keep] for c, v in k.items()}
    c = slow.analyze(Window(topo, d, 0, now), now)
    return None if c is None else (c.ranks, str(c.stage), str(c.component))


def test_a_slower_gpu_is_its_compute() -> None:
    assert conclusion(0.0) == ((3,), "compute", "gpu_compute")


def test_a_slower_gpu_read_behind_its_calls_is_not_its_host() -> None:
    # the kernels of the steps since the onset not stored yet: no verdict on the calls of
    # those steps, so nothing names the rank's host
    got = conclusion(30.0)
    assert got is None or got[1:] != ("tp_collectives", "host_software")
