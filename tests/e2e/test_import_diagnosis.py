"""Imports of real trace formats through the real broker, worker and ClickHouse, judged by the
diagnoses the worker publishes (the `diagnoses` table), as a user running `rankwatch import`
against `rankwatch up` would see them.

- Flight Recorder dumps made here by real PyTorch (gloo, CPU; tests/fixtures/fr_job.py): a
  2-rank job where rank 1 stalls after three all_reduces and rank 0 waits in its fourth, dumped
  as pickle and as JSON → a hang naming rank 1; the same job without the stall → no diagnosis.
- HolisticTraceAnalysis' Kineto traces (../shared/data/hta, MIT, gzipped; healthy) → none.
- MegaTrace call lines written here (TP2×PP2; rank 2 calls its TP all-reduce ~3 ms after its
  partner in 90 % of calls) → a slowdown naming rank 2 in tp_collectives.
A second import of the same file is refused (exit 2) unless --force.

torch comes from `ingest.torch.provision` (skips with the reason when it cannot be had); the HTA
traces are read where CI keeps them (../shared/data from the repository root, or
$RANKWATCH_TEST_DATA) and skipped with the reason when absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from ingest.torch.provision import pythonpath_with_torch, torch_site
from ingest.units import SECOND as SEC
from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from rankwatch.settings import Settings
from tests.conftest import free_ports

ROOT = Path(__file__).resolve().parents[2]
HTA = Path(os.environ.get("RANKWATCH_TEST_DATA", ROOT.parent / "shared" / "data")) / "hta"
pytestmark = pytest.mark.slow
#: after a job's progress is stored, long enough for two sweeps (AnalystConfig.sweep_s = 10)
QUIET_S = 25.0


@dataclass
class Rig:
    settings: Settings
    env: dict[str, str]
    tmp: Path
    jobs: dict[str, float] = field(default_factory=dict)  # job -> import start (monotonic)

    def sql(self, query: str) -> str:
        for attempt in range(5):
            req = urllib.request.Request(stack.sql_endpoint(self.settings) + "/",
                                         method="POST", data=query.encode())
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return str(r.read().decode())
            except OSError:
                if attempt == 4:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")

    def rankwatch(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rankwatch.cli", *args], env=self.env,
                              cwd=ROOT, capture_output=True, text=True, timeout=300)

    def imported(self, fmt: str, job: str, *paths: Path) -> subprocess.CompletedProcess[str]:
        self.jobs[job] = time.monotonic()
        out = self.rankwatch("import", fmt, *map(str, paths), "--job", job)
        assert out.returncode == 0, out.stderr
        assert "published" in out.stdout and "topology:" in out.stdout, out.stdout
        return out

    def diagnoses(self, job: str) -> list[tuple[str, str, str]]:
        rows = self.sql("SELECT JSONExtractString(json, 'kind'), toString(culprit_ranks), "
                        "JSONExtractString(json, 'stage') FROM diagnoses WHERE job_id = "
                        f"'{job}' ORDER BY detected_ns FORMAT TSV").strip()
        return [tuple(r.split("\t")) for r in rows.splitlines()]  # type: ignore[misc]

    def wait_for(self, job: str, timeout: float = 150) -> list[tuple[str, str, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.diagnoses(job)
            if found:
                return found
            time.sleep(1)
        log = (self.settings.home / "logs" / "worker.log").read_text()[-4000:]
        raise AssertionError(f"no diagnosis for {job} in {timeout} s; worker log: {log}")

    def count(self, table: str, job: str) -> int:
        return int(self.sql(f"SELECT count() FROM {table} WHERE job_id = '{job}'").strip() or 0)

    def wait_stored(self, job: str, timeout: float = 150) -> None:
        """Until the job's records are stored and, if it has calls, its progress computed
        (what puts a job in front of the diagnosis agents)."""
        deadline = time.monotonic() + timeout
        while not (self.count("ops", job) or self.count("kernels", job)) or (
                self.count("ops", job) and not self.count("progress", job)):
            assert time.monotonic() < deadline, f"{job}: records or progress not stored"
            time.sleep(1)

    def wait_quiet(self, *jobs: str) -> dict[str, list[tuple[str, str, str]]]:
        """The jobs' diagnoses once they are stored and two sweeps have passed."""
        for job in jobs:
            self.wait_stored(job)
        time.sleep(QUIET_S)
        return {job: self.diagnoses(job) for job in jobs}


@pytest.fixture(scope="module")
def rig(kafka, settings_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"i{uuid.uuid4().hex[:10]}", kafka_partitions=2)
    stack.up(settings, progress=lambda m: None)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANKWATCH_HOME": str(settings.home),
           "RANKWATCH_KAFKA_BOOTSTRAP": settings.bootstrap,
           "RANKWATCH_TOPIC_PREFIX": settings.topic_prefix}
    try:
        yield Rig(settings, env, tmp_path_factory.mktemp("imports"))
    finally:
        stack.down(settings, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [s.name for s in settings.topics.specs(2)])


