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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ingest.torch as rwt
from ingest import ring
from ingest.torch import provision
from ingest.torch.events import OP_CODE
from ingest.torch.sink import FUNC, fnv1a64
from tests.conftest import free_ports

#: real torch.distributed (installed on first use, seconds to import): not in `make test-unit`
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def torch_ready(pytestconfig: pytest.Config) -> None:
    """torch importable, installed on first use with the progress on the terminal."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        reason = provision.ensure_importable()
    if reason:
        pytest.skip(f"no CPU torch: {reason}")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"/rwt{uuid.uuid4().hex[:8]}"
    yield p
    for name in ring.list_rings(p):
        ring.load_library().rw_ring__unlink(name.encode())


@pytest.fixture
def world1(tmp_path: Path, prefix: str) -> Iterator[Path]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}",
                            rank=0, world_size=1)
    rwt.enable(job_id="t1", ring_dir=str(tmp_path), prefix=prefix)
    try:
        yield tmp_path / "t1"
    finally:
        rwt.disable()
        dist.destroy_process_group()


class Drained:
    """One drain of a rank's py ring: op starts, op ends, stage records (structured arrays)."""

    def __init__(self, prefix: str, job: str, rank: int = 0) -> None:
        with ring.RingReader(ring.ring_name(job, rank, "py", prefix)) as r:
            parts = ring.split_kinds(r.drain())
        ops = parts["op"]
        end = (ops["flags"] & ring.F_END) != 0
        self.starts, self.ends, self.stages = ops[~end], ops[end], parts["stage"]
        self.names = ring.decode_names(parts["name"])


def func(op: str) -> int:
    return FUNC[OP_CODE[op]]


def test_sync_and_async_collectives_are_recorded(world1: Path, prefix: str) -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(8)
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    work.wait()
    dist.broadcast(t, src=0)
    dist.barrier()
    rwt.stages.step().__enter__().__exit__()  # a stage boundary harvests completions
    d = Drained(prefix, "t1")
    assert d.starts["op_seq"].tolist() == [0, 1, 2, 3]  # op_seq on the world communicator
    assert d.starts["func"].tolist() == [func(o) for o in
                                         ("AllReduce", "AllReduce", "Broadcast", "Barrier")]
    assert d.starts["bytes"][:2].tolist() == [32, 32]
    assert d.names == {fnv1a64("world"): "world"}
    assert set(d.starts["comm_hash"].tolist()) == {fnv1a64("world")}
    assert sorted(d.ends["op_seq"].tolist()) == [0, 1, 2, 3]
    by_seq = dict(zip(d.ends["op_seq"].tolist(), d.ends["t_end"].tolist(), strict=True))
    assert all(by_seq[s] >= t0 for s, t0 in
               zip(d.starts["op_seq"].tolist(), d.starts["t_start"].tolist(), strict=True))
    side = json.loads((world1 / "rank-0.json").read_text())
    assert side["comms"] == [{"comm_id": "world", "kind": "world", "members": [0]}]


def test_async_work_that_fails_gets_no_end_and_stays_in_flight(world1: Path,
                                                               prefix: str) -> None:
    """A collective whose future completes with an error (gloo: "Connection closed by peer"
    when a peer process died) did not complete: no end record, so the op stays in flight for
    the agent to publish as such; one that succeeds beside it ends as usual. Real torch
    futures, completed by hand as the process group would."""
    import torch

    tracer = rwt.active_tracer()
    seq_bad = tracer.start(0, OP_CODE["AllReduce"], 32, -1)
    seq_ok = tracer.start(0, OP_CODE["AllReduce"], 32, -1)
    bad, ok = torch.futures.Future(), torch.futures.Future()
    bad.add_done_callback(tracer.callbacks[tracer.track(0, seq_bad)])
    ok.add_done_callback(tracer.callbacks[tracer.track(0, seq_ok)])
    bad.set_exception(RuntimeError("Connection closed by peer"))
    ok.set_result([torch.ones(8)])
    tracer.harvest()
    d = Drained(prefix, "t1")
    assert d.starts["op_seq"].tolist() == [seq_bad, seq_ok]
    assert d.ends["op_seq"].tolist() == [seq_ok]
    assert tracer.failed == 1 and not tracer.outstanding  # the slot is free again


