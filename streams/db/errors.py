"""The errors ClickHouse access raises, each carrying ClickHouse's own message and code.

Every call into the driver or chdb converts its exception here, so callers catch one type
(`ClickHouseError`) and show ClickHouse's text ("Code: 60. DB::Exception: ...") without the
driver's preamble.
"""

from __future__ import annotations

import re

from clickhouse_connect.driver.exceptions import ClickHouseError as DriverError

BUSY_HINT = ("the embedded database is held by another process; start the worker (`rankwatch up`) "
             "so queries go through it")
_CODE = re.compile(r"Code: (\d+)\.")


class ClickHouseError(RuntimeError):
    """A failed ClickHouse call. `message` is ClickHouse's own text, `code` its error code."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message, self.code = message, code


class EmbeddedDatabaseBusy(ClickHouseError):
    """Another process holds the embedded data directory (chdb allows one process per dir)."""


def _message(e: BaseException) -> str:
    """ClickHouse's message without the driver's preamble (HTTP URL, "Unable to open ...")."""
    text = str(e).strip()
    at = text.find("Code: ")
    return text[at:] if at > 0 else text


def from_driver(e: DriverError) -> ClickHouseError:
    """clickhouse-connect's exception as ours; a chdb directory held elsewhere as
    `EmbeddedDatabaseBusy`."""
    message = _message(e)
    if "Error initializing EmbeddedServer" in message:
        return EmbeddedDatabaseBusy(f"{BUSY_HINT} ({message})", getattr(e, "code", None))
    return ClickHouseError(message, getattr(e, "code", None))


def from_chdb(e: BaseException) -> ClickHouseError:
    """An exception from chdb's own connection API (its text carries ClickHouse's) as ours."""
    return coded(_message(e))


def coded(message: str) -> ClickHouseError:
    """A ClickHouseError for `message`, its code read from the "Code: N." in it."""
    code = _CODE.search(message)
    return ClickHouseError(message, int(code.group(1)) if code else None)
