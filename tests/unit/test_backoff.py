"""ingest/backoff.py: the waits between tries of something failing for a while, and the retry
loop built on them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from ingest.backoff import Backoff, retry


def test_waits_double_from_initial_up_to_maximum_and_start_over_after_a_success() -> None:
    b = Backoff(0.2, 10.0)
    assert [b.next() for _ in range(8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]
    b.reset()
    assert b.next() == 0.2
    tick = Backoff(0.25, 2.0)  # the derived runner's per-job schedule
    assert [tick.next() for _ in range(6)] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]


class Flaky:
    """Fails `failures` times with `error`, then returns "done"."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "done"


def run_retry(attempt: Flaky, again: Callable[[Exception, float], bool]
              ) -> tuple[str, list[float]]:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    got = asyncio.run(retry(attempt, Backoff(0.2, 1.0), again, sleep=sleep))
    return got, slept


def test_retry_waits_between_failures_until_the_attempt_succeeds() -> None:
    seen: list[tuple[str, float]] = []

    def again(e: Exception, wait: float) -> bool:
        seen.append((str(e), wait))
        return True

    attempt = Flaky(5, OSError("store out"))
    got, slept = run_retry(attempt, again)
    assert got == "done" and attempt.calls == 6
    assert slept == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert seen == [("store out", w) for w in slept]  # told the wait before each sleep


def test_retry_raises_the_error_when_told_not_to_try_again() -> None:
    attempt = Flaky(5, OSError("store out"))
    with pytest.raises(OSError, match="store out"):
        run_retry(attempt, lambda e, wait: attempt.calls < 3)
    assert attempt.calls == 3


class Permanent(Exception):
    pass


def test_retry_raises_what_the_decision_raises() -> None:
    def again(e: Exception, wait: float) -> bool:
        raise Permanent("refused") from e

    attempt = Flaky(5, ValueError("bad rows"))
    with pytest.raises(Permanent) as info:
        run_retry(attempt, again)
    assert attempt.calls == 1 and isinstance(info.value.__cause__, ValueError)


def test_retry_returns_at_once_without_a_failure() -> None:
    attempt = Flaky(0, OSError())
    assert run_retry(attempt, lambda e, wait: True) == ("done", [])
