"""Proof on real training that the host agent infers a pipeline's shape from its p2p pattern.

A 4-process 2-stage pipeline (examples/train.py --mode pipeline: ranks 0, 1 are stage 0 and
feed ranks 2, 3; one DP group per stage; 3 microbatches) runs under torchrun (gloo, CPU), traced,
with RANKWATCH_PP/DP/MICROBATCHES unset; `rankwatch agent --capture` drains the rings. The last
topology it published must say pp 2, dp 2, 3 microbatches, inferred — and the agent's log says
so. (No broker needed: the capture file holds exactly what would be published.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ingest import ring
from ingest.agent.capture import read_capture
from ingest.batch import decode_batch
from ingest.torch.provision import pythonpath_with_torch, torch_site
from tests.conftest import free_ports

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def torch_ready(pytestconfig: pytest.Config) -> None:
    from ingest.torch import provision

    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        site = torch_site()
    if site is None:
        pytest.skip(f"no CPU torch: {provision.last_error}")


def test_agent_infers_the_pipeline_shape_from_p2p(tmp_path: Path) -> None:
    job, prefix, rings = f"shape-{uuid.uuid4().hex[:6]}", f"/rws{uuid.uuid4().hex[:8]}", \
        tmp_path / "rings"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANKWATCH_PP", "RANKWATCH_DP", "RANKWATCH_TP", "RANKWATCH_MICROBATCHES")}
    env = pythonpath_with_torch({**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                 "RANKWATCH_JOB": job, "RANKWATCH_RING_DIR": str(rings),
                                 "RANKWATCH_RING_PREFIX": prefix})
    capture = tmp_path / "agent.rwcap"
    agent = subprocess.Popen(
        [sys.executable, "-m", "rankwatch.cli", "agent", "--sidecar-dir", str(rings),
         "--prefix", prefix, "--job", job, "--beat", "0.3", "--linger", "0.1", "--capture",
         str(capture), "--exit-when-idle", "1", "--duration", "240"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        train = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
             "--master-port", str(free_ports(1)[0]), "-m", "ingest.torch.run",
             "examples/train.py", "--mode", "pipeline", "--steps", "40", "--width", "64",
             "--microbatches", "3", "--batch", "24", "--step-sleep-ms", "20"],
            env=env, cwd=ROOT, capture_output=True, timeout=240)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        out, _ = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for name in ring.list_rings(prefix):
            ring.load_library().rw_ring__unlink(name.encode())
    log = out.decode(errors="replace")
    topos = [t for f in read_capture(capture) if f.kind == "jobs"
             for t in decode_batch(f.data).topologies]
    assert topos, log
    last = topos[-1]
    assert (last.world_size, last.pp, last.dp, last.tp, last.microbatches) == (4, 2, 2, 1, 3), \
        (last, log)
    assert last.shape_source == {"tp": "inferred", "pp": "inferred", "dp": "inferred",
                                 "microbatches": "inferred", "schedule": "default"}, last
    assert last.schedule == "1f1b"
    assert "pp=2 (inferred) dp=2 (inferred)" in log and "chains 0→2, 1→3" in log, log
