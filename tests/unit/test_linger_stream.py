"""streams.batching.LingerStream against Faust's own stream, in an agent's test context (an
in-memory channel, Faust's real stream machinery): same batches, acknowledged after the body,
and no wake-ups while nothing comes."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import faust
import pytest

from streams.batching import LingerStream


class Counting(LingerStream):
    waits = 0

    async def wait_for_stopped(self, *coros: Any, timeout: Any = None) -> bool:
        type(self).waits += 1
        return bool(await super().wait_for_stopped(*coros, timeout=timeout))


class CountingFaust(faust.Stream[Any]):
    waits = 0

    async def wait_for_stopped(self, *coros: Any, timeout: Any = None) -> bool:
        type(self).waits += 1
        return bool(await super().wait_for_stopped(*coros, timeout=timeout))


def run(stream_cls: type, max_: int, within: float, script: Any) -> list[list[Any]]:
    """Run an agent taking events with `stream_cls`; `script(agent)` feeds it. Returns the
    batches' values; asserts, inside the body, that the batch's events are not acked yet and,
    after it, that they are."""
    got: list[list[Any]] = []
    unacked_in_body: list[bool] = []
    acked_after: list[bool] = []

    async def main() -> None:
        app = faust.App("rankwatch-test-linger", broker="kafka://127.0.0.1:9",
                        autodiscover=False, Stream=stream_cls)
        previous: list[Any] = []

        @app.agent()
        async def take(stream: Any) -> None:
            nonlocal previous
            async for events in stream.take_events(max_, within):
                acked_after.extend(e.message.acked for e in previous)
                unacked_in_body.extend(not e.message.acked for e in events)
                got.append([e.value for e in events])
                previous = list(events)

        async with take.test_context() as agent:
            await script(agent)
            await asyncio.sleep(within * 2 + 0.05)
        acked_after.extend(e.message.acked for e in previous)

    asyncio.run(main())
    assert all(unacked_in_body) and all(acked_after)
    return got


async def feed(agent: Any) -> None:
    for i in range(7):
        await agent.put(i)
    await asyncio.sleep(0.3)
    await agent.put(99)


@pytest.mark.parametrize("cls", [LingerStream, faust.Stream])
def test_batches_are_faust_s(cls: type) -> None:
    """A full buffer is yielded at once, the rest at the next tick; nothing lost or repeated,
    in order — the same for Faust's stream (the reference)."""
    assert run(cls, 3, 0.1, feed) == [[0, 1, 2], [3, 4, 5], [6], [99]]


def test_an_idle_stream_does_not_wake() -> None:
    """Over 1 s without events Faust's stream waits ~20 times at 50 ms; the linger stream
    once (for the first event)."""
    async def idle(agent: Any) -> None:
        await asyncio.sleep(1.0)
        await agent.put("x")

    Counting.waits = CountingFaust.waits = 0
    assert run(Counting, 16, 0.05, idle) == [["x"]]
    assert run(CountingFaust, 16, 0.05, idle) == [["x"]]
    assert CountingFaust.waits >= 10  # ~20 on a quiet machine
    assert Counting.waits <= 4


@pytest.mark.parametrize("max_, within", [(0, 0.1), (4, 0.0), (4, float("nan"))])
def test_bad_arguments_are_refused_at_the_call(max_: int, within: float) -> None:
    app = faust.App("rankwatch-test-linger", broker="kafka://127.0.0.1:9", autodiscover=False,
                    Stream=LingerStream)
    stream = cast(LingerStream, app.stream(app.channel()))
    with pytest.raises(ValueError, match="max_ >= 1 and within > 0"):
        stream.take_events(max_, within)
