"""Proof on real training: a 4-process PyTorch job (gloo, CPU) traced by ingest.torch, drained
by `rankwatch agent`, through the real broker, worker and ClickHouse, diagnosed by the engine.

- data parallel (DDP): rank 2's data loading is 80 ms slower on every step, and rank 1 hangs
  before the backward of step 25. Over the steps before the hang the engine must blame rank 2's
  data stage; after it, rank 1 (its peers wait in the all-reduce it never joins). Rank 1's beats
  carry its position: inside model.backward of step 25.
- 2-stage pipeline (send/recv, per-stage DP all-reduce): rank 3 (stage 1) hangs before its
  backward of step 15; rank 1, its stage-0 partner, waits in Recv for a gradient that never
  comes, and ranks 0 and 2 in their all-reduces. The engine must blame rank 3.

torch comes from `ingest.torch.provision` (installed once per machine, CPU-only); the test skips
with the reason when it cannot be had.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from diagnosis import engine
from diagnosis.columns import Columns
from diagnosis.position import current_stage
from diagnosis.triggers.base import Trigger
from diagnosis.window import Window
from ingest import ring
from ingest.records import JobTopology
from ingest.torch.provision import pythonpath_with_torch, torch_site
from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from rankwatch.settings import Settings
from tests.conftest import free_ports

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow



@pytest.fixture(scope="module", autouse=True)
def torch_ready(pytestconfig: pytest.Config) -> None:
    """torch for the training processes, installed on first use (progress on the terminal)."""
    from ingest.torch import provision

    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        site = torch_site()
    if site is None:
        pytest.skip(f"no CPU torch: {provision.last_error}")

QUERIES = {
    "ops": "SELECT rank, comm_id, op_seq, any(op) AS op, any(bytes) AS bytes, any(peer) AS peer,"
           " any(stream) AS stream, min(toUnixTimestamp64Nano(t_enqueue)) AS t_enqueue,"
           " min(toUnixTimestamp64Nano(t_start)) AS t_start,"
           " max(toUnixTimestamp64Nano(t_end)) AS t_end, any(step) AS step FROM ops"
           " WHERE job_id = '{job}' GROUP BY rank, comm_id, op_seq",
    "stages": "SELECT rank, step, toUnixTimestamp64Nano(t_start) AS t_start, data_next_wait,"
              " model_fwd_loss, model_backward, callbacks, optim_step, step_other, device_ns"
              " FROM stages WHERE job_id = '{job}'",
    "beats": "SELECT rank, toUnixTimestamp64Nano(ts) AS ts, comm_id, last_op_seq, dropped,"
             " step, stage, toUnixTimestamp64Nano(stage_ts) AS stage_ts"
             " FROM beats WHERE job_id = '{job}'",
}
TIME_COL = {"ops": "t_start", "stages": "t_start", "beats": "ts"}


class Rig:
    def __init__(self, settings: Settings, ring_dir: Path) -> None:
        self.settings, self.ring_dir = settings, ring_dir
        self.prefix = f"/rwe{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = pythonpath_with_torch({
            **os.environ, "PYTHONPATH": str(ROOT),
            "RANKWATCH_HOME": str(settings.home),
            "RANKWATCH_KAFKA_BOOTSTRAP": settings.bootstrap,
            "RANKWATCH_TOPIC_PREFIX": settings.topic_prefix,
            "RANKWATCH_RING_DIR": str(ring_dir), "OMP_NUM_THREADS": "1",
            "RANKWATCH_RING_PREFIX": self.prefix})

    def sql(self, query: str) -> str:
        for attempt in range(5):  # the worker's endpoint may reset while it is starting
            req = urllib.request.Request(stack.sql_endpoint(self.settings) + "/",
                                         method="POST", data=query.encode())
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return str(r.read().decode())
            except (ConnectionError, urllib.error.URLError):
                if attempt == 4:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")

    def rows(self, query: str) -> dict[str, np.ndarray]:
        doc = orjson.loads(self.sql(query + " FORMAT JSONColumns"))
        return {k: np.asarray(v, dtype=object if v and isinstance(v[0], str) else np.int64)
                for k, v in doc.items()}

    def start(self, *cmd: str, log: str) -> subprocess.Popen[bytes]:
        out = open(self.ring_dir.parent / log, "wb")  # noqa: SIM115 - lives with the process
        p = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                             cwd=ROOT, start_new_session=True)
        self.procs.append(p)
        return p

    def agent(self, job: str) -> None:
        tracer_only = ("RANKWATCH_JOB", "RANKWATCH_RING_DIR", "RANKWATCH_PP", "RANKWATCH_DP",
                       "RANKWATCH_MICROBATCHES", "RANKWATCH_RING_PREFIX")
        saved = {k: self.env.pop(k) for k in tracer_only if k in self.env}
        self.start(sys.executable, "-m", "rankwatch.cli", "agent", "--sidecar-dir",
                   str(self.ring_dir), "--prefix", self.prefix, "--job", job, "--inflight",
                   "1", "--beat", "0.5", "--linger", "0.1", log=f"agent-{job}.log")
        self.env.update(saved)

    def train(self, job: str, *args: str) -> None:
        self.env["RANKWATCH_JOB"] = job  # read by the workers at enable()
        self.start(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                   "--master-port", str(free_ports(1)[0]),
                   "-m", "ingest.torch.run", "examples/train.py", *args,
                   log=f"train-{job}.log")

    def wait(self, what: str, check: Any, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.5)
        logs = {p.name: p.read_text()[-3000:] for p in self.ring_dir.parent.glob("*.log")}
        raise AssertionError(f"timed out waiting for {what}; logs: {logs}")

    def window(self, job: str, until_ns: int | None = None) -> Window:
        topo_json = self.sql(f"SELECT topology FROM jobs FINAL WHERE job_id = '{job}' "
                             "FORMAT TSVRaw").strip()
        topo = JobTopology.model_validate_json(topo_json)
        now = until_ns or time.time_ns()
        tables: dict[str, Columns] = {}
        for k, q in QUERIES.items():
            t = self.rows(q.format(job=job))
            keep = t[TIME_COL[k]] <= now
            tables[k] = {c: v[keep] for c, v in t.items()}
        return Window(topo, tables, start_ns=now - 600 * 10**9, now_ns=now)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for name in ring.list_rings(self.prefix):
            ring.load_library().rw_ring__unlink(name.encode())


@pytest.fixture
def rig(kafka, settings_factory, tmp_path: Path) -> Iterator[Rig]:
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"e{uuid.uuid4().hex[:10]}", kafka_partitions=2)
    stack.up(settings, progress=lambda m: None)
    r = Rig(settings, tmp_path / "rings")
    try:
        yield r
    finally:
        r.stop()
        stack.down(settings, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [s.name for s in settings.topics.specs(2)])


def _count(rig: Rig, sql: str) -> int:
    out = rig.sql(sql).strip()
    return int(out or 0)


def test_ddp_slow_data_rank_and_hung_rank(rig: Rig) -> None:
    job = f"ddp-{uuid.uuid4().hex[:6]}"
    rig.train(job, "--mode", "ddp", "--steps", "200", "--width", "128", "--slow-rank", "2",
              "--slow-stage", "data.next_wait", "--slow-ms", "80", "--hang-rank", "1",
              "--hang-step", "25", "--step-sleep-ms", "10")
    rig.agent(job)
    rig.wait("the peers' in-flight all-reduce", lambda: _count(rig, (
        f"SELECT uniqExact(rank) FROM ops WHERE job_id = '{job}' AND "
        "toUnixTimestamp64Nano(t_end) = 0")) >= 3)
    rig.wait("the topology", lambda: _count(rig, f"SELECT count() FROM jobs WHERE job_id = "
                                                 f"'{job}'") >= 1)
    time.sleep(1.5)

    last_good = _count(rig, f"SELECT max(toUnixTimestamp64Nano(t_start)) FROM stages WHERE "
                            f"job_id = '{job}' AND step = 24")
    slow_w = rig.window(job, until_ns=last_good)
    stages = slow_w.get("stages")
    data = np.asarray(stages["data_next_wait"], dtype=np.int64)
    ranks = np.asarray(stages["rank"], dtype=np.int64)
    assert np.median(data[ranks == 2]) > 60e6 > np.median(data[ranks != 2])
    slow = engine.diagnose(slow_w, Trigger(job, last_good, "straggler", (0, 1, 2, 3)), last_good)
    assert slow is not None and slow.ranks == (2,), slow
    assert slow.stage is not None and "data" in slow.stage, slow

    hang_w = rig.window(job)
    ops = hang_w.get("ops")
    inflight = np.asarray(ops["t_end"], dtype=np.int64) == 0
    assert 1 not in set(np.asarray(ops["rank"])[inflight].tolist())  # rank 1 never joined
    hang = engine.diagnose(hang_w, Trigger(job, hang_w.now_ns, "hang", (0, 2, 3)),
                           hang_w.now_ns)
    assert hang is not None and hang.kind == "hang" and hang.ranks == (1,), hang

    # the hung rank's beats say where it is: inside backward of step 25, since it got there
    last = rig.rows(f"SELECT toUnixTimestamp64Nano(ts) AS ts, step, stage, "
                    f"toUnixTimestamp64Nano(stage_ts) AS stage_ts FROM beats WHERE job_id = "
                    f"'{job}' AND rank = 1 ORDER BY ts DESC LIMIT 1")
    assert last["step"].tolist() == [25] and last["stage"].tolist() == ["model.backward"], last
    assert last["ts"][0] - last["stage_ts"][0] > 10**9  # entered long before this beat
    where = current_stage(hang_w.get("beats"), 1)
    assert where is not None and where[:2] == (25, "model.backward"), where
    hung_stages = hang_w.get("stages")
    # no stage record says so: step 25 never ended
    hung_1 = np.asarray(hung_stages["rank"]) == 1
    assert max(np.asarray(hung_stages["step"])[hung_1]) < 25


def test_pipeline_hung_stage_rank(rig: Rig) -> None:
    job = f"pp-{uuid.uuid4().hex[:6]}"
    rig.env.update({"RANKWATCH_PP": "2", "RANKWATCH_DP": "2", "RANKWATCH_MICROBATCHES": "2"})
    rig.train(job, "--mode", "pipeline", "--steps", "200", "--width", "128", "--hang-rank",
              "3", "--hang-step", "15", "--step-sleep-ms", "10")
    rig.agent(job)
    rig.wait("three ranks waiting", lambda: _count(rig, (
        f"SELECT uniqExact(rank) FROM ops WHERE job_id = '{job}' AND "
        "toUnixTimestamp64Nano(t_end) = 0")) >= 3)
    rig.wait("the topology", lambda: _count(rig, f"SELECT count() FROM jobs WHERE job_id = "
                                                 f"'{job}'") >= 1)
    time.sleep(1.5)
    w = rig.window(job)
    ops = w.get("ops")
    waiting = np.asarray(ops["t_end"], dtype=np.int64) == 0
    recv_wait = waiting & (np.asarray(ops["op"]) == "Recv") & (np.asarray(ops["rank"]) == 1)
    assert recv_wait.any()  # rank 1 waits for rank 3's gradient
    hang = engine.diagnose(w, Trigger(job, w.now_ns, "hang", (0, 1, 2)), w.now_ns)
    assert hang is not None and hang.kind == "hang" and 3 in hang.ranks, hang
