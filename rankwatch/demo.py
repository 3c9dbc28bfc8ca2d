"""`make demo`: start a private local stack, publish op records from a separate process, print them
back with `rankwatch sql`, stop everything.

The stack lives in a temporary home on free loopback ports, so the demo never touches a stack you
run yourself. Everything it starts is stopped on exit, also on error or Ctrl-C.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rankwatch import stack
from rankwatch.settings import Settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rankwatch(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankwatch.cli", *args],
                          env=stack.child_env(settings), text=True, capture_output=True,
                          timeout=120)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="rankwatch-demo-") as home:
        settings = Settings.load(home=Path(home), kafka_port=_free_port(),
                                 kafka_controller_port=_free_port(), sql_port=_free_port())
        print("== starting the local stack (Kafka broker + worker with embedded ClickHouse)")
        try:
            stack.up(settings)
            print("\n== publishing 64 op records of job 'demo' from a separate process")
            pub = _rankwatch(settings, "publish", "--job", "demo", "--ranks", "8",
                             "--records", "64")
            print(pub.stdout.strip() or pub.stderr.strip())
            if pub.returncode:
                return pub.returncode
            query = ("SELECT rank, op_seq, op, t_start, "
                     "round(dateDiff('microsecond', t_start, t_end) / 1000, 1) AS ms "
                     "FROM ops WHERE job_id = 'demo' ORDER BY op_seq, rank LIMIT 16")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                n = _rankwatch(settings, "sql", "SELECT count() FROM ops", "--format", "TSV")
                if n.returncode == 0 and n.stdout.strip() == "64":
                    break
                time.sleep(0.3)
            print(f"\n== rankwatch sql \"{query}\"")
            out = _rankwatch(settings, "sql", query, "--format", "PrettyCompact")
            print(out.stdout or out.stderr)
            return out.returncode
        finally:
            print("== stopping")
            stack.down(settings)


if __name__ == "__main__":
    sys.exit(main())
