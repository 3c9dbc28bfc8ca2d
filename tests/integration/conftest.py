"""ClickHouse fixtures for integration tests (the Kafka broker's are in tests/conftest.py).

chdb lets a process open ONE embedded data directory at a time (any number of connections to it;
another directory only after every connection closed). So the session has one engine directory,
`clickhouse_url`, and tests are isolated by database: every `clickhouse_db` is a fresh, uniquely
named database, dropped afterwards. Any test that opens ClickHouse in this process must use
`clickhouse_url`. Set RANKWATCH_TEST_CLICKHOUSE_URL=http://... to run them against a server.

- `clickhouse_url` (session): `chdb:///<tmp>/clickhouse`, or the server URL above.
- `clickhouse_empty_db`: a `Database` on a new database without tables.
- `clickhouse_db`: the same with sql/ migrations applied.
- `sql_endpoint`: the SQL endpoint over `clickhouse_db` on a free loopback port, served from a
  background event loop (so blocking clients, subprocesses included, can call it); gives `.url`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from streams.db import Database, migrate
from streams.sql_endpoint import bound_port, start_sql_endpoint, stop_sql_endpoint


@pytest.fixture(scope="session")
def clickhouse_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return (os.environ.get("RANKWATCH_TEST_CLICKHOUSE_URL")
            or f"chdb://{tmp_path_factory.mktemp('clickhouse')}")


def _fresh(url: str) -> Database:
    return Database(url, f"t_{uuid.uuid4().hex[:12]}")


def _drop(db: Database) -> None:
    try:
        db.command(f"DROP DATABASE IF EXISTS `{db.database}` SYNC")
    finally:
        db.close()


@pytest.fixture
def clickhouse_empty_db(clickhouse_url: str) -> Iterator[Database]:
    db = _fresh(clickhouse_url)
    yield db
    _drop(db)


@pytest.fixture
def clickhouse_db(clickhouse_url: str) -> Iterator[Database]:
    db = _fresh(clickhouse_url)
    migrate(db)
    yield db
    _drop(db)


@dataclass(frozen=True)
class SqlEndpoint:
    url: str  # http://127.0.0.1:<port>/
    port: int
    db: Database


def _serve(db: Database, writable: bool, **kwargs: Any) -> Iterator[SqlEndpoint]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sql-endpoint", daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(
        start_sql_endpoint(db, "127.0.0.1", 0, writable, **kwargs), loop).result(30)
    port = bound_port(runner)
    try:
        yield SqlEndpoint(f"http://127.0.0.1:{port}/", port, db)
    finally:
        asyncio.run_coroutine_threadsafe(stop_sql_endpoint(runner), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def serve_sql(db: Database, writable: bool = False, **kwargs: Any) -> Iterator[SqlEndpoint]:
    """An endpoint over `db` with `start_sql_endpoint`'s keyword arguments (token, limits...)."""
    yield from _serve(db, writable, **kwargs)


@pytest.fixture
def sql_endpoint(clickhouse_db: Database) -> Iterator[SqlEndpoint]:
    """The read-only endpoint over `clickhouse_db`."""
    yield from _serve(clickhouse_db, writable=False)


@pytest.fixture
def writable_sql_endpoint(clickhouse_db: Database) -> Iterator[SqlEndpoint]:
    yield from _serve(clickhouse_db, writable=True)