def test_entering_a_stage_harvests_completed_async_calls(world1: Path, prefix: str) -> None:
    """A backward's async all-reduce that completed is recorded when the next stage begins
    (the optimizer), not only at the step's end: a rank that stops inside its optimizer must
    not leave it "in flight" while its peers wait in the next step's all-reduce."""
    import torch
    import torch.distributed as dist

    t = torch.ones(8)
    step = rwt.stages.step()
    step.__enter__()
    with rwt.stages.backward():
        work = dist.all_reduce(t, async_op=True)
        assert work is not None
        work.wait()
    with rwt.stages.optim():
        d = Drained(prefix, "t1")  # drained inside the optimizer, before the step ends
    step.__exit__(None, None, None)
    assert d.starts["op_seq"].tolist() == [0]
    assert d.ends["op_seq"].tolist() == [0]


def test_new_group_is_a_named_communicator(world1: Path, prefix: str) -> None:
    import torch
    import torch.distributed as dist

    g = dist.new_group([0])
    rwt.name_group(g, "tp")
    dist.all_reduce(torch.ones(1), group=g)
    side = json.loads((world1 / "rank-0.json").read_text())
    assert side["comms"][1]["kind"] == "tp" and side["comms"][1]["comm_id"].startswith("pg")
    d = Drained(prefix, "t1")
    assert d.names[int(d.starts["comm_hash"][-1])] == side["comms"][1]["comm_id"]


def test_stage_vector_closes_to_the_step_time(world1: Path, prefix: str) -> None:
    import torch
    import torch.distributed as dist

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
    got = Drained(prefix, "t1")
    st = got.stages
    assert st["step"].tolist() == [10, 11, 12]
    d = np.column_stack([st[f].astype(np.int64) for f in (
        "data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step",
        "step_other")])
    assert (d[:, 0] >= 20e6).all() and (d[:, 1] >= 10e6).all() and (d[:, 5] >= 5e6).all()
    assert abs(int(d[-1].sum()) - wall) < 2e6  # residual closure: the six sum to the step
    assert got.starts["step"].tolist() == [10, 11, 12]  # ops know their step
    assert (st["device_ns"] == -1).all()  # no CUDA: device time unsampled


def test_a_step_records_how_long_its_thread_waited_for_a_cpu(world1: Path,
                                                            prefix: str) -> None:
    """`sched_wait_ns`: the training thread's runnable-but-waiting time within the step. With
    two busy processes pinned to its core, a step of 0.3 s of CPU work waits for most of it.
    `cpu_pressure_ns`: the host's time with some task waiting for a CPU (PSI) — on that core
    some task waits all the while, where the kernel has PSI; -1 where it has none."""
    s = rwt.stages
    cpus = os.sched_getaffinity(0)
    core = {min(cpus)}
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        with s.step(0), s.fwd_loss():
            time.sleep(0.01)
        os.sched_setaffinity(0, core)
        for _ in range(2):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            os.sched_setaffinity(hogs[-1].pid, core)
        time.sleep(0.2)  # the busy processes are running
        t0 = time.perf_counter_ns()
        with s.step(1), s.fwd_loss():
            end = time.process_time() + 0.3  # 0.3 s of this thread's own CPU time
            while time.process_time() < end:
                pass
        wall = time.perf_counter_ns() - t0
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        os.sched_setaffinity(0, cpus)
    st = Drained(prefix, "t1").stages
    assert st["step"].tolist() == [0, 1]
    wait = st["sched_wait_ns"].astype(np.int64)
    assert (wait >= 0).all()  # read on Linux
    assert wait[1] >= 0.3 * wall, (wait.tolist(), wall)  # a third of the core was its at most
    pressure = st["cpu_pressure_ns"].astype(np.int64)
    try:
        Path("/proc/pressure/cpu").read_bytes()
    except OSError:
        assert (pressure == -1).all()
        return
    assert (pressure >= 0).all()
    # the host-wide share weighs each CPU by its busy time: the crowded core counts at least
    # as much as any other, whatever else runs
    assert pressure[1] >= 0.3 * wall, (pressure.tolist(), wall)


def test_disable_restores_torch_distributed(world1: Path, prefix: str) -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    rwt.disable()
    dist.all_reduce(torch.ones(1))
    assert len(Drained(prefix, "t1").starts) == 1
    rwt.enable(job_id="t1", ring_dir=str(world1.parent), prefix=prefix)


