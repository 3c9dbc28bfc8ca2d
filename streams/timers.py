"""A periodic task on the worker's event loop that costs an idle worker little.

Faust's `app.timer` sleeps through mode's `Service.sleep` (a wait on the service's stop event
with a timeout, a task per wake) and wraps each call in its tracing; `every` is a task of the
app that sleeps with `asyncio.sleep` on a fixed grid. Like a timer it starts and stops with the
app, and an exception out of the function crashes the app (the worker's callers catch their
own). The worker wakes four times a second for the derived runner's and the diagnosis ticks;
what each wake costs an idle worker is in docs/performance.md ("Where an idle worker's CPU
goes").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


def every(app: Any, interval_s: float, fn: Callable[[], Awaitable[None]],
          name: str | None = None) -> None:
    """Run `fn` every `interval_s` seconds as a task of Faust app `app`: on a grid, so a wake
    that comes late does not shift the later ones; a call longer than the interval is followed
    at once by the next, and the grid starts again from there."""
    if interval_s <= 0:
        raise ValueError(f"interval_s={interval_s} must be > 0")

    async def run() -> None:
        due = time.monotonic()
        while True:
            now = time.monotonic()
            due = max(due + interval_s, now)
            await asyncio.sleep(due - now)
            await fn()

    run.__name__ = run.__qualname__ = name or str(getattr(fn, "__qualname__", "every"))
    app.task(run)
