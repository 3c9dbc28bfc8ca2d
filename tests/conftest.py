"""Fixtures shared by every test directory.

- `settings_factory(**overrides)`: a fresh `Settings` with its own temporary home and free ports,
  ignoring the caller's ``RANKWATCH_*`` environment (except ``RANKWATCH_CACHE_DIR``, so a CI can
  point at a jar cache).
- `kafka` (session): ONE real Kafka broker for the whole session, started by the code path
  `rankwatch up` uses (`ensure_jars` + `Broker.start`) and stopped at the end. Gives
  ``.settings``, ``.bootstrap`` and ``.broker``.
- `topics` (per test): a `Topics` set with a unique prefix, created before the test and deleted
  after it, so tests never see each other's records.

Tests under tests/integration and tests/e2e are marked `integration` / `e2e` automatically
(``-m "not integration and not e2e"`` runs the unit tests alone). A test under tests/unit that
asks for a service fixture is a usage error: unit tests never start services.
"""

from __future__ import annotations

import os
import random
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ingest.topics import Topics
from rankwatch.kafka.admin import delete_topics, ensure_topics
from rankwatch.kafka.broker import Broker
from rankwatch.kafka.jars import ensure_jars
from rankwatch.settings import KAFKA_NODE_PORT_STRIDE, Settings

#: Fixtures that start or need a real service; tests/unit may not use them.
SERVICE_FIXTURES = frozenset({"kafka", "topics"})
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.path)).relative_to(_TESTS).parts
        where = parts[0] if len(parts) > 1 else ""
        if where in ("integration", "e2e"):
            item.add_marker(getattr(pytest.mark, where))
        elif where == "unit":
            used = SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            if used:
                raise pytest.UsageError(
                    f"{item.nodeid} uses {sorted(used)}: unit tests run without services; "
                    "move it under tests/integration")


def free_ports(n: int, shifts: Sequence[int] = (0,)) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 now, all held while choosing; with `shifts`,
    each port + every shift is free too (a local Kafka cluster's node `i` listens on the
    configured ports + stride·(i-1)).

    Drawn at random below Linux's ephemeral range (32768+), so no client connection and no other
    test's bind-to-0 takes them between here and the service binding them.
    """
    rng = random.SystemRandom()
    ports: list[int] = []
    with ExitStack() as stack:
        while len(ports) < n:
            port = rng.randrange(20000, 32000 - max(shifts))
            for p in (port + d for d in shifts):
                s = stack.enter_context(socket.socket())
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    break
            else:
                ports.append(port)
    return ports


SettingsFactory = Callable[..., Settings]


@pytest.fixture(scope="session")
def settings_factory(tmp_path_factory: pytest.TempPathFactory) -> SettingsFactory:
    """``settings_factory(**overrides) -> Settings`` with a new temporary home and free ports."""

    def make(**overrides: Any) -> Settings:
        nodes = int(overrides.get("kafka_brokers", 1))
        kafka_port, controller_port, sql_port = free_ports(
            3, [KAFKA_NODE_PORT_STRIDE * i for i in range(nodes)])
        values: dict[str, Any] = {
            "home": tmp_path_factory.mktemp("home"),
            "kafka_port": kafka_port,
            "kafka_controller_port": controller_port,
            "sql_port": sql_port,
        }
        if os.environ.get("RANKWATCH_CACHE_DIR"):
            values["cache_dir"] = os.environ["RANKWATCH_CACHE_DIR"]
        values.update(overrides)
        return Settings.load(env={}, **values)

    return make


@dataclass(frozen=True)
class KafkaService:
    """The session's broker: its settings (home, ports), where to connect, and its handle."""

    settings: Settings
    bootstrap: str
    broker: Broker


@pytest.fixture(scope="session")
def kafka(settings_factory: SettingsFactory) -> Iterator[KafkaService]:
    """One real broker for the session (a few seconds to start; jars fetched on first use)."""
    settings = settings_factory()
    broker = Broker(settings, ensure_jars(settings))
    try:
        broker.start(timeout=90)
        yield KafkaService(settings, broker.bootstrap, broker)
    finally:
        broker.stop()


@pytest.fixture
def topics(kafka: KafkaService) -> Iterator[Topics]:
    """Every rankwatch topic under a prefix unique to this test, created now, deleted after."""
    t = Topics.with_prefix(f"t{uuid.uuid4().hex[:12]}")
    specs = t.specs(kafka.settings.kafka_partitions)
    ensure_topics(kafka.bootstrap, specs)
    yield t
    delete_topics(kafka.bootstrap, [s.name for s in specs])
