"""Reading one job's window of raw rows from ClickHouse for root cause: in full, or topped up.

`read_window(db, topo, start_ns, now_ns)` reads every rank's rows of every raw kind in
`[start_ns, now_ns]` (kernels: the last `KERNEL_WINDOW_S` of it), plus ops still in flight that
started up to an hour before the window. The analyst reads a live job's window every few
seconds (re-checks every 4 s, sweeps every 10 s) and consecutive windows overlap by 80–90 %:
re-reading all of it cost about 1.2 CPU-s per sweep at 1,024 ranks, and the cost grows with the
ranks, so a 16,384-rank job would spend its worker's whole core re-reading the same rows.

`WindowCache` (one per job, in the root-cause agent) keeps the rows of its last read and asks
ClickHouse only for the rows stored since, by `ingest_ts` — when the worker's writer stored
the row (sql/001_raw.sql) — not by event time: a late batch, a stage record published at the
end of a long step, or an op first stored in flight and again once it completed all land in the
right window, whatever their event time. The top-up is exact under this rule:

- the cache keeps rows with `ingest_ts < cut` and re-reads every row with `ingest_ts >= cut`,
  where `cut` of a read is the earlier of its start and the start of the oldest insert still
  running on the database (`Database.oldest_insert_ns`), less a margin (default 2 s) for the
  moments between the writer's clock reading and its insert call. A row whose `ingest_ts` is
  before the cut was therefore visible when the previous read ran;
- rows are kept without an upper time bound (a row past this window's end belongs to the next
  one) and dropped once they fall out of the window's start (ops in flight: an hour before it);
  each `read` slices its `[start_ns, now_ns]` from the kept rows, as `read_window` would;
- a window that starts earlier than the kept rows, the first read, and every `refresh_s`
  (default 120 s) read in full. The refresh covers rows stored by another process whose
  clock or inserts this worker does not see (rankwatch runs one worker per database today).

Row order within a kind may differ from a full read's (ClickHouse guarantees none without
ORDER BY either); the rules do not depend on it. Tested against `read_window` over a live
sequence of windows, inserts racing the reads, in tests/integration/test_diagnosis_window.py;
measured by `rankwatch bench streams --in-process` ("diagnosis window").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from diagnosis.columns import Columns, coded_column
from diagnosis.window import Window, latest_op_rows
from ingest.batch import Coded
from ingest.records import JobTopology
from streams.db import Database

SECOND = 1_000_000_000

#: raw kind -> (time column, columns read for root cause)
WINDOW_COLUMNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ops": ("t_start", ("rank", "comm_id", "op_seq", "op", "bytes", "peer", "t_enqueue", "t_start",
                        "t_end", "step")),
    "flows": ("t_start", ("rank", "comm_id", "op_seq", "channel", "peer", "nic", "bytes",
                          "t_start", "t_end")),
    "chunks": ("ts", ("rank", "comm_id", "op_seq", "channel", "ts", "total_chunks", "gpu_ready",
                      "rdma_transmitted", "rdma_done")),
    "stages": ("t_start", ("rank", "step", "t_start", "data_next_wait", "model_fwd_loss",
                           "model_backward", "callbacks", "optim_step", "step_other")),
    "kernels": ("t_start", ("rank", "kernel", "t_start", "duration")),
    "beats": ("ts", ("rank", "ts", "comm_id", "last_op_seq")),
}
TIME_COLUMNS = {"t_enqueue", "t_start", "t_end", "ts"}
#: root cause reads only the last 40 s of kernel events (they are the most numerous kind)
KERNEL_WINDOW_S = 40.0
#: ops in flight are read back this far before the window (a hang older than the window)
IN_FLIGHT_LOOKBACK_S = 3600.0

Raw = dict[str, "np.ndarray | Coded"]


def _select(kind: str, with_ingest: bool) -> str:
    # aliases must not shadow the columns the WHERE clause compares
    cols = WINDOW_COLUMNS[kind][1] + (("ingest_ts",) if with_ingest else ())
    return ", ".join(f"toUnixTimestamp64Nano({c}) AS {c}__ns"
                     if c in TIME_COLUMNS or c == "ingest_ts" else c for c in cols)


def _low(kind: str, start_ns: int, now_ns: int) -> int:
    """The earliest event time of `kind` a window [start_ns, now_ns] holds."""
    if kind == "kernels":
        return max(start_ns, now_ns - int(KERNEL_WINDOW_S * SECOND))
    return start_ns


def _in_flight_low(start_ns: int) -> int:
    return start_ns - int(IN_FLIGHT_LOOKBACK_S * SECOND)


def _as_window_tables(raw: Mapping[str, Raw], topo: JobTopology, start_ns: int,
                      now_ns: int) -> Window:
    """Raw query columns (time columns suffixed `__ns`, strings possibly `Coded`) → Window."""
    tables: dict[str, Columns] = {}
    for kind, res in raw.items():
        if not res or not len(next(iter(res.values()))):
            continue
        # LowCardinality columns arrive dictionary-encoded: the rules' factorization of them
        # (columns.codes) then costs nothing
        tables[kind] = {k.removesuffix("__ns"): coded_column(v.values, v.codes)
                        if isinstance(v, Coded) else np.asarray(v)
                        for k, v in res.items() if k != "ingest_ts__ns"}
    if "ops" in tables:
        tables["ops"] = latest_op_rows(tables["ops"])
    return Window(topo, tables, start_ns, now_ns)


def read_window(db: Database, topo: JobTopology, start_ns: int, now_ns: int) -> Window:
    """All ranks' raw rows of one job in [start_ns, now_ns] (plus ops still in flight)."""
    raw: dict[str, Raw] = {}
    for kind, (tcol, _) in WINDOW_COLUMNS.items():
        where = (f"job_id = {{j:String}} AND {tcol} >= fromUnixTimestamp64Nano({{lo:Int64}}, "
                 f"'UTC') AND {tcol} <= fromUnixTimestamp64Nano({{hi:Int64}}, 'UTC')")
        if kind == "ops":
            where = (f"({where}) OR (job_id = {{j:String}} AND toUnixTimestamp64Nano(t_end) = 0"
                     " AND t_start >= fromUnixTimestamp64Nano({lo2:Int64}, 'UTC'))")
        raw[kind] = db.query_coded(f"SELECT {_select(kind, False)} FROM {kind} WHERE {where}",
                                   {"j": topo.job_id, "lo": _low(kind, start_ns, now_ns),
                                    "hi": now_ns, "lo2": _in_flight_low(start_ns)})
    return _as_window_tables(raw, topo, start_ns, now_ns)


