"""Where ClickHouse is: the URLs rankwatch accepts and the client arguments they become.

`chdb:///<dir>` is the embedded engine (in this process); `http(s)://user:pass@host:port` a
server. The database is a setting of its own, not part of the URL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

#: Settings every connection starts with: synchronous inserts (chdb defaults async_insert=1).
CLIENT_SETTINGS: dict[str, Any] = {"async_insert": 0}


@dataclass(frozen=True)
class Target:
    """Where ClickHouse is: the embedded engine at `path`, or a server."""

    scheme: Literal["chdb", "http", "https"]
    path: str = ""  # chdb data directory; ":memory:" for an in-memory engine
    host: str = ""
    port: int = 0
    username: str = ""
    password: str = field(default="", repr=False)
    options: tuple[tuple[str, str], ...] = ()

    @property
    def embedded(self) -> bool:
        return self.scheme == "chdb"

    def display(self) -> str:
        """The URL without its password, for messages and logs."""
        if self.embedded:
            return f"chdb://{self.path}"
        user = f"{self.username}@" if self.username else ""
        return f"{self.scheme}://{user}{self.host}:{self.port}"


def parse_url(url: str) -> Target:
    """Parse `chdb:///abs/dir`, `chdb://rel/dir`, `chdb://memory` or
    `http(s)://[user[:password]@]host[:port][/][?option=value...]`.

    The database is not part of the URL (it is settings.clickhouse_database): an HTTP URL with a
    path is refused rather than silently ignored. Options pass through to clickhouse-connect.
    """
    if url.startswith("chdb://"):
        rest, _, query = url[len("chdb://"):].partition("?")
        if query:
            raise ValueError(f"{url!r}: chdb URLs take no options")
        if rest in ("", "memory", ":memory:"):
            return Target("chdb", ":memory:")
        return Target("chdb", str(Path(unquote(rest)).expanduser().resolve()))
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: expected chdb://, http:// or https://")
    if not parts.hostname:
        raise ValueError(f"{url!r}: no host")
    if parts.path not in ("", "/"):
        raise ValueError(f"{url!r}: the database is not part of the URL; "
                         "set RANKWATCH_CLICKHOUSE_DATABASE instead")
    try:
        port = parts.port or (8443 if parts.scheme == "https" else 8123)
    except ValueError as e:
        raise ValueError(f"{url!r}: {e}") from None
    scheme: Literal["http", "https"] = "https" if parts.scheme == "https" else "http"
    return Target(scheme, "", parts.hostname, port, unquote(parts.username or ""),
                  unquote(parts.password or ""), tuple(parse_qsl(parts.query)))


def endpoint_target(target: Target, user: str, password: str) -> Target:
    """Where the SQL endpoint's queries go: on a server, as `user` when one is given (a user
    with SELECT alone and a constrained settings profile); else `target` itself (the embedded
    engine has one user, and its session settings do the restricting)."""
    if target.embedded or not user:
        return target
    return dataclasses.replace(target, username=user, password=password)


def client_args(target: Target, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for `clickhouse_connect.get_client` (no database: it may not exist yet).
    HTTP clients get no session id, so every request is its own session, as on chdb."""
    merged = {**CLIENT_SETTINGS, **(settings or {})}
    if target.embedded:
        return {"interface": "chdb", "path": target.path, "settings": merged}
    return {"interface": target.scheme, "host": target.host, "port": target.port,
            "username": target.username or None, "password": target.password,
            "autogenerate_session_id": False, "settings": merged, **dict(target.options)}
