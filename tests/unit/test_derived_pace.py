"""Previews are for live jobs (streams/derived.py `_replaying`): a job whose event time runs far
ahead of the wall clock — a backlog, a replay — gets none, a live one does."""

from __future__ import annotations

from typing import cast

from ingest.units import SECOND as SEC
from streams.db import Database
from streams.derived import DerivedConfig, DerivedRunner


def runner_at(clock: list[int]) -> DerivedRunner:
    return DerivedRunner(cast(Database, None), _nothing, DerivedConfig(),
                         clock=lambda: clock[0])


async def _nothing(kind: str, job: str, data: bytes) -> None:
    return None


def paces(event_per_wall: float, ticks: int = 40, tick_ns: int = SEC // 4) -> list[bool]:
    """`_replaying` at every tick of a job whose records advance `event_per_wall` event-ns per
    wall-ns."""
    clock = [1_000 * SEC]
    r = runner_at(clock)
    got = []
    for i in range(ticks):
        clock[0] += tick_ns
        event = 2_000 * SEC + int(i * tick_ns * event_per_wall)
        r.windows.observe("j", event - SEC // 10, event, source="h", kind="ops")
        got.append(r._replaying("j"))
    return got


def test_a_live_job_is_previewed_and_a_replay_is_not() -> None:
    span_ticks = DerivedConfig().pace_span_ns // (SEC // 4)
    live = paces(1.0)
    assert not any(live)
    fast = paces(5.0)
    assert not any(fast[:span_ticks // 2 - 1])  # too little history yet: treated as live
    assert all(fast[span_ticks:])
    assert not any(paces(1.8))  # under the threshold (2x)
    # the pace is measured over the recent span: a replay that caught up is live again
    clock = [1_000 * SEC]
    r = runner_at(clock)
    event = 2_000 * SEC
    seen = []
    for i in range(80):
        clock[0] += SEC // 4
        event += (5 if i < 30 else 1) * SEC // 4
        r.windows.observe("j", event - SEC // 10, event, source="h", kind="ops")
        seen.append(r._replaying("j"))
    assert seen[25] and not any(seen[60:])
    assert len(r._pace["j"]) <= span_ticks + 2  # bounded by the span, not the run length
