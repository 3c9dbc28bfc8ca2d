"""The native C tests (native/, tests/native/): `make -C native test` runs the ring, NCCL plugin
harness and CUPTI parser tests; `make -C native sanitize` runs them again under AddressSanitizer
with UndefinedBehaviorSanitizer and under ThreadSanitizer."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _make(*target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", "-C", str(NATIVE), *target],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def _sanitizers_missing(tmp_path: Path) -> str | None:
    """Why the compiler cannot build sanitized programs, or None when it can."""
    src = tmp_path / "probe.c"
    src.write_text("int main(void) { return 0; }\n")
    for flag in ("-fsanitize=address,undefined", "-fsanitize=thread"):
        probe = subprocess.run(
            [_compiler() or "cc", flag, str(src), "-o", str(tmp_path / "probe")],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode != 0:
            return f"{flag} unsupported by the compiler: {probe.stderr.strip()[:200]}"
        run = subprocess.run([str(tmp_path / "probe")], capture_output=True, check=False)
        if run.returncode != 0:
            return f"{flag} programs do not run here (exit {run.returncode})"
    return None


pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or _compiler() is None, reason="no make or C compiler"
)


def test_native_c_tests_pass() -> None:
    result = _make("test")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for binary in ("test_ring", "test_nccl_plugin"):
        assert f"{binary}: " in result.stdout and "checks passed" in result.stdout
    if "skipped librankwatch_cupti.so" not in result.stdout + result.stderr:
        assert "test_cupti_parse: " in result.stdout


@pytest.mark.slow
def test_native_c_tests_pass_under_sanitizers(tmp_path: Path) -> None:
    missing = _sanitizers_missing(tmp_path)
    if missing:
        pytest.skip(missing)
    result = _make("sanitize")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "ThreadSanitizer" not in out and "AddressSanitizer" not in out, out[-6000:]
    assert "runtime error" not in out, out[-6000:]  # UBSan reports without failing
    assert out.count("test_nccl_plugin: ") == 2
