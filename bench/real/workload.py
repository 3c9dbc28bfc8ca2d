"""A training job for the real catalog: one of three parallel shapes, a fault on one rank, and
the ground truth written by the job itself.

    torchrun --nproc-per-node 4 -m ingest.torch.run -m bench.real.workload --shape pipeline \
        --steps 200 --truth-dir /tmp/truth --fault '{"kind": "slow", "rank": 3, "step": 60,
        "stage": "bwd", "factor": 4}'

Shapes (gloo on CPU; every group named with `ingest.torch.name_group`):
- ``ddp``: DistributedDataParallel over all ranks (the tracer routes its bucket all-reduces);
- ``pipeline``: ``--pp`` stages × world/pp data-parallel replicas, a 1F1B schedule over
  ``--microbatches`` (warm-up forwards, one-forward-one-backward, cool-down backwards),
  activations and gradients by isend/recv between neighbouring stages, then one gradient
  all-reduce per stage over its DP group;
- ``tp``: ``--tp``-way tensor-parallel MLP blocks (column-parallel then row-parallel, an
  all-reduce over the TP group in every block's forward and one in its backward) × world/tp
  data-parallel replicas (gradient all-reduce over the DP group).

Each stage is a little real CPU work plus an emulated accelerator time (a sleep: this machine has
no GPU, and sleeping lets 8 ranks share 2 cores as 8 devices would not contend for them); with the
defaults a step takes ~50 ms. A slowdown multiplies a stage's measured time: after the stage's own
work (real compute and emulated device time, never the waiting for peers) the culprit sleeps
(factor − 1) × that time, inside the stage.

Faults (``--fault`` JSON; one rank, from step ``step`` on):
``hang`` (stage data | fwd | bwd | optim; ``mb`` picks the microbatch in a pipeline): the rank
stops inside that stage and never returns; ``desync``: the rank enters a gradient all-reduce its
peers never join (it hangs inside a collective); ``slow`` (stage, ``factor``): that stage
``factor`` × slower; ``link`` (``delay_ms``): each of the rank's sends (p2p in the
pipeline, its gradient all-reduce in DDP, its TP all-reduces in TP) leaves ``delay_ms`` late;
``kill``: SIGKILL in the forward; ``hog`` (``procs``): busy processes pinned to the rank's core
compete with it; ``stall`` (``stall_s``): the rank stops in its forward for ``stall_s`` seconds,
then goes on.

Ground truth: the culprit writes ``<truth-dir>/fault.json`` when the fault actually begins (wall
clock ns, the rank's host, the labels a right diagnosis carries: `bench.real.labels.expected`),
and again with ``end_ns`` when a stall ends. Rank 0 writes ``run.json`` (shape, sizes, its step
times) when the job ends. Untraced (no ``-m ingest.torch.run``) the stage calls
time and write nothing, which is how the catalog measures the tracing overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ingest.torch as rwt
from bench.real.catalog import HOG
from bench.real.labels import expected
from ingest.torch import stages
from ingest.torch.comms import host_name

# a busy process that ends once its parent (the rank) is gone
# emulated accelerator time per step (ms); the pipeline splits fwd/bwd over its microbatches
DEVICE_MS = {"data": 5.0, "fwd": 12.0, "bwd": 20.0, "optim": 4.0}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("ddp", "pipeline", "tp"), default="ddp")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--device-scale", type=float, default=1.0,
                   help="multiply the emulated device times (step length)")
    p.add_argument("--fault", default="", help="JSON fault spec (module docstring)")
    p.add_argument("--truth-dir", default="", help="where fault.json and run.json go")
    p.add_argument("--job", default="", help="job id written into the truth")
    return p.parse_args(argv)


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


class Fault:
    """The fault of this run as seen by one rank: inert on every rank but the culprit."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, shape_info: dict[str, Any]
                 ) -> None:
        spec = json.loads(args.fault) if args.fault else {}
        self.spec = spec
        self.kind = str(spec.get("kind", ""))
        self.mine = bool(spec) and int(spec.get("rank", -1)) == rank
        self.step0 = int(spec.get("step", 10**9))
        self.stage = str(spec.get("stage", ""))
        self.factor = float(spec.get("factor", 1.0))
        self.mb = int(spec.get("mb", 0))
        self.rank, self.world, self.info = rank, world, shape_info
        self.args = args
        self.started = False
        self.hogs: list[subprocess.Popen[bytes]] = []
        self.truth = Path(args.truth_dir) / "fault.json" if args.truth_dir else None

    def active(self, step: int) -> bool:
        return self.mine and step >= self.step0

    def begin(self, pp_stage: int = 0, mb: int = 0) -> None:
        """The fault starts now: write the truth (once)."""
        if self.started:
            return
        self.started = True
        self.doc = {"job": self.args.job, "shape": self.args.shape, "world": self.world,
                    **self.info, "fault": self.kind, "spec": self.spec, "ranks": [self.rank],
                    "host": host_name(), "pid": os.getpid(), "onset_ns": time.time_ns(),
                    "end_ns": 0, "onset_step": self.step0,
                    **expected(self.kind, self.stage, self.args.shape, pp_stage, mb)}
        if self.truth is not None:
            _write(self.truth, self.doc)

    def end(self) -> None:
        self.doc["end_ns"] = time.time_ns()
        if self.truth is not None:
            _write(self.truth, self.doc)

    # -- the places the faults act -------------------------------------------------------------

    def enter(self, stage: str, step: int, pp_stage: int = 0, mb: int = 0) -> None:
        """At the start of `stage` (data | fwd | bwd | optim) of `step` (microbatch `mb`)."""
        if not self.active(step):
            return
        k = self.kind
        if k == "hang" and stage == self.stage and (stage not in ("fwd", "bwd") or mb == self.mb):
            self.begin(pp_stage, mb)
            print(f"rank {self.rank}: hanging in {stage} (mb {mb}) of step {step}", flush=True)
            while True:
                time.sleep(1)
        if k == "stall" and stage == "fwd" and not self.started:
            self.stage = "fwd"
            self.begin(pp_stage, mb)
            time.sleep(float(self.spec.get("stall_s", 4.0)))
            self.end()
        if k == "kill" and stage == "fwd":
            self.begin(pp_stage, mb)
            os.kill(os.getpid(), signal.SIGKILL)
        if k == "hog" and not self.started:
            self.begin(pp_stage, mb)
            self._start_hogs()
        if k == "slow" and stage == self.stage:
            self.begin(pp_stage, mb)

    def stretch(self, stage: str, step: int, t0_ns: int) -> None:
        """After `stage`'s own work (begun at perf-counter `t0_ns`): a slowed stage sleeps
        (factor − 1) × its measured time."""
        if self.kind == "slow" and stage == self.stage and self.active(step):
            time.sleep((self.factor - 1.0) * (time.perf_counter_ns() - t0_ns) / 1e9)

    def slow_link(self, job: Job, call: str, groups: tuple[Any, ...] = ()) -> None:
        """A slower link on the culprit: from its fault step on, each of its process groups'
        `call`s (``send``: p2p; ``allreduce``), on `groups` only when given, hands its data to
        the transport ``delay_ms`` late. The delay is inside the traced call, as a slower wire
        is: the op record spans it and the peer's matching call waits for it, while the rank's
        compute stays as fast as before."""
        if self.kind != "link" or not self.mine:
            return
        from torch._C._distributed_c10d import ProcessGroup
        orig = getattr(ProcessGroup, call)
        delay_s = float(self.spec.get("delay_ms", 20.0)) / 1000
        fault = self

        def late(pg: Any, *args: Any, **kwargs: Any) -> Any:
            if fault.active(job.step) and (not groups or any(pg is g for g in groups)):
                fault.begin()
                time.sleep(delay_s)
            return orig(pg, *args, **kwargs)

        setattr(ProcessGroup, call, late)

    def side_group(self, groups: list[list[int]], mine: int) -> Any:
        """For ``desync``: a copy of the DP groups (every rank creates all of them, in order),
        on which the culprit's lone all-reduce waits without disturbing the real ones."""
        if self.kind != "desync":
            return None
        made = [dist.new_group(g) for g in groups]
        rwt.name_group(made[mine], "dp")
        return made[mine]

    def desync(self, step: int, group: Any) -> None:
        """Before the gradient all-reduce: the culprit enters one its peers never join."""
        if self.kind == "desync" and self.active(step):
            self.begin()
            print(f"rank {self.rank}: entering an all-reduce its peers skip (step {step})",
                  flush=True)
            dist.all_reduce(torch.zeros(7), group=group)  # never completes
            while True:
                time.sleep(1)

    def _start_hogs(self) -> None:
        cpu = os.sched_getaffinity(0)
        core = {min(cpu)} if cpu else {0}
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, core)
        for _ in range(int(self.spec.get("procs", 2))):
            p = subprocess.Popen([sys.executable, "-c", HOG])
            with contextlib.suppress(OSError):
                os.sched_setaffinity(p.pid, core)
            self.hogs.append(p)

    def close(self) -> None:
        for p in self.hogs:
            p.kill()
            p.wait()


