"""Time units: every timestamp and duration in rankwatch is int64 nanoseconds (the record
contract's convention, ingest/records.py); these name the multiples once."""

from __future__ import annotations

NANOSECOND = 1
MICROSECOND = 1_000
MILLISECOND = 1_000_000
SECOND = 1_000_000_000
MINUTE = 60 * SECOND
