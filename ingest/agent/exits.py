"""When each rank's process ended, to the agent loop's resolution (milliseconds), not its beat's.

A rank found dead gets one last beat row, `exited` 1 (`ingest.agent.agent`). Found at the next
beat, every rank of a job a launcher tore down carries the same time — one beat (a second)
says nothing of which process ended first. With a pidfd per producer (Linux ≥ 5.3,
``os.pidfd_open``) the loop learns of an exit at its next pass, and sleeps on the pidfds
between passes, so it wakes at the exit: the exit row's `ts` is when the process was seen
ended, a few milliseconds after it did. That order is the evidence `hang_rca.process_exit`
names a rank by when no call was in flight (a rank killed while its peers were still
computing, which the launcher then stopped: the one that ended alone, first).

How it ended comes from the kernel too: woken by the pidfd, the loop reads the process's exit
status from `/proc/<pid>/stat` (field 52, in waitpid's form) while it is a zombie. A fast
launcher reaps its ranks within milliseconds (torchrun `--monitor-interval 0.01`), often before
the loop wakes on a loaded host; once reaped, the status is asked of the pidfd itself
(`PIDFD_GET_INFO` with `PIDFD_INFO_EXIT`, Linux ≥ 6.15: the kernel keeps the exit status of a
reaped process for the holders of its pidfds), so the pidfd of an end whose status was not
read yet is kept until it is (or `KEEP_S`). On an older kernel a status read after the reap
is -1, as before. A rank killed by a signal its launcher does not stop
ranks with (SIGKILL from the OOM killer or an operator, SIGSEGV, SIGABRT) or that exited with an
error, while the others were stopped, is the one that went down (`hang_rca.ended_alone`).

A pidfd is opened only for a producer its ring reports alive (pid and start time checked by
the ring: a reused pid is not watched). Without pidfds (an older kernel, another pid
namespace) nothing is watched and the exit row keeps the beat's time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import struct
import time

#: how long a seen end is remembered for the rings of its process (a rank has a ring per
#: source — Python tracer, NCCL plugin, CUPTI — all with its pid; each is retired at a beat)
KEEP_S = 60.0

#: linux/pidfd.h: `struct pidfd_info` as of its first version (64 bytes; `mask` at 0, `exit_code`
#: at 60), `PIDFD_GET_INFO` = _IOWR(0xFF, 11, struct pidfd_info), `PIDFD_INFO_EXIT` its mask bit
PIDFD_INFO_SIZE = 64
PIDFD_GET_INFO = (3 << 30) | (PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
PIDFD_INFO_EXIT = 1 << 3


class ExitWatch:
    """The end time of each watched process: `watch(pid)`, `check(timeout_s)` (each pass, and
    as the loop's sleep), `ended_at(pid)`."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._pids: set[int] = set()
        self._ended: dict[int, int] = {}  # pid -> wall clock ns it was seen ended
        self._status: dict[int, int] = {}  # pid -> its exit status (waitpid form), if read
        self._unread: dict[int, int] = {}  # pid -> its pidfd, kept until its status is read
        self.available = hasattr(os, "pidfd_open")

    def watch(self, pid: int) -> None:
        """Watch `pid` (a producer its ring reports alive, not seen ended since its ring was
        made) unless it already is. An end remembered for that pid is an earlier process's."""
        if pid <= 0 or pid in self._pids or not self.available:
            return
        self._forget(pid)
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
            self._forget(gone)
        for fd, _ in ready:
            pid = self._fds.pop(fd, None)
            self._poll.unregister(fd)
            status = -1 if pid is None else exit_status(pid)
            if status < 0 and pid is not None:
                status = reaped_status(fd)
            if status < 0 and pid is not None:  # neither a zombie here nor reaped yet
                self._unread[pid] = fd
            else:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if pid is not None:
                self._pids.discard(pid)
                self._ended[pid] = now
                self._status[pid] = status
        return len(ready)

    def _forget(self, pid: int) -> None:
        """Drop what is kept of `pid`'s end (its pidfd, if its status was never read)."""
        self._ended.pop(pid, None)
        self._status.pop(pid, None)
        fd = self._unread.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def ended_at(self, pid: int, made_ns: int = 0) -> int | None:
        """When `pid` was seen ended (wall clock ns), for every ring of that process (made at
        `made_ns` or before: a ring made later is a new process's with the pid reused), until
        `KEEP_S` later; None if it was not watched."""
        end = self._ended.get(pid)
        return end if end is not None and end >= made_ns else None

    def status_of(self, pid: int) -> int:
        """The exit status of `pid`'s process seen ended (waitpid's form: `exit_signal`,
        `exit_code`), -1 when unknown (reaped before it was read on a kernel that keeps no
        status for pidfds, not reaped yet and not readable here, not watched)."""
        if pid not in self._ended:
            return -1
        fd = self._unread.get(pid)
        if fd is not None:  # seen ended, its status not read yet: reaped since?
            status = reaped_status(fd)
            if status >= 0:
                self._status[pid] = status
                del self._unread[pid]
                with contextlib.suppress(OSError):
                    os.close(fd)
        return self._status.get(pid, -1)

    def close(self) -> None:
        for fd in list(self._fds):
            self._poll.unregister(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._pids.clear()
        for pid in list(self._unread):
            self._forget(pid)


def exit_status(pid: int, proc: str = "/proc") -> int:
    """The exit status of the ended process `pid` from `<proc>/<pid>/stat`'s field 52 (Linux ≥
    3.5; waitpid's form), while it is a zombie; -1 when it cannot be read — reaped already, a
    process still running (its field is 0 then: not an exit), another pid namespace, a
    malformed line."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            line = f.read(4096)
    except OSError:
        return -1
    close = line.rfind(b")")  # the command name may hold spaces and parentheses
    fields = line[close + 2:].split() if close >= 0 else []
    if len(fields) < 50 or fields[0] != b"Z":  # fields[0] is field 3 (state), [49] field 52
        return -1
    try:
        status = int(fields[49])
    except ValueError:
        return -1
    return status if 0 <= status < 1 << 16 else -1


def reaped_status(pidfd: int) -> int:
    """The exit status (waitpid's form) the kernel keeps for a reaped process's pidfd
    (`PIDFD_GET_INFO` asking `PIDFD_INFO_EXIT`, Linux ≥ 6.15); -1 while the process is not
    reaped yet (running or a zombie), on an older kernel (the ioctl is unknown there), or
    with a bad descriptor."""
    buf = bytearray(PIDFD_INFO_SIZE)
    struct.pack_into("=Q", buf, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buf)
    except OSError:
        return -1
    mask, = struct.unpack_from("=Q", buf, 0)
    if not mask & PIDFD_INFO_EXIT:
        return -1
    status, = struct.unpack_from("=i", buf, 60)
    return status if 0 <= status < 1 << 16 else -1
