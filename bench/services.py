"""Real monitoring services for benchmarks and tests, from their Debian packages (`make
test-deps` installs them): Prometheus Alertmanager and Prometheus, each on a free loopback port
with its own temporary data directory, stopped when the `with` block ends.

Also `Receiver`: a local HTTP server standing in for PagerDuty, Slack or a webhook endpoint. It
records every request (path, headers, body) and can be stopped and started again on the same
port, to make a receiver really unreachable (connection refused) for a while.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rankwatch import http


class MissingService(RuntimeError):
    """A Debian package the benchmark or test needs is not installed."""


def free_port() -> int:
    """A loopback port free now, drawn below Linux's ephemeral range (32768+) so that no
    client connection takes it while a receiver is stopped for an outage."""
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def need(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise MissingService(f"{binary} is missing: install the Debian package {package} "
                             "(`make test-deps` does, as root)")
    return path


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if http.get(url, timeout=1).status == 200:
                return
        except OSError:  # http.HTTPFailure is one
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready in {timeout} s: {log.read_text()[-2000:]}")


@contextmanager
def _process(argv: list[str], ready_url: str, log: Path) -> Iterator[None]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        _wait_ready(ready_url, proc, log)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@dataclass(frozen=True)
class Alertmanager:
    url: str

    def alerts(self, **params: str) -> list[dict[str, Any]]:
        q = "&".join(f"{k}={v}" for k, v in params.items())
        out: list[dict[str, Any]] = json.loads(
            http.get(f"{self.url}/api/v2/alerts?{q}", timeout=5).body)
        return out


@contextmanager
def alertmanager(tmp: Path) -> Iterator[Alertmanager]:
    binary = need("prometheus-alertmanager", "prometheus-alertmanager")
    port = free_port()
    cfg = tmp / "alertmanager.yml"
    cfg.write_text("route:\n  receiver: none\n  group_wait: 0s\nreceivers:\n  - name: none\n")
    argv = [binary, f"--config.file={cfg}", f"--storage.path={tmp / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
            "--log.level=warn"]
    url = f"http://127.0.0.1:{port}"
    with _process(argv, f"{url}/-/ready", tmp / "alertmanager.log"):
        yield Alertmanager(url)


@contextmanager
def prometheus(tmp: Path, targets: list[str], interval_s: float = 1.0,
               rules: Path | None = None) -> Iterator[str]:
    """A Prometheus scraping `targets` (host:port) every `interval_s`; yields its URL."""
    binary = need("prometheus", "prometheus")
    port = free_port()
    cfg = tmp / "prometheus.yml"
    every = f"{round(interval_s * 1000)}ms"
    text = (f"global:\n  scrape_interval: {every}\n  evaluation_interval: {every}\n"
            "scrape_configs:\n  - job_name: rankwatch\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
    if rules is not None:
        text += f"rule_files:\n  - {rules}\n"
    cfg.write_text(text)
    argv = [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    url = f"http://127.0.0.1:{port}"
    with _process(argv, f"{url}/-/ready", tmp / "prometheus.log"):
        yield url


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A recording HTTP receiver on a fixed loopback port; `status` is what it answers."""

    status: int = 202
    port: int = field(default_factory=free_port)
    seen: list[Seen] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n)
                with outer._lock:
                    outer.seen.append(Seen(self.path, dict(self.headers.items()), body))
                self.send_response(outer.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *_a: object) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def bodies(self) -> list[dict[str, Any]]:
        with self._lock:
            return [json.loads(s.body) for s in self.seen]

    def wait(self, n: int, timeout: float = 30) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with self._lock:
                if len(self.seen) >= n:
                    return
            time.sleep(0.02)
        raise AssertionError(f"{self.url}: {len(self.seen)} requests, expected {n}")
