"""Retrying what fails for a while (a store or a broker that is out): the waits between tries
start at `initial`, double after each further failure and stay at `maximum`, so a short outage
is retried quickly and a long one is not retried in a busy loop.

`Backoff` is the schedule (for a caller that decides when to try again itself, e.g. once per
timer tick); `retry` is the loop (try, decide, wait, try again) for a coroutine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass
class Backoff:
    """Waits (s) after consecutive failures: `initial`, then twice the last, at most `maximum`."""

    initial: float
    maximum: float
    #: the wait given after the last failure; 0 when none failed since `reset`
    wait: float = 0.0

    def next(self) -> float:
        """The wait before the next try, after one more failure."""
        self.wait = min(self.maximum, max(self.initial, 2 * self.wait))
        return self.wait

    def reset(self) -> None:
        """After a success: the next failure waits `initial` again."""
        self.wait = 0.0


async def retry(attempt: Callable[[], Awaitable[T]], backoff: Backoff,
                again: Callable[[Exception, float], bool], *,
                sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> T:
    """What `attempt()` returns once it succeeds. After each failure `again(error, wait)` decides
    (and logs): true sleeps `wait` s (`backoff.next()`) and tries again, false raises the error.
    `again` may also raise an error of its own (e.g. one saying the failure is permanent)."""
    while True:
        try:
            return await attempt()
        except Exception as e:
            wait = backoff.next()
            if not again(e, wait):
                raise
        await sleep(wait)