@pytest.fixture(scope="module")
def fr_dumps(tmp_path_factory: pytest.TempPathFactory,
             pytestconfig: pytest.Config) -> dict[str, Path]:
    """Flight Recorder dumps of a hung and a healthy 2-rank gloo job, made by real torch."""
    from ingest.torch import provision

    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        site = torch_site()
    if site is None:
        pytest.skip(f"no CPU torch: {provision.last_error}")
    out = {}
    for name, extra in (("hang", ["--hang"]), ("ok", [])):
        d = tmp_path_factory.mktemp(f"fr_{name}")
        env = pythonpath_with_torch({**os.environ, "OMP_NUM_THREADS": "1",
                                     "TORCH_FR_BUFFER_SIZE": "2000"})
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                              "2", "--master-port", str(free_ports(1)[0]),
                              str(ROOT / "tests" / "fixtures" / "fr_job.py"), str(d), *extra],
                             env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        out[name] = d
    return out


@pytest.mark.parametrize("suffix", ["", ".json"], ids=["pickle", "json"])
def test_flight_recorder_hang_dump_is_a_hang_of_rank_1(rig: Rig, fr_dumps: dict[str, Path],
                                                       suffix: str) -> None:
    job = f"fr-hang{suffix.replace('.', '-')}-{uuid.uuid4().hex[:6]}"
    paths = [fr_dumps["hang"] / f"fr_rank_{r}{suffix}" for r in (0, 1)]
    rig.imported("flight-recorder", job, *paths)
    found = rig.wait_for(job)
    assert found[0][:2] == ("hang", "[1]"), found
    again = rig.rankwatch("import", "flight-recorder", *map(str, paths), "--job", job)
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr


@pytest.mark.parametrize("suffix", ["", ".json"], ids=["pickle", "json"])
def test_flight_recorder_healthy_dump_is_not_diagnosed(rig: Rig, fr_dumps: dict[str, Path],
                                                       suffix: str) -> None:
    job = f"fr-ok{suffix.replace('.', '-')}-{uuid.uuid4().hex[:6]}"
    rig.imported("flight-recorder", job, *[fr_dumps["ok"] / f"fr_rank_{r}{suffix}"
                                           for r in (0, 1)])
    assert rig.wait_quiet(job) == {job: []}


HTA_TRACES = ["trace_filter/sampled_rank-0.json.gz trace_filter/sampled_rank-1.json.gz",
              "nccl_parser_config/nccl_data.json.gz",
              "negative_queue_length_values_check/rank0.json.gz",
              "trace_diff/control/control.json.gz", "trace_diff/test/test.json.gz",
              "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"]


def test_hta_traces_are_not_diagnosed(rig: Rig) -> None:
    if not HTA.is_dir():
        pytest.skip(f"HolisticTraceAnalysis traces not found at {HTA}")
    jobs = []
    for i, names in enumerate(HTA_TRACES):
        job = f"hta{i}-{uuid.uuid4().hex[:6]}"
        rig.imported("kineto", job, *[HTA / n for n in names.split()])
        jobs.append(job)
    found = rig.wait_quiet(*jobs)
    assert all(v == [] for v in found.values()), found


def megatrace_logs(d: Path, slow: int, seconds: int = 60) -> list[Path]:
    """TP2×PP2 MegaTrace lines (old format, streams only): per TP group one all-reduce every
    40 ms (stage 1 25 ms after stage 0, as 1F1B shifts it), arrival jitter ~0.2 ms; `slow`
    arrives 3 ms late in 90 % of its calls; a world all-reduce every 100 calls; Send/Recv
    between the stages."""
    rng = np.random.default_rng(11)
    t0 = time.time_ns() - 600 * SEC
    lines: dict[int, list[str]] = {r: [] for r in range(4)}
    for i in range(seconds * 25):
        for r in range(4):
            t = t0 + i * 40_000_000 + (r // 2) * 25_000_000 + int(rng.exponential(200_000))
            if r == slow and rng.random() < 0.9:
                t += 3_000_000
            lines[r].append(f"[save_count {i // 500 + 1}] [{t // SEC}.{t % SEC:09d}] [Rank {r}] "
                            f"Fun AllReduce Data 4194304 stream 0x{r}a opCount {i}")
            tp = t + 5_000_000
            lines[r].append(f"[save_count {i // 500 + 1}] [{tp // SEC}.{tp % SEC:09d}] "
                            f"[Rank {r}] Fun {'Send' if r < 2 else 'Recv'} Data 65536 "
                            f"stream 0x{r}b opCount {i}")
            if i % 100 == 99:
                tw = t0 + i * 40_000_000 + 35_000_000 + int(rng.exponential(200_000))
                lines[r].append(f"[save_count {i // 500 + 1}] [{tw // SEC}.{tw % SEC:09d}] "
                                f"[Rank {r}] Fun AllReduce Data 1 stream 0x{r}c "
                                f"opCount {i // 100}")
    paths = []
    for r, rows in lines.items():
        p = d / f"rank_{r}.log"
        p.write_text("\n".join(rows) + "\n")
        paths.append(p)
    return paths


def test_megatrace_lines_slow_rank_is_named(rig: Rig) -> None:
    job = f"mt-{uuid.uuid4().hex[:6]}"
    out = rig.imported("megatrace", job, *megatrace_logs(rig.tmp, slow=2))
    assert "tp 2 × pp 2 × dp 1" in out.stdout, out.stdout
    found = rig.wait_for(job)
    assert found[-1] == ("slowdown", "[2]", "tp_collectives"), found
