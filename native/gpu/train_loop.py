"""A small real training-like loop for the GPU check: matmuls then an NCCL AllReduce per step.

Run one process per rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); every rank uses
cuda:0, so two ranks on one GPU form a loopback pair (check.sh gives each rank its own
NCCL_HOSTID, which makes NCCL treat them as two hosts and use its network transport).
With RANKWATCH_TRACE_PY=1 the Python tracer (ingest.torch) runs too, with the stage context
managers around each part of the step. Writes one JSON line with the step times to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--mb", type=float, default=64.0, help="AllReduce size per step, MiB")
    ap.add_argument("--matmuls", type=int, default=8, help="4096² bf16 matmuls per step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", default="")
    ap.add_argument("--job", default="")
    ap.add_argument("--stall-rank", type=int, default=-1,
                    help="this rank's data loading stalls once (a fault to diagnose)")
    ap.add_argument("--stall-step", type=int, default=25)
    ap.add_argument("--stall-s", type=float, default=8.0)
    a = ap.parse_args()
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    stage: dict[str, Callable[[], Any]] = {}
    if os.environ.get("RANKWATCH_TRACE_PY") == "1":
        import ingest.torch as rwt

        rwt.enable()
        s = rwt.stages
        stage = {"step": s.step, "data": s.data, "fwd": s.fwd_loss, "bwd": s.backward,
                 "optim": s.optim}

    def ctx(name: str) -> Any:
        return stage[name]() if stage else contextlib.nullcontext()

    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    grad = torch.ones(int(a.mb * (1 << 20) // 4), device=dev, dtype=torch.float32)
    times = []
    for step in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx("step"):
            with ctx("data"):
                y = x
                if step == a.stall_step and dist.get_rank() == a.stall_rank:
                    time.sleep(a.stall_s)
            with ctx("fwd"):
                for _ in range(a.matmuls // 2):
                    y = torch.tanh(y @ w)
            with ctx("bwd"):
                for _ in range(a.matmuls - a.matmuls // 2):
                    y = torch.tanh(y @ w)
                grad.add_(y[0, 0].float())
                dist.all_reduce(grad)
            with ctx("optim"):
                torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    ms = sorted(t * 1e3 for t in times)
    with open(a.out, "a") as f:
        f.write(json.dumps({
            "variant": a.variant, "job": a.job, "rank": rank,
            "world": int(os.environ["WORLD_SIZE"]), "steps": len(ms),
            "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "p90_ms": ms[int(0.9 * (len(ms) - 1))], "plugin": bool(os.environ.get(
                "NCCL_PROFILER_PLUGIN")), "injector": bool(os.environ.get(
                "CUDA_INJECTION64_PATH"))}) + "\n")


if __name__ == "__main__":
    main()
