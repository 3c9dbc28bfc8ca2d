"""The delivery ledger: which versions each sink has (delivered or dead-lettered), and the
alerts Alertmanager must keep hearing about. One SQLite file (WAL), shared by the sink threads.

It is what makes delivery exactly-once *as the receiver counts it* across a crash: a version is
marked here right after its sink accepted it and before the Kafka offset is committed, so a
redelivered message finds its id and is not sent again. (A crash between the receiver's
acceptance and the mark can still repeat one version; the idempotency key / dedup_key /
incident_id labels make that harmless at every receiver rankwatch speaks to.)
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import orjson

_SCHEMA = """
CREATE TABLE IF NOT EXISTS delivered (
  sink TEXT NOT NULL, id TEXT NOT NULL, outcome TEXT NOT NULL, ts REAL NOT NULL,
  PRIMARY KEY (sink, id));
CREATE TABLE IF NOT EXISTS alerts (
  sink TEXT NOT NULL, incident_id TEXT NOT NULL, version INTEGER NOT NULL,
  open INTEGER NOT NULL, alert TEXT NOT NULL, ts REAL NOT NULL,
  PRIMARY KEY (sink, incident_id));
"""


class Ledger:
    def __init__(self, path: Path | str) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def prune(self, older_than_s: float) -> int:
        """Forget deliveries and resolved alerts older than `older_than_s` (versions that old
        are skipped by age before the ledger is asked); returns the rows removed."""
        cutoff = time.time() - older_than_s
        with self._lock:
            a = self._db.execute("DELETE FROM delivered WHERE ts < ?", (cutoff,)).rowcount
            b = self._db.execute("DELETE FROM alerts WHERE open = 0 AND ts < ?",
                                 (cutoff,)).rowcount
        return int(a) + int(b)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def done(self, sink: str, id_: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT 1 FROM delivered WHERE sink = ? AND id = ?",
                                   (sink, id_)).fetchone()
        return row is not None

    def mark(self, sink: str, id_: str, outcome: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO delivered VALUES (?, ?, ?, ?)",
                             (sink, id_, outcome, time.time()))

    def counts(self, sink: str) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT outcome, count() FROM delivered WHERE sink = ? "
                                    "GROUP BY outcome", (sink,)).fetchall()
        return {str(o): int(n) for o, n in rows}

    def alert(self, sink: str, incident_id: str) -> dict[str, Any] | None:
        """{"labels", "version", "open"} of the incident's alert at `sink`, or None."""
        with self._lock:
            row = self._db.execute("SELECT version, open, alert FROM alerts WHERE sink = ? AND "
                                   "incident_id = ?", (sink, incident_id)).fetchone()
        if row is None:
            return None
        alert = orjson.loads(row[2])
        return {"labels": alert["labels"], "version": int(row[0]), "open": bool(row[1])}

    def put_alert(self, sink: str, incident_id: str, version: int, open_: bool,
                  alert: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO alerts VALUES (?, ?, ?, ?, ?, ?)",
                             (sink, incident_id, version, int(open_), orjson.dumps(alert),
                              time.time()))

    def open_alerts(self, sink: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT alert FROM alerts WHERE sink = ? AND open = 1 "
                                    "ORDER BY incident_id", (sink,)).fetchall()
        return [orjson.loads(r[0]) for r in rows]
