"""`ensure_topics` and `delete_topics` send a request again when librdkafka lost it in transit
(a bootstrap connection decommissioned mid-request: _DESTROY_BROKER), and fail at once on an
error that says the request itself is wrong. Pure logic: the admin client is a stand-in."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from confluent_kafka import KafkaError, KafkaException

from ingest.topics import TopicSpec
from rankwatch.kafka import BrokerError, admin


def _future(error: int | None) -> Future[None]:
    f: Future[None] = Future()
    if error is None:
        f.set_result(None)
    else:
        f.set_exception(KafkaException(KafkaError(error)))
    return f


class FakeAdmin:
    """A cluster of one broker whose create/delete answers follow a script, one per call."""

    topics: ClassVar[set[str]] = set()
    script: ClassVar[list[int | None]] = []
    calls: ClassVar[int] = 0

    def list_topics(self, timeout: float) -> Any:
        parts = {0: SimpleNamespace()}
        return SimpleNamespace(brokers={1: None}, topics={
            n: SimpleNamespace(error=None, partitions=parts) for n in FakeAdmin.topics})

    def create_topics(self, new: list[Any], request_timeout: float) -> dict[str, Future[None]]:
        FakeAdmin.calls += 1
        err = FakeAdmin.script.pop(0)
        out = {}
        for t in new:
            if err in (None, KafkaError._DESTROY_BROKER):  # a lost answer may still create it
                FakeAdmin.topics.add(t.topic)
            out[t.topic] = _future(err)
        return out

    def delete_topics(self, names: list[str], **_: float) -> dict[str, Future[None]]:
        FakeAdmin.calls += 1
        err = FakeAdmin.script.pop(0)
        return {n: _future(err) for n in names}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakeAdmin]:
    FakeAdmin.topics, FakeAdmin.script, FakeAdmin.calls = set(), [], 0
    monkeypatch.setattr(admin, "_admin", lambda bootstrap: FakeAdmin())
    monkeypatch.setattr(time, "sleep", lambda s: None)
    return FakeAdmin


SPECS = [TopicSpec("rw.a", 3), TopicSpec("rw.b", 3)]


def test_a_lost_create_is_sent_again_and_the_topics_exist(fake: type[FakeAdmin]) -> None:
    fake.script = [KafkaError._DESTROY_BROKER]
    admin.ensure_topics("x:1", SPECS)
    assert fake.calls == 1  # the lost attempt created them: the second pass finds them
    assert fake.topics == {"rw.a", "rw.b"}


def test_a_transport_failure_is_retried_until_it_succeeds(fake: type[FakeAdmin]) -> None:
    fake.script = [KafkaError._TRANSPORT, KafkaError._TRANSPORT, None]
    assert sorted(admin.ensure_topics("x:1", SPECS)) == ["rw.a", "rw.b"]
    assert fake.calls == 3


def test_a_wrong_request_fails_at_once(fake: type[FakeAdmin]) -> None:
    fake.script = [KafkaError.INVALID_REPLICATION_FACTOR]
    with pytest.raises(BrokerError, match=r"rw\.a"):
        admin.ensure_topics("x:1", SPECS)
    assert fake.calls == 1


def test_delete_retries_a_lost_request(fake: type[FakeAdmin]) -> None:
    fake.script = [KafkaError._DESTROY_BROKER, KafkaError.UNKNOWN_TOPIC_OR_PART]
    assert admin.delete_topics("x:1", ["rw.a"]) == []
    assert fake.calls == 2