def _take(cols: Raw, keep: np.ndarray) -> Raw:
    return {k: Coded(v.codes[keep], v.values) if isinstance(v, Coded) else v[keep]
            for k, v in cols.items()}


def _concat(a: Raw, b: Raw) -> Raw:
    out: Raw = {}
    for k, x in a.items():
        y = b[k]
        if isinstance(x, Coded) or isinstance(y, Coded):
            parts = [v if isinstance(v, Coded) else Coded.factorize(np.asarray(v, dtype=object))
                     for v in (x, y)]
            out[k] = Coded.concat(parts)
        else:
            out[k] = np.concatenate([x, y])
    return out


def _rows(cols: Raw) -> int:
    return len(next(iter(cols.values()))) if cols else 0


@dataclass
class _Kept:
    """One kind's kept rows: every row with event time ≥ `low` (ops in flight: ≥ `low2`) and
    `ingest_ts` < the cut of the read that kept them."""

    cols: Raw
    low: int
    low2: int


class WindowCache:
    """One job's raw window, kept between reads and topped up (module docstring)."""

    def __init__(self, db: Database, topo: JobTopology, *, margin_s: float = 2.0,
                 refresh_s: float = 120.0, clock: Callable[[], int] = time.time_ns) -> None:
        self.db, self.topo, self.clock = db, topo, clock
        self.margin_ns = int(margin_s * SECOND)
        self.refresh_ns = int(refresh_s * SECOND)
        self.kept: dict[str, _Kept] = {}
        self.cut: int | None = None
        self.full_at = 0
        self.last_used = 0
        #: reads served in full / topped up, rows read from ClickHouse
        self.full_reads = 0
        self.top_ups = 0
        self.rows_read = 0

    def _query(self, kind: str, low: int, low2: int, since: int | None) -> Raw:
        tcol = WINDOW_COLUMNS[kind][0]
        where = f"{tcol} >= fromUnixTimestamp64Nano({{lo:Int64}}, 'UTC')"
        if kind == "ops":
            where = (f"({where} OR (toUnixTimestamp64Nano(t_end) = 0 AND "
                     "t_start >= fromUnixTimestamp64Nano({lo2:Int64}, 'UTC')))")
        if since is not None:
            where += " AND ingest_ts >= fromUnixTimestamp64Nano({since:Int64}, 'UTC')"
        res = self.db.query_coded(
            f"SELECT {_select(kind, True)} FROM {kind} WHERE job_id = {{j:String}} AND {where}",
            {"j": self.topo.job_id, "lo": low, "lo2": low2, "since": since or 0})
        self.rows_read += _rows(res)
        return res

    def _trim(self, kind: str, kept: _Kept, low: int, low2: int, cut: int) -> Raw:
        tcol = WINDOW_COLUMNS[kind][0] + "__ns"
        t = np.asarray(kept.cols[tcol])
        keep = (t >= low) & (np.asarray(kept.cols["ingest_ts__ns"]) < cut)
        if kind == "ops":
            keep |= (np.asarray(kept.cols["t_end__ns"]) == 0) & (t >= low2) \
                & (np.asarray(kept.cols["ingest_ts__ns"]) < cut)
        return kept.cols if keep.all() else _take(kept.cols, keep)

    def read(self, start_ns: int, now_ns: int) -> Window:
        """The window [start_ns, now_ns], as `read_window(db, topo, start_ns, now_ns)` reads it."""
        began = self.clock()
        self.last_used = began
        pending = self.db.oldest_insert_ns()
        cut = min(began, pending if pending is not None else began) - self.margin_ns
        full = self.cut is None or began - self.full_at >= self.refresh_ns
        low2 = _in_flight_low(start_ns)
        if not full:
            full = any(k not in self.kept or _low(k, start_ns, now_ns) < self.kept[k].low
                       or (k == "ops" and low2 < self.kept[k].low2) for k in WINDOW_COLUMNS)
        kept: dict[str, _Kept] = {}
        for kind in WINDOW_COLUMNS:
            low = _low(kind, start_ns, now_ns)
            if full:
                cols = self._query(kind, low, low2, None)
            else:
                assert self.cut is not None
                old = self._trim(kind, self.kept[kind], low, low2, self.cut)
                new = self._query(kind, low, low2, self.cut)
                cols = old if not _rows(new) else new if not _rows(old) else _concat(old, new)
            kept[kind] = _Kept(cols, low, low2)
        self.kept, self.cut = kept, cut
        if full:
            self.full_at = began
            self.full_reads += 1
        else:
            self.top_ups += 1
        return _as_window_tables(self._slice(start_ns, now_ns), self.topo, start_ns, now_ns)

    def _slice(self, start_ns: int, now_ns: int) -> dict[str, Raw]:
        out: dict[str, Raw] = {}
        low2 = _in_flight_low(start_ns)
        for kind, k in self.kept.items():
            if not _rows(k.cols):
                continue
            t = np.asarray(k.cols[WINDOW_COLUMNS[kind][0] + "__ns"])
            keep = (t >= _low(kind, start_ns, now_ns)) & (t <= now_ns)
            if kind == "ops":
                keep |= (np.asarray(k.cols["t_end__ns"]) == 0) & (t >= low2)
            out[kind] = k.cols if keep.all() else _take(k.cols, keep)
        return out

    def held_rows(self) -> int:
        return sum(_rows(k.cols) for k in self.kept.values())
