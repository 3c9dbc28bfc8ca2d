"""When a slowdown's evidence was complete, from a kept run's capture.

The live latency of a slowdown (onset → first diagnosis) is the time its evidence takes to
exist — the slow steps the analysis needs before the change stands out of its noise — plus the
record path (tracer, agent, broker, worker, ClickHouse) and the trigger and its tries. To tell
the two apart, `evidence_ready` replays a case's capture with every record stored the instant it
was made (a stage record at its step's end, a call's end at its `t_end`, anything else at its
own time) and runs the slowdown analysis every `EVERY_MS` from the onset: the first moment it
names the fault's ranks is when a diagnosis could have been made with a record path and a
trigger that cost nothing. It goes on to the horizon and says for how long, in how many bursts,
the analysis named them: a fault named only in short bursts is caught live by luck.

`stored_ready` splits the rest: it runs the same analysis on the run's own store as it stood
at each moment — only the rows inserted by then (`ingest_ts`, kept by ClickHouse's
`additional_table_filters`, so the engine does the cut), read up to that moment — from when the
evidence was complete. Its first naming moment less `evidence_ready`'s is what the record path
cost (tracer, agent, broker, worker, insert); the live latency less it is what the triggers and
the tries cost. `rankwatch eval --real --rescore RUN --workdir DIR --evidence` prints both
beside each slowdown case's live latency.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from diagnosis import slow
from diagnosis.agents import WINDOW_COLUMNS, read_topology, read_window
from diagnosis.conclusion import Conclusion
from diagnosis.evaluate import TIME_COL, window_of
from diagnosis.slow.context import stage_total
from ingest.units import MILLISECOND, SECOND

EVERY_MS = 20
HORIZON_S = 8.0


@dataclass(frozen=True)
class Ready:
    """The first moment (s after the onset) the analysis named the fault's ranks, the steps
    rank 0 finished by then, and what it said; over the whole horizon, for how long it named
    them (ms, in steps of `EVERY_MS`) and in how many separate bursts — evidence seen in one
    short burst is caught live only by a try that lands in it."""

    after_s: float
    steps: int
    conclusion: Conclusion
    visible_ms: int = 0
    bursts: int = 0


class _AsMade:
    """A capture's decoded rows, cut to those made by a moment (`at`): `window_of`'s store."""

    def __init__(self, tables: dict[str, dict[str, np.ndarray]]) -> None:
        self.full = tables
        self.at = 0
        st = tables.get("stages")
        self.stage_end = (np.asarray(st["t_start"], np.int64) + stage_total(st)) if st else None

    def table(self, kind: str) -> dict[str, np.ndarray]:
        t = self.full.get(kind)
        if not t:
            return {}
        if kind == "stages":
            assert self.stage_end is not None
            keep = self.stage_end <= self.at
            return {c: v[keep] for c, v in t.items()}
        keep = np.asarray(t[TIME_COL.get(kind, "ts")], np.int64) <= self.at
        out = {c: v[keep] for c, v in t.items()}
        if kind == "ops" and "t_end" in out:  # a call not ended by then is in flight
            end = np.asarray(out["t_end"], np.int64).copy()
            end[end > self.at] = 0
            out["t_end"] = end
        return out


class _StoredBy:
    """A store read as it stood at `by_ns`: every query `read_window` makes keeps only the rows
    inserted by then (a ClickHouse setting on each raw table read, applied by the engine)."""

    def __init__(self, db: Any) -> None:
        self.db, self.by_ns = db, 0

    def query_coded(self, sql: str, parameters: Any = None) -> Any:
        cut = f"ingest_ts <= fromUnixTimestamp64Nano({int(self.by_ns)})"
        filters = ", ".join(f"'{t}': '{cut}'" for t in WINDOW_COLUMNS)
        return self.db.query_coded(f"{sql} SETTINGS additional_table_filters = {{{filters}}}",
                                   parameters)


def load(cap: Path) -> tuple[Any, dict[str, dict[str, np.ndarray]]]:
    """(the job's first topology, its rows per kind) from an agent capture."""
    from ingest.agent.capture import read_capture
    from ingest.batch import decode_batch

    topo = None
    parts: dict[str, list[dict[str, np.ndarray]]] = {}
    for f in read_capture(cap):
        b = decode_batch(f.data)
        if f.kind == "jobs":
            topo = topo or b.topologies[0]
            continue
        parts.setdefault(f.kind, []).append({k: np.asarray(v) for k, v in b.cols.items()})
    tables = {}
    for kind, ps in parts.items():
        cols = set.intersection(*(set(p) for p in ps))
        tables[kind] = {c: np.concatenate([p[c] for p in ps]) for c in sorted(cols)}
    return topo, tables


def evidence_ready(cap: Path, onset_ns: int, ranks: Collection[int],
                   step_ends_ms: Sequence[float] = (), horizon_s: float = HORIZON_S,
                   every_ms: int = EVERY_MS) -> Ready | None:
    """The first moment after `onset_ns` (every `every_ms`, up to `horizon_s`) at which the
    slowdown analysis over the records made by then names a culprit among `ranks`; None when
    it never does in that time (module docstring)."""
    topo, tables = load(cap)
    if topo is None or not tables.get("stages"):
        return None
    store = _AsMade(tables)
    want = set(ranks)
    at = onset_ns
    first: Ready | None = None
    seen, bursts, was = 0, 0, False
    while at < onset_ns + int(horizon_s * SECOND):
        at += every_ms * MILLISECOND
        store.at = at
        w = window_of(store, topo, at - 90 * SECOND, at)  # type: ignore[arg-type]
        c = slow.analyze(w, at)
        named = c is not None and bool(want & set(c.ranks))
        seen += named
        bursts += named and not was
        was = named
        if named and first is None and c is not None:
            ms = (at - onset_ns) / 1e6
            done = int(np.searchsorted(np.asarray(step_ends_ms, dtype=np.float64), ms,
                                       side="right"))
            first = Ready(round(ms / 1e3, 2), done, c)
    if first is None:
        return None
    return replace(first, visible_ms=seen * every_ms, bursts=bursts)


def stored_ready(db: Any, job_id: str, onset_ns: int, ranks: Collection[int],
                 step_ends_ms: Sequence[float] = (), from_s: float = 0.0,
                 horizon_s: float = HORIZON_S, every_ms: int = EVERY_MS) -> Ready | None:
    """The first moment after `onset_ns + from_s` (every `every_ms`, up to `horizon_s` after
    the onset) at which the slowdown analysis over `db`'s rows of `job_id` inserted by then
    (`_StoredBy`), read up to then, names a culprit among `ranks`; None when it never does or
    the job has no topology in `db` (module docstring). `from_s`: where to start, e.g. when
    the evidence was complete — a row is stored after it is made."""
    topo = read_topology(db, job_id)
    if topo is None:
        return None
    view, want = _StoredBy(db), set(ranks)
    at = onset_ns + int(from_s * SECOND)
    while at < onset_ns + int(horizon_s * SECOND):
        at += every_ms * MILLISECOND
        view.by_ns = at
        c = slow.analyze(read_window(view, topo, at - 90 * SECOND, at), at)  # type: ignore[arg-type]
        if c is not None and want & set(c.ranks):
            ms = (at - onset_ns) / 1e6
            done = int(np.searchsorted(np.asarray(step_ends_ms, dtype=np.float64), ms,
                                       side="right"))
            return Ready(round(ms / 1e3, 2), done, c)
    return None
