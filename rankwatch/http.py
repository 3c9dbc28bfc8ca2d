"""The HTTP requests rankwatch makes: to its own services (the worker's SQL endpoint and /ping,
the store's /ping, /metrics) and, in benchmarks, to the services they start. One place for how a
request is sent and how its failures read, over the standard library (`urllib.request.urlopen`:
redirects followed, proxies from the environment).

`get` and `post` return the answer (`Response`) when the server answers with success; otherwise
they raise an `HTTPFailure`, which is an OSError (as urllib's own errors are):
- `StatusError`: the server answered with an error status (`status`, `reason`, `body`); its text
  is urllib's, "HTTP Error 500: Internal Server Error";
- `Unreachable`: no answer — refused, not resolved, timed out, dropped while answering; `reason`
  is what went wrong (the underlying exception, or urllib's text for it).
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    body: bytes


class HTTPFailure(OSError):
    """A request to `url` got no successful answer; `reason` says why."""

    def __init__(self, url: str, message: str, reason: BaseException | str) -> None:
        super().__init__(message)
        self.url, self.reason = url, reason


class StatusError(HTTPFailure):
    """The server answered `status` (4xx, 5xx) with `body` (at most the request's `limit`)."""

    reason: str  #: the status's reason phrase

    def __init__(self, url: str, status: int, reason: str, body: bytes) -> None:
        super().__init__(url, f"HTTP Error {status}: {reason}", reason)
        self.status, self.body = status, body


class Unreachable(HTTPFailure):
    """No answer from `url`."""

    def __init__(self, url: str, reason: BaseException | str) -> None:
        super().__init__(url, f"{url}: {reason}", reason)


def get(url: str, *, timeout: float, headers: Mapping[str, str] | None = None,
        limit: int | None = None) -> Response:
    """GET `url`: the answer's first `limit` bytes (all when None)."""
    return request("GET", url, timeout=timeout, headers=headers, limit=limit)


def post(url: str, body: bytes, *, timeout: float, headers: Mapping[str, str] | None = None,
         limit: int | None = None) -> Response:
    """POST `body` to `url` (with urllib's default form Content-Type unless `headers` names
    one): the answer's first `limit` bytes (all when None)."""
    return request("POST", url, body, timeout=timeout, headers=headers, limit=limit)


def request(method: str, url: str, body: bytes | None = None, *, timeout: float,
            headers: Mapping[str, str] | None = None, limit: int | None = None) -> Response:
    """One request; `timeout` (s) bounds the connection and each wait for the server's bytes."""
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Response(r.status, str(r.reason), r.read(limit))
    except urllib.error.HTTPError as e:
        raise StatusError(url, e.code, str(e.reason), _error_body(e, limit)) from e
    except urllib.error.URLError as e:
        raise Unreachable(url, e.reason) from e
    except (OSError, http.client.HTTPException) as e:
        raise Unreachable(url, e) from e


def _error_body(e: urllib.error.HTTPError, limit: int | None) -> bytes:
    """What the server said with its error status (empty when it cannot be read)."""
    try:
        return e.read() if limit is None else e.read(limit)
    except Exception:
        return b""
