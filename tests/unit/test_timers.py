"""streams.timers.every: a task of the app that calls its function on a fixed grid."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from streams.timers import every


class App:
    """What `every` needs of a Faust app: `task`, which the app runs once it starts."""

    def __init__(self) -> None:
        self.tasks: list[Callable[[], Coroutine[Any, Any, None]]] = []

    def task(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> Any:
        self.tasks.append(fn)
        return fn


def test_calls_keep_coming_and_a_slow_call_delays_the_next() -> None:
    app, calls = App(), []
    loop = asyncio.new_event_loop()

    async def fn() -> None:
        calls.append(loop.time())
        if len(calls) == 2:
            await asyncio.sleep(0.15)  # longer than the interval: the next call comes at once

    every(app, 0.1, fn, "test.tick")
    assert [t.__name__ for t in app.tasks] == ["test.tick"]

    async def run() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(app.tasks[0](), 0.73)

    loop.run_until_complete(run())
    loop.close()
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    # no timing precision asserted (a busy CI host wakes late): calls keep coming, never more
    # than the grid allows, and the slow call's gap is at least its own length
    assert 3 <= len(calls) <= 8
    assert gaps[1] >= 0.14


def test_an_exception_ends_the_task_as_a_timers_would() -> None:
    app = App()

    async def fn() -> None:
        raise RuntimeError("boom")

    every(app, 0.01, fn)
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(app.tasks[0]())
    with pytest.raises(ValueError, match="interval_s"):
        every(app, 0, fn)
