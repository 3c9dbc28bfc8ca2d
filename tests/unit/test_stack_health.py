"""The local stack's health bookkeeping: crash loops from the worker's unclean exits, masked
secrets, ports below the ephemeral range."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from rankwatch import http, stack
from rankwatch.commands.worker import execute
from rankwatch.settings import Settings
from streams.sql_endpoint import bound_port, start_sql_endpoint, stop_sql_endpoint

ROOT = Path(__file__).resolve().parents[2]


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


#: A mode worker (what faust.Worker is) whose service crashes in a timer, run by the worker
#: command's `execute`: mode ends it with exit code 1, as it ended the worker whose metrics
#: timer raised on a full disk (#16).
CRASHING_WORKER = """
import sys
import mode
from rankwatch.commands.worker import execute
from rankwatch.settings import Settings

class Crashing(mode.Service):
    @mode.Service.timer(0.05)
    async def _tick(self) -> None:
        raise RuntimeError("boom in a timer")

worker = mode.Worker(Crashing(), loglevel="warning", quiet=True, override_logging=False)
sys.exit(execute(worker, Settings.load(env={}, home=sys.argv[1])))
"""


def test_a_worker_that_crashed_counts_towards_a_crash_loop(tmp_path: Path) -> None:
    """Not only the agents' uncommitted exits (75): a worker mode stopped after a crash is an
    unclean exit too, with the crash's exception as its reason; a clean stop is none."""
    s = Settings.load(env={}, home=tmp_path)

    class Stopped:
        crash_reason = None

        def execute_from_commandline(self) -> None:
            raise SystemExit(0)

    assert execute(Stopped(), s) == 0
    assert not stack.exits_file(s).exists()
    stack.record_exit(s, 75, "ops: first")
    stack.record_exit(s, 75, "ops: second")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CRASHING_WORKER, str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    loop = stack.crash_loop(s)
    assert loop.startswith("crash loop: 3 unclean exits"), loop
    assert "(exit 1): the worker stopped with exit code 1: RuntimeError: boom in a timer" in loop


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


def test_status_lines_keep_their_columns_with_several_workers() -> None:
    """`rankwatch status` with `up --workers 3`: the names of the other workers are longer
    than the name column was ("worker-2up"); every line's state starts in one column."""
    from rankwatch.commands.stack import format_status

    def part(pid: int, log: str = "", **more: object) -> dict[str, object]:
        return {"healthy": True, "running": True, "pid": pid, "log": log, "detail": "",
                **more}

    st = {"kafka": part(1, "k.log", bootstrap="127.0.0.1:9092", managed=True),
          "worker": part(2, "w.log", sql_endpoint="http://127.0.0.1:8124"),
          "store": part(3, "s.log"),
          "workers": [part(2), part(4, "w2.log", name="worker-2"),
                      part(5, "w3.log", name="worker-12")],
          "clickhouse": {"url": "chdb:///x", "database": "rankwatch"}}
    lines = format_status(st).splitlines()
    names = [ln.split()[0] for ln in lines]
    assert names == ["kafka", "worker", "store", "worker-2", "worker-12", "storage"]
    states = {ln.index(" up ") + 1 for ln in lines[:-1]}  # where each line's state starts
    assert len(states) == 1, lines
    assert lines[-1].index("chdb://") in states  # the storage line's URL in the same column


class NoQueries:
    """What /ping reads of the database: the queries in flight (none)."""

    def __init__(self) -> None:
        self.sql_inflight: dict[int, tuple[float, str]] = {}


def test_ping_names_a_crash_loop_but_a_recovered_worker_still_passes(tmp_path: Path) -> None:
    s = Settings.load(env={}, home=tmp_path)
    for _ in range(3):
        stack.record_exit(s, 75, "jobs: ClickHouseError: Code: 62. boom")
    problems: list[str] = []

    async def run() -> list[tuple[str, str]]:
        runner = await start_sql_endpoint(NoQueries(), port=0,  # type: ignore[arg-type]
                                          health=lambda: problems,
                                          notes=lambda: stack.ping_notes(s))
        at = s.model_copy(update={"sql_port": bound_port(runner)})
        got = []
        try:
            for bad in ([], ["ingest of ops stalled"]):
                problems[:] = bad
                why = await asyncio.to_thread(stack.ping_worker, at)
                body = b"" if bad else (await asyncio.to_thread(
                    http.get, f"{stack.sql_endpoint(at)}/ping", timeout=5)).body
                got.append((why, body.decode()))
        finally:
            await stop_sql_endpoint(runner)
        return got

    (healthy, body), (unhealthy, _) = asyncio.run(run())
    assert healthy == ""  # `rankwatch up` takes the recovered worker
    first, note = body.splitlines()
    assert first == "Ok." and note.startswith("note: crash loop: 3 unclean exits")
    assert "Code: 62. boom" in note
    assert unhealthy.startswith("rankwatch worker unhealthy: ingest of ops stalled")
    assert "note: crash loop" in unhealthy