class DeviceTime(torch.autograd.Function):  # type: ignore[misc]  # torch: not in the lint env
    """Emulated accelerator time inside autograd: `fwd_s` in the forward, `bwd_s` (× the
    slowdown) in the backward, so DDP's gradient all-reduces wait for it as for real kernels."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bwd_s: float, slow: float) -> torch.Tensor:
        ctx.bwd_s, ctx.slow = bwd_s, slow
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        t0 = time.perf_counter()
        time.sleep(ctx.bwd_s)
        if ctx.slow > 1:
            time.sleep((ctx.slow - 1) * (time.perf_counter() - t0))
        return g, None, None


def mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


class Job:
    """What every shape shares: device times, data, optimizer step, step timing."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.dev = {k: v * args.device_scale / 1000 for k, v in DEVICE_MS.items()}
        self.gen = torch.Generator().manual_seed(rank)
        self.step_ns: list[int] = []
        self.step_end_ns: list[int] = []  # wall clock, to count steps after the onset
        self.step = 0
        self.fault: Fault

    def data(self, step: int, n: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.fault.enter("data", step)
        t0 = time.perf_counter_ns()
        a = self.args
        out = []
        for _ in range(n):  # a little real preprocessing, then the emulated I/O wait
            x = torch.randn(a.batch, a.width, generator=self.gen)
            x = (x - x.mean(0)) / (x.std(0) + 1e-6)
            out.append((x, torch.tanh(x.roll(1, dims=1))))
        time.sleep(self.dev["data"])
        self.fault.stretch("data", step, t0)
        return out

    def slow_factor(self, stage: str, step: int) -> float:
        f = self.fault
        return f.factor if f.kind == "slow" and f.stage == stage and f.active(step) else 1.0

    def optim(self, step: int, opt: torch.optim.Optimizer) -> None:
        self.fault.enter("optim", step)
        t0 = time.perf_counter_ns()
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(self.dev["optim"])
        self.fault.stretch("optim", step, t0)


def train_ddp(job: Job) -> None:
    a, f = job.args, job.fault
    model = nn.parallel.DistributedDataParallel(mlp(a.width, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    side = f.side_group([list(range(job.world))], 0)
    f.slow_link(job, "allreduce")
    if f.kind == "link" or f.kind == "desync":
        def hook(state: Any, bucket: Any) -> Any:  # the default all-reduce, from Python
            buf = bucket.buffer()
            buf.div_(job.world)
            f.desync(job.step, side)
            work = dist.all_reduce(buf, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        model.register_comm_hook(None, hook)
    for step in range(a.steps):
        job.step = step
        t_step = time.perf_counter_ns()
        with stages.step(step):
            with stages.data():
                ((x, y),) = job.data(step)
            with stages.fwd_loss():
                f.enter("fwd", step)
                t0 = time.perf_counter_ns()
                out = model(x)
                out = DeviceTime.apply(out, job.dev["bwd"], job.slow_factor("bwd", step))
                loss = nn.functional.mse_loss(out, y)
                time.sleep(job.dev["fwd"])
                f.stretch("fwd", step, t0)
            with stages.backward():
                f.enter("bwd", step)
                loss.backward()
            with stages.optim():
                job.optim(step, opt)
        job.step_ns.append(time.perf_counter_ns() - t_step)
        job.step_end_ns.append(time.time_ns())


def train_pipeline(job: Job) -> None:
    a, f = job.args, job.fault
    pp, world, rank = a.pp, job.world, job.rank
    if world % pp:
        raise SystemExit(f"pipeline: world {world} is not a multiple of --pp {pp}")
    dp = world // pp
    s, replica = rank // dp, rank % dp  # ranks [s*dp, (s+1)*dp) hold stage s
    dp_groups = [dist.new_group(list(range(st * dp, (st + 1) * dp))) for st in range(pp)]
    pp_groups = [dist.new_group([st * dp + r for st in range(pp)]) for r in range(dp)]
    rwt.name_group(dp_groups[s], "dp")
    rwt.name_group(pp_groups[replica], "pp")
    dp_group = dp_groups[s]
    side = f.side_group([list(range(st * dp, (st + 1) * dp)) for st in range(pp)], s)
    prev = rank - dp if s > 0 else -1
    nxt = rank + dp if s < pp - 1 else -1
    model = mlp(a.width, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    m = a.microbatches
    mb = max(1, a.batch // m)
    fwd_s, bwd_s = job.dev["fwd"] / m, job.dev["bwd"] / m
    sends: list[Any] = []

    f.slow_link(job, "send")

    def send(t: torch.Tensor, peer: int, step: int) -> None:
        sends.append((dist.isend(t.contiguous(), peer), t))

    def forward(i: int, step: int, xs: list[tuple[torch.Tensor, torch.Tensor]],
                ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        with stages.fwd_loss():
            f.enter("fwd", step, s, i)
            if s == 0:
                x = xs[i][0][:mb]
            else:
                x = torch.empty(mb, a.width)
                dist.recv(x, prev)
                x.requires_grad_(True)
            t0 = time.perf_counter_ns()
            out = DeviceTime.apply(model(x), bwd_s, job.slow_factor("bwd", step))
            if s == pp - 1:
                out = nn.functional.mse_loss(out, xs[i][1][:mb])
            time.sleep(fwd_s)
            f.stretch("fwd", step, t0)
            if nxt >= 0:
                send(out.detach(), nxt, step)
            ins.append(x)
            outs.append(out)

    def backward(i: int, step: int, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        with stages.backward():
            f.enter("bwd", step, s, i)
            if nxt >= 0:
                g = torch.empty(mb, a.width)
                dist.recv(g, nxt)
                outs[i].backward(g)
            else:
                outs[i].backward()
            if prev >= 0:
                grad = ins[i].grad
                assert grad is not None
                send(grad, prev, step)

    for step in range(a.steps):
        job.step = step
        t_step = time.perf_counter_ns()
        with stages.step(step):
            with stages.data():
                xs = job.data(step, m) if s in (0, pp - 1) else []
            ins: list[torch.Tensor] = []
            outs: list[torch.Tensor] = []
            warm = min(pp - s - 1, m)
            for i in range(warm):
                forward(i, step, xs, ins, outs)
            for i in range(m - warm):
                forward(warm + i, step, xs, ins, outs)
                backward(i, step, ins, outs)
            for i in range(m - warm, m):
                backward(i, step, ins, outs)
            with stages.backward():  # the stage's data-parallel gradient all-reduce
                f.desync(step, side)
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                  if p.grad is not None])
                dist.all_reduce(flat, group=dp_group)
                for w, _ in sends:
                    w.wait()
                sends.clear()
            with stages.optim():
                job.optim(step, opt)
        job.step_ns.append(time.perf_counter_ns() - t_step)
        job.step_end_ns.append(time.time_ns())




class _Reduce(torch.autograd.Function):  # type: ignore[misc]
    """All-reduce over the TP group in the forward (row-parallel output), identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _Copy(torch.autograd.Function):  # type: ignore[misc]
    """Identity forward, all-reduce over the TP group in the backward (column-parallel input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class TPBlock(nn.Module):  # type: ignore[misc]
    """One tensor-parallel MLP block: this rank's column shard of the first layer and row shard
    of the second."""

    def __init__(self, width: int, tp: int, group: Any) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width // tp)
        self.down = nn.Linear(2 * width // tp, width, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(_Copy.apply(x, self.group)))
        return x + _Reduce.apply(self.down(h), self.group)


def train_tp(job: Job) -> None:
    a, f = job.args, job.fault
    tp, world, rank = a.tp, job.world, job.rank
    if world % tp:
        raise SystemExit(f"tp: world {world} is not a multiple of --tp {tp}")
    dp = world // tp
    tp_groups = [dist.new_group(list(range(r * tp, (r + 1) * tp))) for r in range(dp)]
    dp_groups = [dist.new_group([r * tp + t for r in range(dp)]) for t in range(tp)]
    tp_group, dp_group = tp_groups[rank // tp], dp_groups[rank % tp]
    rwt.name_group(tp_group, "tp")
    rwt.name_group(dp_group, "dp")
    side = f.side_group([[r * tp + t for r in range(dp)] for t in range(tp)], rank % tp)
    f.slow_link(job, "allreduce", (tp_group,))
    torch.manual_seed(rank % tp)  # the same shards on every replica
    model = nn.Sequential(TPBlock(a.width, tp, tp_group), TPBlock(a.width, tp, tp_group))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    job.gen.manual_seed(rank // tp)  # the TP ranks of a replica see the same batch
    for step in range(a.steps):
        job.step = step
        t_step = time.perf_counter_ns()
        with stages.step(step):
            with stages.data():
                ((x, y),) = job.data(step)
            with stages.fwd_loss():
                f.enter("fwd", step)
                t0 = time.perf_counter_ns()
                out = DeviceTime.apply(model(x), job.dev["bwd"], job.slow_factor("bwd", step))
                loss = nn.functional.mse_loss(out, y)
                time.sleep(job.dev["fwd"])
                f.stretch("fwd", step, t0)
            with stages.backward():
                f.enter("bwd", step)
                loss.backward()
                f.desync(step, side)
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                  if p.grad is not None])
                dist.all_reduce(flat, group=dp_group)
            with stages.optim():
                job.optim(step, opt)
        job.step_ns.append(time.perf_counter_ns() - t_step)
        job.step_end_ns.append(time.time_ns())


def virtual_host(args: argparse.Namespace, rank: int, world: int) -> str:
    """The host this rank reports (``RANKWATCH_NODE_NAME``), laid out as such a job is on a cluster:
    each pipeline stage on a host of its own (PP hops cross a network), each TP group on one
    (its collectives stay inside a host), a DDP job on this machine alone. The ranks all run
    here; the names only give the diagnosis the layout it would see."""
    me = socket.gethostname()
    if args.shape == "pipeline" and args.pp > 1 and world % args.pp == 0:
        return f"{me}-s{rank // (world // args.pp)}"
    if args.shape == "tp" and args.tp > 1:
        return f"{me}-t{rank // args.tp}"
    return me


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    os.environ["RANKWATCH_NODE_NAME"] = virtual_host(args, int(os.environ.get("RANK", "0")),
                                                int(os.environ.get("WORLD_SIZE", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    info: dict[str, Any] = {"pp": args.pp if args.shape == "pipeline" else 1,
                            "tp": args.tp if args.shape == "tp" else 1,
                            "microbatches": args.microbatches if args.shape == "pipeline" else 1}
    info["dp"] = world // (info["pp"] * info["tp"])
    job = Job(args, rank, world)
    job.fault = Fault(args, rank, world, info)
    t0 = time.time_ns()
    try:
        {"ddp": train_ddp, "pipeline": train_pipeline, "tp": train_tp}[args.shape](job)
    finally:
        job.fault.close()
    dist.barrier()
    if rank == 0 and args.truth_dir:
        _write(Path(args.truth_dir) / "run.json", {
            "job": args.job, "shape": args.shape, "world": world, **info, "steps": args.steps,
            "host": host_name(), "start_ns": t0, "end_ns": time.time_ns(),
            "step_ns": job.step_ns, "step_end_ns": job.step_end_ns,
            "traced": rwt.active_tracer() is not None})
    dist.destroy_process_group()


if __name__ == "__main__":
    threading.current_thread().name = "train"
    main()
