"""When each rank's process ended, to the agent loop's resolution (milliseconds), not its beat's.

A rank found dead gets one last beat row, `exited` 1 (`ingest.agent.agent`). Found at the next
beat, every rank of a job a launcher tore down carries the same time — one beat (a second)
says nothing of which process ended first. With a pidfd per producer (Linux ≥ 5.3,
``os.pidfd_open``) the loop learns of an exit at its next pass, and sleeps on the pidfds
between passes, so it wakes at the exit: the exit row's `ts` is when the process was seen
ended, a few milliseconds after it did. That order is the evidence `hang_rca.process_exit`
names a rank by when no call was in flight (a rank killed while its peers were still
computing, which the launcher then stopped: the one that ended alone, first).

A pidfd is opened only for a producer its ring reports alive (pid and start time checked by
the ring: a reused pid is not watched). Without pidfds (an older kernel, another pid
namespace) nothing is watched and the exit row keeps the beat's time.
"""

from __future__ import annotations

import contextlib
import os
import select
import time

#: how long a seen end is remembered for the rings of its process (a rank has a ring per
#: source — Python tracer, NCCL plugin, CUPTI — all with its pid; each is retired at a beat)
KEEP_S = 60.0


class ExitWatch:
    """The end time of each watched process: `watch(pid)`, `check(timeout_s)` (each pass, and
    as the loop's sleep), `ended_at(pid)`."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._pids: set[int] = set()
        self._ended: dict[int, int] = {}  # pid -> wall clock ns it was seen ended
        self.available = hasattr(os, "pidfd_open")

    def watch(self, pid: int) -> None:
        """Watch `pid` (a producer its ring reports alive, not seen ended since its ring was
        made) unless it already is. An end remembered for that pid is an earlier process's."""
        if pid <= 0 or pid in self._pids or not self.available:
            return
        self._ended.pop(pid, None)
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already, or not ours to see (another pid namespace)
            return
        self._fds[fd] = pid
        self._pids.add(pid)
        self._poll.register(fd, select.POLLIN)

    def check(self, timeout_s: float = 0.0) -> int:
        """Record the processes that ended, waiting up to `timeout_s` for one (a plain sleep
        when none is watched); how many ended."""
        if not self._fds:
            if timeout_s > 0:
                time.sleep(timeout_s)
            return 0
        ready = self._poll.poll(max(int(timeout_s * 1000), 0))
        if not ready:
            return 0
        now = time.time_ns()
        old = now - int(KEEP_S * 1e9)
        for gone in [p for p, t in self._ended.items() if t < old]:
            del self._ended[gone]
        for fd, _ in ready:
            pid = self._fds.pop(fd, None)
            self._poll.unregister(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
            if pid is not None:
                self._pids.discard(pid)
                self._ended[pid] = now
        return len(ready)

    def ended_at(self, pid: int, made_ns: int = 0) -> int | None:
        """When `pid` was seen ended (wall clock ns), for every ring of that process (made at
        `made_ns` or before: a ring made later is a new process's with the pid reused), until
        `KEEP_S` later; None if it was not watched."""
        end = self._ended.get(pid)
        return end if end is not None and end >= made_ns else None

    def close(self) -> None:
        for fd in list(self._fds):
            self._poll.unregister(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._pids.clear()
