"""The worker turns off numpy's transparent-huge-page advice unless the user chose
(rankwatch/commands/worker.no_numpy_hugepages)."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.commands.worker import no_numpy_hugepages


def _advise(on: bool) -> bool:
    return bool(np._core.multiarray._set_madvise_hugepage(on))  # returns the previous value


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
