"""An instrumented training script: data parallel (DDP) or a 2-stage pipeline with send/recv.

Run it traced under torchrun (CPU, gloo) with the host agent beside it::

    rankwatch agent --job demo &                      # drains the rings, publishes to Kafka
    RANKWATCH_JOB_ID=demo torchrun --nproc-per-node 4 -m ingest.torch.run examples/train.py \
        --mode ddp --steps 50

Faults for demonstrations and the end-to-end test:
``--hang-rank R --hang-step S`` makes rank R stop before step S's backward (a live hang: the
process stays, its peers wait in the next collective); ``--slow-rank R --slow-stage STAGE
--slow-ms MS`` adds MS of host time to that rank's STAGE (data.next_wait, model.fwd_loss,
model.backward, callbacks, optim.step) on every step from `--slow-from`.

The stage calls are the StageFrontier contract (`ingest.torch.stages`); without tracing enabled
they cost a few hundred nanoseconds and write nothing.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from ingest.torch import stages


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ddp", "pipeline"), default="ddp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=10)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-stage", default="data.next_wait")
    p.add_argument("--slow-ms", type=float, default=100.0)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--step-sleep-ms", type=float, default=0.0, help="pace steps (demo)")
    return p.parse_args(argv)


class Faults:
    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank = args, rank

    def at(self, stage: str, step: int) -> None:
        a = self.args
        if a.slow_rank == self.rank and a.slow_stage == stage and step >= a.slow_from:
            time.sleep(a.slow_ms / 1000)
        if a.hang_rank == self.rank and step >= a.hang_step and stage == "model.backward":
            print(f"rank {self.rank}: hanging at step {step} before backward", flush=True)
            while True:
                time.sleep(1)


def mlp(width: int, depth: int = 3) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def batch(args: argparse.Namespace, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(args.batch, args.width, generator=gen)
    return x, x.roll(1, dims=1)


def train_ddp(args: argparse.Namespace, rank: int, faults: Faults) -> None:
    model = nn.parallel.DistributedDataParallel(mlp(args.width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        with stages.step(step):
            with stages.data():
                faults.at("data.next_wait", step)
                x, y = batch(args, gen)
            with stages.fwd_loss():
                faults.at("model.fwd_loss", step)
                loss = nn.functional.mse_loss(model(x), y)
            with stages.backward():
                faults.at("model.backward", step)
                loss.backward()
            with stages.callbacks():
                faults.at("callbacks", step)
                if step % 10 == 0 and rank == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
            with stages.optim():
                faults.at("optim.step", step)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if args.step_sleep_ms:
                time.sleep(args.step_sleep_ms / 1000)


def train_pipeline(args: argparse.Namespace, rank: int, world: int, faults: Faults) -> None:
    """2 stages × world/2 replicas: rank r < half is stage 0 and feeds rank r + half."""
    if world % 2:
        raise SystemExit("pipeline mode needs an even world size")
    import ingest.torch as rwt

    half = world // 2
    first = rank < half
    peer = rank + half if first else rank - half
    groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, world)))]
    dp_group = groups[0 if first else 1]
    rwt.name_group(dp_group, "dp")
    model = mlp(args.width, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank % half)
    mb = args.batch // args.microbatches
    for step in range(args.steps):
        with stages.step(step):
            with stages.data():
                faults.at("data.next_wait", step)
                xs = [batch(args, gen) for _ in range(args.microbatches)]
            with stages.fwd_loss():
                faults.at("model.fwd_loss", step)
                acts, outs = [], []
                for x, y in xs:
                    if first:
                        out = model(x[:mb])
                        dist.send(out.detach(), peer)
                        outs.append(out)
                    else:
                        a = torch.empty(mb, args.width, requires_grad=False)
                        dist.recv(a, peer)
                        a.requires_grad_(True)
                        acts.append(a)
                        outs.append(nn.functional.mse_loss(model(a), y[:mb]))
            with stages.backward():
                faults.at("model.backward", step)
                for i in range(args.microbatches):
                    if first:
                        g = torch.empty(mb, args.width)
                        dist.recv(g, peer)
                        outs[i].backward(g)
                    else:
                        outs[i].backward()
                        dist.send(acts[i].grad, peer)
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=dp_group)
            with stages.callbacks():
                faults.at("callbacks", step)
            with stages.optim():
                faults.at("optim.step", step)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if args.step_sleep_ms:
                time.sleep(args.step_sleep_ms / 1000)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    faults = Faults(args, rank)
    if args.mode == "ddp":
        train_ddp(args, rank, faults)
    else:
        train_pipeline(args, rank, world, faults)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()
