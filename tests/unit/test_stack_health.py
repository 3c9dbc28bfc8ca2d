"""The local stack's health bookkeeping: crash loops from the worker's unclean exits, masked
secrets, ports below the ephemeral range."""

from __future__ import annotations

import time
from pathlib import Path

from rankwatch import stack
from rankwatch.settings import Settings


def test_three_unclean_exits_in_ten_minutes_are_a_crash_loop(tmp_path: Path) -> None:
    s = Settings.load(env={}, home=tmp_path)
    assert stack.crash_loop(s) == ""
    stack.record_exit(s, 75, "ops: ClickHouseError: Code: 62. boom")
    stack.record_exit(s, 75, "ops: ClickHouseError: Code: 62. boom")
    assert stack.crash_loop(s) == ""
    stack.record_exit(s, 75, "jobs: ClickHouseError:\n Code: 62. last")
    loop = stack.crash_loop(s)
    assert loop.startswith("crash loop: 3 unclean exits") and "(exit 75): jobs:" in loop
    assert "Code: 62. last" in loop
    assert stack.crash_loop(s, now=time.time() + 601) == ""  # old exits no longer count


def test_status_and_messages_mask_the_clickhouse_password() -> None:
    assert stack.display_url("http://rw:hunter2@ch.example:8123") == "http://rw:***@ch.example:8123"
    assert stack.display_url("https://ch.example") == "https://ch.example"
    assert stack.display_url("chdb:///var/lib/rw") == "chdb:///var/lib/rw"


def test_the_sql_token_is_secret_but_reaches_the_worker(tmp_path: Path) -> None:
    s = Settings.load(env={}, home=tmp_path, sql_token="t0ken")
    assert "t0ken" not in repr(s) and "t0ken" not in str(s.model_dump(mode="json"))
    assert stack.settings_env(s)["RANKWATCH_SQL_TOKEN"] == "t0ken"
    child = Settings.load(env=stack.settings_env(s))
    assert child.sql_token.get_secret_value() == "t0ken"


def test_free_ports_are_below_the_ephemeral_range() -> None:
    ports = {stack.free_port() for _ in range(50)}
    assert all(20000 <= p < 32000 for p in ports)
