"""ingest.agent.exits.ExitWatch: a watched process's end is seen when it happens (its pidfd),
stays known for every ring of that process, and is not taken for a later process's whose ring
was made after it (a reused pid)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ingest.agent.exits import ExitWatch, exit_status
from ingest.records import exit_code, exit_signal

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd here")


def _child(code: int = 0) -> tuple[int, int]:
    """A child that exits with `code` when its pipe is written; (pid, write end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(code)
    os.close(r)
    return pid, w


def test_an_end_is_seen_when_it_happens_and_kept_for_every_ring() -> None:
    x = ExitWatch()
    pid, w = _child()
    made = time.time_ns()
    x.watch(pid)
    assert x.check(0.0) == 0 and x.ended_at(pid, made) is None
    told = time.time_ns()
    os.write(w, b"x")
    assert x.check(10.0) == 1
    seen = time.time_ns()
    os.waitpid(pid, 0)
    end = x.ended_at(pid, made)
    assert end is not None and told <= end <= seen
    assert x.ended_at(pid, made) == end  # the process's other rings see the same end
    assert x.ended_at(pid, end + 1) is None  # a ring made after it: another process's
    x.watch(pid)  # that process, alive: the old end is forgotten
    assert x.ended_at(pid, made) is None
    x.close()


def test_without_processes_check_sleeps_and_a_gone_pid_is_not_watched() -> None:
    x = ExitWatch()
    t0 = time.monotonic()
    assert x.check(0.05) == 0 and time.monotonic() - t0 >= 0.04
    pid, w = _child()
    os.write(w, b"x")
    os.waitpid(pid, 0)
    x.watch(pid)  # reaped already: nothing to open
    assert x.check(0.0) == 0 and x.ended_at(pid) is None


def test_how_a_process_ended_is_read_while_it_is_a_zombie() -> None:
    """Killed by SIGKILL, or exiting with code 3: the watcher reads the kernel's exit status
    at the end it sees, before the parent (this test) reaps the process; a process reaped
    first, a running one, a malformed stat line and a pid never watched give -1."""
    import signal

    x = ExitWatch()
    killed, _ = _child()
    x.watch(killed)
    os.kill(killed, signal.SIGKILL)
    assert x.check(10.0) == 1
    os.waitpid(killed, 0)
    st = x.status_of(killed)
    assert exit_signal(st) == signal.SIGKILL and exit_code(st) == -1
    code, w = _child(3)
    x.watch(code)
    os.write(w, b"x")
    assert x.check(10.0) == 1
    os.waitpid(code, 0)
    assert exit_signal(x.status_of(code)) == 0 and exit_code(x.status_of(code)) == 3
    assert x.status_of(12345678) == -1
    assert exit_status(os.getpid()) == -1  # running: not an exit
    assert exit_status(killed) == -1  # reaped: gone
    x.close()


def test_a_stat_line_is_parsed_after_the_last_parenthesis(tmp_path: Path) -> None:
    """The command name may hold spaces and parentheses; field 52 is the status."""
    rest = ["Z"] + ["0"] * 48 + [str(9)]
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (a (b) c) " + " ".join(rest) + " 0\n")
    assert exit_status(7, str(tmp_path)) == 9
    (tmp_path / "7" / "stat").write_text("7 (x) Z 1 2\n")
    assert exit_status(7, str(tmp_path)) == -1
    assert exit_status(8, str(tmp_path)) == -1


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@pytest.mark.skipif(_kernel() < (6, 15), reason="the kernel keeps no exit status for pidfds")
def test_how_a_process_ended_is_asked_of_its_pidfd_once_it_is_reaped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast launcher reaps a killed rank before the watcher wakes (a loaded host): the
    zombie's /proc entry is gone, and the kernel's account comes from the pidfd held — read
    at the end, or later, when the exit row asks for it."""
    import signal

    import ingest.agent.exits as mod

    x = ExitWatch()
    killed, _ = _child()
    x.watch(killed)
    os.kill(killed, signal.SIGKILL)
    os.waitpid(killed, 0)  # reaped before the watcher looks
    assert exit_status(killed) == -1
    assert x.check(10.0) == 1
    st = x.status_of(killed)
    assert exit_signal(st) == signal.SIGKILL and exit_code(st) == -1
    # seen ended as a zombie whose /proc entry cannot be read (another pid namespace): its
    # pidfd is kept, and the status is there once its parent reaps it
    monkeypatch.setattr(mod, "exit_status", lambda pid: -1)
    code, w = _child(3)
    x.watch(code)
    os.write(w, b"x")
    assert x.check(10.0) == 1
    time.sleep(0.05)
    assert x.status_of(code) == -1  # a zombie still: nothing to read yet
    os.waitpid(code, 0)
    assert exit_signal(x.status_of(code)) == 0 and exit_code(x.status_of(code)) == 3
    x.close()
