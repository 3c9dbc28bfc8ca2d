"""Long-running local services: processes in their own session tracked by pid files, their
logs, and the ports they listen on. The stack's Kafka nodes, workers and notifier are `Daemon`s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: How a long start-up reports what it is doing (one line at a time; `print` by default).
Progress = Callable[[str], None]


def _proc_state(pid: int) -> tuple[str, str] | None:
    """(state letter, command line) from /proc, or None where /proc does not have it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0], cmdline


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file ("" if there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Daemon:
    """A long-running child process in its own session, tracked by a pid file.

    `marker` is a string its command line contains: a pid file whose process is gone, or whose
    pid now belongs to some other program, counts as stale and is removed.
    """

    name: str
    pid_file: Path
    log_file: Path
    marker: str
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def pid(self) -> int | None:
        """The live process's pid, or None (removing a stale pid file)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if self.is_alive(pid):
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def is_alive(self, pid: int) -> bool:
        """Whether `pid` runs (not a zombie) and its command line contains the marker."""
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our exited child
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, someone else's
        state = _proc_state(pid)
        if state is None:  # no /proc (macOS): trust kill(0)
            return True
        letter, cmdline = state
        # An empty command line: a process caught inside exec (just started), not yet readable.
        return letter not in ("Z", "X") and (not cmdline or self.marker in cmdline)

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> int:
        """Start `argv` detached (new session), output appended to the log; return its pid."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            log.write(f"\n--- {time.strftime('%F %T')} starting {self.name}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=cwd, start_new_session=True,
            )
        self.pid_file.write_text(f"{self._proc.pid}\n")
        return self._proc.pid

    def exited(self) -> int | None:
        """The exit status of a process this object started and that has ended, else None."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM, wait up to `timeout` s, then SIGKILL. Returns whether a process was stopped."""
        pid = self.pid()
        if pid is None and self._proc is not None and self._proc.poll() is None:
            pid = self._proc.pid  # ours, whatever its pid file says
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        self._signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.is_alive(pid):
            time.sleep(0.1)
        if self.is_alive(pid):
            self._signal(pid, signal.SIGKILL)
            for _ in range(50):
                if not self.is_alive(pid):
                    break
                time.sleep(0.1)
        if self._proc is not None and self._proc.pid == pid:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1)
            self._proc = None
        self.pid_file.unlink(missing_ok=True)
        return True

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        """Signal the process group it leads (started with a new session), else the process."""
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)


def connect_host(bind_host: str) -> str:
    """The address to reach a service bound to `bind_host` from this machine."""
    wildcard = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
    return wildcard.get(bind_host, bind_host)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((connect_host(host), port), timeout=timeout):
            return True
    except OSError:
        return False