def _torchrun(args: list[str], env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    full = provision.pythonpath_with_torch({**os.environ, **env, "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_ports(1)[0]), *args]
    return subprocess.run(cmd, env=full, cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["module", "sitecustomize"])
def test_torchrun_without_code_changes(tmp_path: Path, how: str, prefix: str) -> None:
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
        "from ingest.torch import stages\n"
        "for i in range(4):\n"
        "    with stages.step(i):\n"
        "        dist.barrier()\n"
        "dist.destroy_process_group()\n")
    env: dict[str, Any] = {"RANKWATCH_RING_DIR": str(tmp_path / "rings"), "RANKWATCH_JOB": "p2p",
                           "RANKWATCH_RING_PREFIX": prefix}
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
    side = json.loads((tmp_path / "rings" / "p2p" / "rank-0.json").read_text())
    assert len(side["hosts"]) == 2  # gathered through the store by rank 0
    for rank, op in ((0, "Send"), (1, "Recv")):
        d = Drained(prefix, "p2p", rank)
        assert d.starts["func"].tolist()[:2] == [func(op), func("AllReduce")]
        assert d.starts["peer"][0] == 1 - rank
        assert sorted(d.ends["op_seq"].tolist())[:2] == [0, 1]  # p2p completion seen, the AR


class FakeEvent:
    """torch.cuda.Event's surface: record, query, elapsed_time (ms)."""

    def __init__(self, ready: bool) -> None:
        self.ready, self.recorded = ready, 0

    def record(self) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return self.ready

    def elapsed_time(self, other: FakeEvent) -> float:
        return 2.5


def test_sampled_cuda_event_channel(world1: Path, prefix: str) -> None:
    """Every 2nd step brackets fwd_loss with events; a ready pair gives device_ns, a pair not
    ready yet gives -1 (never a synchronize)."""
    s = rwt.stages
    begin, end = FakeEvent(True), FakeEvent(True)
    s._events, s.sample_every = (begin, end), 2
    try:
        for step in range(4):
            end.ready = step != 2
            with s.step(step), s.fwd_loss():
                pass
    finally:
        s._events, s.sample_every = None, 0
    st = Drained(prefix, "t1").stages
    assert st["device_ns"].tolist() == [2_500_000, -1, -1, -1]
    assert begin.recorded == end.recorded == 2


def test_sync_collective_on_an_nccl_group_completes_when_its_work_does(
        world1: Path, prefix: str) -> None:
    """NCCL's sync collectives return before the GPU finishes: the tracer issues them async,
    waits, and polls the work's completion. The same path, forced on a gloo group."""
    import torch
    import torch.distributed as dist

    tr = rwt.active_tracer()
    tr.nccl[0] = True
    t = torch.ones(4)
    assert dist.all_reduce(t) is None  # still a sync call for the caller
    assert t.tolist() == [1.0] * 4
    with rwt.stages.step():
        pass
    d = Drained(prefix, "t1")
    assert d.starts["op_seq"].tolist() == [0] and d.ends["op_seq"].tolist() == [0]
    assert int(d.ends["t_end"][0]) >= int(d.starts["t_start"][0])


def test_nccl_work_ends_when_the_gpu_is_done_not_when_its_future_is(
        world1: Path, prefix: str) -> None:
    """On a real GPU an NCCL future completes at enqueue while the kernel still runs (seen on
    an H100: an AllReduce stuck 8 s was recorded as done in 0.2 ms). The end comes from
    `is_completed()` (the work's CUDA event), first seen at a touchpoint."""
    import torch

    from ingest.torch.collectives import SPECS, _wrap

    class GpuWork:
        gpu_done = False

        def get_future(self) -> Any:
            raise AssertionError("an NCCL op's end must not come from its future")

        def is_completed(self) -> bool:
            return self.gpu_done

        def wait(self) -> None:  # the current stream waits; the CPU does not
            pass

    tr = rwt.active_tracer()
    tr.nccl[0] = True
    work = GpuWork()
    traced = _wrap(tr, "all_reduce", SPECS["all_reduce"], lambda *a, **k: work)
    assert traced(torch.ones(4)) is None
    with rwt.stages.step():
        pass
    assert not len(Drained(prefix, "t1").ends)  # the GPU is still busy: no end yet
    work.gpu_done = True
    with rwt.stages.step():
        pass
    assert Drained(prefix, "t1").ends["op_seq"].tolist() == [0]
