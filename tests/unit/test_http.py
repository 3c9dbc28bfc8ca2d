"""rankwatch/http.py against a small HTTP server on 127.0.0.1 run by the test: answers, error
statuses with their bodies, and the failures that get no answer; and what `rankwatch sql` and
the worker's health check make of them."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rankwatch import http, stack
from rankwatch.commands.sql import NoEndpoint, query_endpoint
from rankwatch.settings import Settings


class Server(ThreadingHTTPServer):
    daemon_threads = True
    #: /ping answers 200 "Ok." while healthy, else 503 with the reason
    healthy = True
    #: /slow answers once this is set
    release = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        if self.path == "/ping" and self.server.healthy:
            self._answer(200, b"Ok.\n")
        elif self.path in ("/ping", "/unhealthy"):
            self._answer(503, b"worker unhealthy: database thread stuck\n")
        elif self.path == "/slow":
            self.server.release.wait(5)
            self._answer(200, b"late")
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/ping")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._answer(404, b"")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if body == b"fail":
            self._answer(400, b"Code: 62. DB::Exception: Syntax error")
            return
        seen = (f"{self.path} {self.headers['Content-Type']} "
                f"{self.headers.get('Authorization', '-')} ").encode()
        self._answer(200, seen + body)

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server(("127.0.0.1", 0), Handler)
    srv.release = threading.Event()
    t = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()
        t.join(5)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the test connects


def test_get_returns_the_status_and_body(server: Server) -> None:
    r = http.get(f"{server.url}/ping", timeout=5)
    assert (r.status, r.reason, r.body) == (200, "OK", b"Ok.\n")
    assert http.get(f"{server.url}/ping", timeout=5, limit=2).body == b"Ok"
    assert http.get(f"{server.url}/moved", timeout=5).body == b"Ok.\n"  # redirects followed


def test_post_sends_the_body_and_headers(server: Server) -> None:
    r = http.post(f"{server.url}/?default_format=TSV", b"SELECT 1", timeout=5,
                  headers={"Content-Type": "text/plain; charset=utf-8",
                           "Authorization": "Bearer s3cret"})
    assert r.body == b"/?default_format=TSV text/plain; charset=utf-8 Bearer s3cret SELECT 1"
    # without a Content-Type, urllib's default for a POST
    assert http.post(f"{server.url}/", b"x", timeout=5).body == (
        b"/ application/x-www-form-urlencoded - x")


def test_an_error_status_raises_with_the_servers_body(server: Server) -> None:
    with pytest.raises(http.StatusError) as info:
        http.post(f"{server.url}/", b"fail", timeout=5)
    e = info.value
    assert (e.status, e.reason, e.body) == (400, "Bad Request",
                                            b"Code: 62. DB::Exception: Syntax error")
    assert str(e) == "HTTP Error 400: Bad Request" and e.url == f"{server.url}/"
    assert isinstance(e, OSError)  # callers that catch OSError keep catching it
    with pytest.raises(http.StatusError) as info:
        http.get(f"{server.url}/unhealthy", timeout=5, limit=6)
    assert (info.value.status, info.value.body) == (503, b"worker")
    with pytest.raises(http.StatusError) as info:
        http.get(f"{server.url}/nothing", timeout=5)
    assert (info.value.status, info.value.reason, info.value.body) == (404, "Not Found", b"")


def test_nothing_listening_is_unreachable_with_the_reason() -> None:
    url = f"http://127.0.0.1:{closed_port()}/ping"
    with pytest.raises(http.Unreachable) as info:
        http.get(url, timeout=5)
    e = info.value
    assert isinstance(e.reason, ConnectionRefusedError) and isinstance(e, OSError)
    assert str(e) == f"{url}: {e.reason}"


def test_a_server_that_does_not_answer_in_time_is_unreachable(server: Server) -> None:
    with pytest.raises(http.Unreachable) as info:
        http.get(f"{server.url}/slow", timeout=0.2)
    assert isinstance(info.value.reason, TimeoutError)


# ---------------------------------------------------------------------------------------------
# What the commands make of it


def test_rankwatch_sql_gets_the_answer_the_servers_message_or_no_endpoint(
        server: Server) -> None:
    got = query_endpoint(f"{server.url}/", "SELECT 1", "TSV", token="s3cret")
    assert got == b"/?default_format=TSV text/plain; charset=utf-8 Bearer s3cret SELECT 1"
    with pytest.raises(RuntimeError) as failed:
        query_endpoint(f"{server.url}/", "fail", "TSV")
    assert str(failed.value) == "Code: 62. DB::Exception: Syntax error"  # the server's words
    url = f"http://127.0.0.1:{closed_port()}/"
    with pytest.raises(NoEndpoint) as info:  # `rankwatch sql` then opens the database itself
        query_endpoint(url, "SELECT 1", "TSV")
    assert str(info.value) == f"{url}: [Errno 111] Connection refused"


def test_the_worker_health_check_says_why_not(server: Server) -> None:
    settings = Settings(sql_port=server.server_address[1])
    assert stack.ping_worker(settings) == ""
    server.healthy = False  # the worker's own account
    assert stack.ping_worker(settings) == "worker unhealthy: database thread stuck"
    closed = Settings(sql_port=closed_port())
    assert stack.ping_worker(closed) == (
        f"http://127.0.0.1:{closed.sql_port}/ping: [Errno 111] Connection refused")
