"""The PyTorch tracer on real torch.distributed (gloo, CPU): op events, completions, stage
vectors, communicators, and both ways of enabling it under torchrun.

torch comes from `ingest.torch.provision` (installed once per machine into the cache, CPU-only);
without it these tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ingest.torch import provision
from ingest.torch.events import OP_CODE, OP_END, OP_START, STAGE
from ingest.torch.spool import SpoolReader

_reason = provision.ensure_importable()
if _reason:
    pytest.skip(f"no CPU torch: {_reason}", allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ingest.torch as rwt  # noqa: E402
from tests.conftest import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def world1(tmp_path: Path) -> Iterator[Path]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}",
                            rank=0, world_size=1)
    rwt.enable(job_id="t1", ring_dir=str(tmp_path))
    try:
        yield tmp_path / "t1"
    finally:
        rwt.disable()
        dist.destroy_process_group()


def drain(d: Path, rank: int = 0) -> np.ndarray:
    return SpoolReader(d / f"rank-{rank}.ring").read()


def test_sync_and_async_collectives_are_recorded(world1: Path) -> None:
    t = torch.ones(8)
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    work.wait()
    dist.broadcast(t, src=0)
    dist.barrier()
    rwt.stages.step().__enter__().__exit__()  # a stage boundary harvests completions
    rows = drain(world1)
    starts, ends = rows[rows[:, 0] == OP_START], rows[rows[:, 0] == OP_END]
    assert starts[:, 3].tolist() == [0, 1, 2, 3]  # op_seq on the world communicator
    assert starts[:, 4].tolist() == [OP_CODE[o] for o in
                                      ("AllReduce", "AllReduce", "Broadcast", "Barrier")]
    assert starts[:2, 5].tolist() == [32, 32]
    assert sorted(ends[:, 3].tolist()) == [0, 1, 2, 3]
    by_seq = dict(zip(ends[:, 3].tolist(), ends[:, 4].tolist(), strict=True))
    assert all(by_seq[s] >= t0 for s, t0 in zip(starts[:, 3], starts[:, 8], strict=True))
    side = json.loads((world1 / "rank-0.json").read_text())
    assert side["comms"] == [{"comm_id": "world", "kind": "world", "members": [0]}]


def test_new_group_is_a_named_communicator(world1: Path) -> None:
    g = dist.new_group([0])
    rwt.name_group(g, "tp")
    dist.all_reduce(torch.ones(1), group=g)
    side = json.loads((world1 / "rank-0.json").read_text())
    assert side["comms"][1]["kind"] == "tp" and side["comms"][1]["comm_id"].startswith("pg")
    rows = drain(world1)
    assert rows[rows[:, 0] == OP_START][-1, 2] == 1  # the group's index


def test_stage_vector_closes_to_the_step_time(world1: Path) -> None:
    s = rwt.stages
    for step in range(3):
        t0 = time.perf_counter_ns()
        with s.step(step + 10):
            with s.data():
                time.sleep(0.02)
            with s.fwd_loss():
                time.sleep(0.01)
            with s.backward():
                dist.all_reduce(torch.ones(4))
            with s.callbacks():
                pass
            with s.optim():
                pass
            time.sleep(0.005)  # not in any span: step.other
        wall = time.perf_counter_ns() - t0
    rows = drain(world1)
    st = rows[rows[:, 0] == STAGE]
    assert st[:, 2].tolist() == [10, 11, 12]
    d = st[:, 4:10]
    assert (d[:, 0] >= 20e6).all() and (d[:, 1] >= 10e6).all() and (d[:, 5] >= 5e6).all()
    assert abs(int(d[-1].sum()) - wall) < 2e6  # residual closure: the six sum to the step
    ops = rows[rows[:, 0] == OP_START]
    assert ops[:, 9].tolist() == [10, 11, 12]  # ops know their step
    assert (st[:, 10] == -1).all()  # no CUDA: device time unsampled


def test_disable_restores_torch_distributed(world1: Path) -> None:
    rwt.disable()
    n = len(drain(world1))
    dist.all_reduce(torch.ones(1))
    assert len(drain(world1)) == 0 and n >= 0
    rwt.enable(job_id="t1", ring_dir=str(world1.parent))


def _torchrun(args: list[str], env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    full = provision.pythonpath_with_torch({**os.environ, **env, "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_ports(1)[0]), *args]
    return subprocess.run(cmd, env=full, cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["module", "sitecustomize"])
def test_torchrun_without_code_changes(tmp_path: Path, how: str) -> None:
    """Both launch styles trace a plain script: p2p isend/irecv and a collective."""
    script = tmp_path / "plain.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "r = dist.get_rank()\n"
        "t = torch.ones(16)\n"
        "w = dist.isend(t, 1) if r == 0 else dist.irecv(t, 0)\n"
        "w.wait()\n"
        "dist.all_reduce(t)\n"
        "dist.destroy_process_group()\n")
    env: dict[str, Any] = {"RANKWATCH_RING_DIR": str(tmp_path / "rings"), "RANKWATCH_JOB": "p2p"}
    if how == "module":
        args = ["-m", "ingest.torch.run", str(script)]
        env["PYTHONPATH"] = str(ROOT)
    else:
        autoload = subprocess.run([sys.executable, "-m", "ingest.torch.autoload"], cwd=ROOT,
                                  capture_output=True, text=True, check=True).stdout.strip()
        env.update(PYTHONPATH=autoload, RANKWATCH_TRACE="1")
        args = [str(script)]
    done = _torchrun(args, env, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for rank, op in ((0, "Send"), (1, "Recv")):
        rows = drain(tmp_path / "rings" / "p2p", rank)
        starts, ends = rows[rows[:, 0] == OP_START], rows[rows[:, 0] == OP_END]
        assert starts[:, 4].tolist() == [OP_CODE[op], OP_CODE["AllReduce"]]
        assert starts[0, 6] == 1 - rank  # the peer
        assert sorted(ends[:, 3].tolist()) == [0, 1]  # p2p completion seen, all-reduce too
