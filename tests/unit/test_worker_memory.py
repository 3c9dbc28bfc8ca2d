"""The worker's memory knobs (rankwatch/commands/worker.py): numpy's transparent-huge-page
advice off unless the user chose, and the C allocator's free memory handed back."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from rankwatch.commands.worker import no_numpy_hugepages


def _advise(on: bool) -> bool:
    # numpy's private module is not in its type stubs; returns the previous value
    return bool(np._core.multiarray._set_madvise_hugepage(on))  # type: ignore[attr-defined]


def test_advice_is_turned_off_unless_the_user_set_numpys_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = _advise(True)
    try:
        monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
        assert no_numpy_hugepages()
        assert _advise(True) is False  # it was off
        monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
        assert not no_numpy_hugepages()
        assert _advise(True) is True  # left as the user's choice
    finally:
        _advise(before)


FRAGMENTED = """
import sys
from rankwatch.commands.worker import release_free_memory
def rss():
    lines = open('/proc/self/status').read().splitlines()
    return next(int(x.split()[1]) for x in lines if x.startswith('VmRSS')) // 1024
held = [bytes(2048) for _ in range(150_000)]  # ~300 MB from malloc
last = held[-1]
del held  # all freed but the newest: the heap cannot shrink from its top
before = rss()
ok = release_free_memory()
print(ok, before, rss())
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_free_memory_inside_the_heap_goes_back_to_the_system() -> None:
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True,
                         check=True).stdout.split()
    ok, before, after = out[0] == "True", int(out[1]), int(out[2])
    assert ok and before > 250 and before - after > 200, (before, after)

