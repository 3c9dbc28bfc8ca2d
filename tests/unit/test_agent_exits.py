"""ingest.agent.exits.ExitWatch: a watched process's end is seen when it happens (its pidfd),
stays known for every ring of that process, and is not taken for a later process's whose ring
was made after it (a reused pid)."""

from __future__ import annotations

import os
import time

import pytest

from ingest.agent.exits import ExitWatch

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd here")


def _child() -> tuple[int, int]:
    """A child that exits when its pipe is written; (pid, write end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
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
