"""The real monitoring services and recording receivers the tests use (bench/services.py);
a missing Debian package fails the test with what to install."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench import services
from bench.services import Alertmanager, Receiver, Seen

__all__ = ["Alertmanager", "Receiver", "Seen", "alertmanager", "prometheus"]


@contextmanager
def alertmanager(tmp: Path) -> Iterator[Alertmanager]:
    try:
        cm = services.alertmanager(tmp)
        am = cm.__enter__()
    except services.MissingService as e:
        pytest.fail(str(e))
    try:
        yield am
    finally:
        cm.__exit__(None, None, None)


@contextmanager
def prometheus(tmp: Path, targets: list[str], interval_s: float = 1.0,
               rules: Path | None = None) -> Iterator[str]:
    try:
        cm = services.prometheus(tmp, targets, interval_s, rules)
        url = cm.__enter__()
    except services.MissingService as e:
        pytest.fail(str(e))
    try:
        yield url
    finally:
        cm.__exit__(None, None, None)
