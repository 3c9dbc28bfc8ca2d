"""`LingerStream`: Faust's stream whose `take_events` sleeps while there is nothing to take.

Faust's `Stream.take_events(max_, within)` wakes every `within` seconds whether or not an
event came: a worker runs about a dozen such loops (a raw sink per kind, the diagnosis feeds at
50–100 ms), about a hundred wake-ups a second that together were most of an idle worker's CPU
(~0.017 CPU-s per second, measured with a sampling profiler). Here an empty buffer waits for
its first event with no timeout; from then on the batch is yielded when `max_` events are
buffered or at the next tick of a `within`-second grid (monotonic clock), as Faust's timer
would have yielded it: a record waits in the buffer as long as before (at most `within`, half
of it on average) and batches are as large, while an idle worker wakes only for its timers
and the Kafka client.

Everything else is as Faust's own: the events are acknowledged (so their offsets become
committable) only after the loop body returns, also when it raises; the buffer never holds
more than `max_`; while the body runs, new events wait. The stream's class is set on the app
(`faust.App(..., Stream=LingerStream)`), so agents use it through `stream.take_events`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, cast

import faust
from faust.types import ChannelT, EventT
from mode.utils.locks import Event
from mode.utils.times import Seconds, want_seconds


class LingerStream(faust.Stream[Any]):
    """A Faust stream whose `take_events` lingers from the first buffered event (module
    docstring)."""

    def take_events(self, max_: int,
                    within: Seconds) -> AsyncGenerator[Sequence[EventT[Any]], None]:
        seconds = want_seconds(within)
        if max_ < 1 or not seconds > 0:
            raise ValueError(f"take_events needs max_ >= 1 and within > 0, got {max_}, {within}")
        agen = self._linger(max_, seconds)
        # as Faust's own: the stream closes the generators still open when it stops
        self._active_agens.add(agen)
        return agen

    async def _linger(self, max_: int,
                      within: float) -> AsyncGenerator[Sequence[EventT[Any]], None]:
        events: list[EventT[Any]] = []
        first = Event()  # set while the buffer holds at least one event
        full = Event()  # set while it holds max_
        drained = Event()  # set once a full buffer has been taken
        reading: asyncio.Future[None] | None = None  # pending while the body reads the buffer

        async def add(value: Any) -> Any:
            # run by the stream's background drainer for every value, in order
            nonlocal reading
            if reading is not None:
                await reading
            event = self.current_event
            if event is None:
                raise RuntimeError("a buffered value without its event")
            events.append(event)
            first.set()
            if len(events) >= max_:
                full.set()
                drained.clear()
                await self.wait(drained)
            return value

        acks = self.enable_acks
        self.enable_acks = False  # acknowledged below, once the body has returned
        self.add_processor(add)
        self._enable_passive(cast(ChannelT[Any], self.channel.__aiter__()))
        try:
            while not self.should_stop:
                if not events and await self.wait_for_stopped(first):
                    break
                await self.wait_for_stopped(full, timeout=within - time.monotonic() % within)
                if not events:
                    continue
                reading = self.loop.create_future()
                try:
                    yield list(events)
                finally:
                    taken = list(events)
                    events.clear()
                    first.clear()
                    full.clear()
                    for event in taken:
                        await self.ack(event)
                    done, reading = reading, None
                    if not done.done():
                        done.set_result(None)
                    drained.set()
        finally:
            self.enable_acks = acks
            self._processors.remove(add)
