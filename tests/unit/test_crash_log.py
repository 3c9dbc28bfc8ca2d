"""The worker's crash paths (streams/app.py) log the exception with its traceback.

When a batch cannot be stored and the worker must stop, the agent exits uncommitted
(EXIT_UNSTORED) so its messages come again; an operator reading the log needs the error that
caused it, not only "stopping with unstored rows". The real agents of a StreamsApp run here
against a store that is out while the worker stops: the exact situation in which they give up.
No broker is contacted: the agent functions are fed a stand-in for Faust's stream.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ingest.batch import RecordBatch, encode_batch, encode_topology
from ingest.records import JobTopology
from ingest.topics import Topics
from streams.app import EXIT_UNSTORED, AppConfig, StreamsApp


class StoreOut:
    """A store that cannot be reached: every write fails with an error worth retrying."""

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]]) -> int:
        raise ConnectionError("clickhouse is out: connection refused (store-out-marker)")

    async def max_offset(self, table: str, partition: int, since: int) -> int:
        return -1

    async def write_topologies(self, topos: Sequence[JobTopology], token: str) -> None:
        raise ConnectionError("clickhouse is out: connection refused (store-out-marker)")

    async def write_dead_letters(self, dead: Sequence[Any]) -> None:
        raise AssertionError("nothing here is a dead letter")


class Stream:
    """What the agents use of Faust's stream: `take_events` yielding one buffer of events."""

    def __init__(self, topic: str, values: list[bytes]) -> None:
        self.events = [SimpleNamespace(message=SimpleNamespace(
            topic=topic, partition=0, offset=i, value=v, timestamp=0.0))
            for i, v in enumerate(values)]

    async def take_events(self, max_: int, within: float) -> AsyncIterator[list[Any]]:
        yield self.events


class Exited(BaseException):
    pass


def ops_batch() -> bytes:
    n = 4
    return encode_batch("ops", "job", {
        "rank": np.arange(n), "comm_id": ["dp"] * n, "op_seq": np.arange(n),
        "op": ["AllReduce"] * n, "bytes": np.full(n, 64), "t_enqueue": np.full(n, 5),
        "t_start": np.full(n, 10), "t_end": np.full(n, 20)})


def jobs_batch() -> bytes:
    return encode_topology(JobTopology(job_id="job", ts=1, world_size=2, dp=2,
                                       hosts=["h0", "h1"]))


@pytest.mark.parametrize(("agent", "topic", "value"), [
    ("rankwatch.ingest.ops", "rw.ops", ops_batch),
    ("rankwatch.ingest.jobs", "rw.jobs", jobs_batch),
])
def test_a_crash_path_logs_the_exception_with_its_traceback(
        agent: str, topic: str, value: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sapp = StreamsApp(AppConfig(app_id="rankwatch-test-crash", bootstrap="127.0.0.1:9",
                                topics=Topics()), StoreOut())  # type: ignore[arg-type]
    exits: list[tuple[int, str]] = []
    sapp.on_exit = lambda code, reason: exits.append((code, reason))

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    sapp.stopping = True  # the worker stops while the store is out: the rows stay unstored
    fun = sapp.app.agents[agent].fun
    caplog.set_level(logging.WARNING, logger="streams.app")

    with pytest.raises(Exited):
        asyncio.run(fun(Stream(topic, [value()])))

    assert [code for code, _ in exits] == [EXIT_UNSTORED]
    assert "ConnectionError" in exits[0][1]
    (crit,) = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert crit.exc_info is not None and crit.exc_info[0] is ConnectionError
    text = caplog.text  # as the log handler formats it: message, then the traceback
    assert "stopping with unstored" in text
    assert "Traceback (most recent call last)" in text
    assert "ConnectionError: clickhouse is out: connection refused (store-out-marker)" in text
