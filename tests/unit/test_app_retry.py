"""The streams app's retries while the store or the broker is out (streams/app.py over
ingest.backoff): a dead letter is published again until the broker takes it, a topology insert
is stored again until the store takes it or refuses its rows, and neither is retried once the
worker stops. The app is built, never started: nothing connects to its broker address."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from ingest.batch import BatchError
from ingest.topics import Topics
from streams.app import AppConfig, StreamsApp, _Refused
from streams.raw_sink import DeadLetter
from streams.store import ClickHouseStore


class Outage:
    """Fails the first `failures` calls with ConnectionError."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def fail(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("out")


class Topic(Outage):
    """A dead-letter topic whose broker is out for the first sends."""

    def __init__(self, failures: int) -> None:
        super().__init__(failures)
        self.sent: list[tuple[bytes, bytes]] = []

    async def send(self, key: bytes, value: bytes) -> asyncio.Future[None]:
        self.fail()
        self.sent.append((key, value))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class Store:
    def __init__(self) -> None:
        self.dead: list[DeadLetter] = []

    async def write_dead_letters(self, dead: list[DeadLetter]) -> None:
        self.dead.extend(dead)


@pytest.fixture
def sapp(monkeypatch: pytest.MonkeyPatch) -> StreamsApp:
    monkeypatch.setattr("streams.app.RETRY_S", (0.001, 0.004))
    cfg = AppConfig("rankwatch-test-retry", "127.0.0.1:9", Topics())
    return StreamsApp(cfg, cast(ClickHouseStore, Store()))


def letter() -> DeadLetter:
    return DeadLetter("rw.ops", 3, 7, BatchError("bad"), b"x")


def test_a_dead_letter_is_published_again_until_the_broker_takes_it(sapp: StreamsApp) -> None:
    topic = Topic(3)
    sapp.dlq_topic = cast(Any, topic)
    asyncio.run(sapp._dead_letters([letter()]))
    assert topic.calls == 4 and [k for k, _ in topic.sent] == [b"rw.ops:3"]
    assert sapp.dead_lettered == 1 and len(cast(Store, sapp.store).dead) == 1


def test_a_stopping_worker_does_not_retry_a_dead_letter(sapp: StreamsApp) -> None:
    topic = Topic(3)
    sapp.dlq_topic = cast(Any, topic)
    sapp.stopping = True
    with pytest.raises(ConnectionError):
        asyncio.run(sapp._dead_letters([letter()]))
    assert topic.calls == 1 and sapp.dead_lettered == 0


def test_a_topology_insert_is_retried_while_the_store_is_out(sapp: StreamsApp) -> None:
    out = Outage(2)

    async def write() -> None:
        out.fail()

    asyncio.run(sapp._retrying(write))
    assert out.calls == 3
    sapp.stopping = True
    out = Outage(2)
    with pytest.raises(ConnectionError):
        asyncio.run(sapp._retrying(write))
    assert out.calls == 1


def test_a_topology_the_store_refuses_is_not_retried(sapp: StreamsApp) -> None:
    calls = []

    async def write() -> None:
        calls.append(1)
        raise ValueError("a column the writer cannot encode")

    with pytest.raises(_Refused) as info:
        asyncio.run(sapp._retrying(write))
    assert len(calls) == 1 and isinstance(info.value.error, ValueError)


def test_the_kinds_a_diagnosis_waits_on_are_written_sooner() -> None:
    """Ops, stages, beats and topologies wait `latency_within_s` for a batch, the bulk kinds
    `within_s`; a latency wait longer than `within_s` does not lengthen theirs."""
    from ingest.records import KINDS
    from streams.app import LATENCY_KINDS

    assert LATENCY_KINDS.issubset(KINDS)
    cfg = AppConfig("rankwatch-test-within", "127.0.0.1:9", Topics(), within_s=0.5,
                    latency_within_s=0.1)
    assert {k: cfg.within(k) for k in ("ops", "stages", "beats", "jobs", "kernels", "flows")} \
        == {"ops": 0.1, "stages": 0.1, "beats": 0.1, "jobs": 0.1, "kernels": 0.5, "flows": 0.5}
    slow = AppConfig("rankwatch-test-within", "127.0.0.1:9", Topics(), within_s=0.2,
                     latency_within_s=1.0)
    assert slow.within("stages") == 0.2
