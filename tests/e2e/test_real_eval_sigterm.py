"""`rankwatch eval --real` stopped by SIGTERM (a CI timeout, a scheduler) mid-case: it exits
with 128+15 and leaves nothing running — not the training job, not its agent, not the CPU
hogs beside it, not the private broker and worker it started. Every such process names the
eval's work directory on its command line or is a hog whose parent was the eval."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.real.catalog import HOG

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def cmdlines() -> dict[int, str]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    return out


def ours(workdir: Path) -> list[tuple[int, str]]:
    return [(p, c) for p, c in cmdlines().items()
            if str(workdir) in c or HOG in c]


@pytest.fixture(scope="module", autouse=True)
def torch_ready(pytestconfig: pytest.Config) -> None:
    from ingest.torch import provision

    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        site = provision.torch_site()
    if site is None:
        pytest.skip(f"no CPU torch: {provision.last_error}")


# the signal lands as the first rank starts ("-u -m ingest.torch.run": torchrun spawns a session
# per rank and, stopped mid-spawn, forgets those already started), or mid-case (2 s on)
@pytest.mark.parametrize(("sign", "after_s"), [("-u -m ingest.torch.run", 0.0),
                                               ("bench.real.workload", 2.0)])
def test_sigterm_mid_case_stops_every_process_it_started(tmp_path: Path, sign: str,
                                                         after_s: float) -> None:
    workdir = tmp_path / "run"
    before = {p for p, _ in ours(workdir)}  # hogs of an unrelated run are not ours
    eval_ = subprocess.Popen(
        [sys.executable, "-m", "rankwatch.cli", "eval", "--real", "--cases",
         "ctl-pp4-contended", "--workdir", str(workdir), "--out", str(tmp_path / "r.json")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and eval_.poll() is None:
            running = [c for p, c in ours(workdir) if p not in before]
            # the training job (torchrun names its truth dir) and the hogs beside it are up
            if any(sign in c for c in running) and \
                    any(HOG in c for c in running):
                break
            time.sleep(0.05)
        assert eval_.poll() is None, eval_.stderr.read().decode()[-3000:] if eval_.stderr else ""
        assert time.monotonic() < deadline, "the case never got under way"
        time.sleep(after_s)
        eval_.send_signal(signal.SIGTERM)
        code = eval_.wait(120)
        err = eval_.stderr.read().decode() if eval_.stderr else ""
        assert code == 128 + signal.SIGTERM, err[-3000:]
        deadline = time.monotonic() + 10  # the hogs notice their parent's end within a spin
        left = [(p, c) for p, c in ours(workdir) if p not in before]
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = [(p, c) for p, c in ours(workdir) if p not in before]
        assert not left, f"still running after the eval ended: {left}"
    finally:
        if eval_.poll() is None:
            os.killpg(eval_.pid, signal.SIGKILL)
            eval_.wait()
        for p, _ in ours(workdir):
            if p not in before:
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
