"""Stored reports: what the job's owner needs of a raw batch another worker stored.

A job's bulky kinds are spread over every partition (ingest/keys.py), so any worker of the group
may store a batch of a job it does not own. The owner closes the job's windows from the stored
tables; what it needs of each batch is small — its event-time extent (the range, the stretches
its records cover, its producer: the watermark's input, streams/windows.py) and, for calls, the
newest end per rank (how far a job's calls are stored: `diagnosis.analyst.Analyst.stored`).

The storing worker publishes one report per job and insert, keyed by the bare job id on the
`stored` topic (the job's home partition, so the owner reads it), after the insert and before
the batch's offsets are committed; the owner folds it into its windows as it folds its own
stored batches (`streams.derived.ObservingStore`). Folding is idempotent (a watermark is a
maximum, stretches a union, a late mark is a mark), so a report delivered twice, or sent again
for a batch redelivered after a crash (`RawSink.on_skipped`), changes nothing more.

The wire format is JSON (orjson), versioned, validated whole on decode: a report is read from a
topic anyone with broker access can write, so a malformed one is refused (logged and counted),
never folded in part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ingest.batch import TIME_COLUMN, RecordBatch
from streams.windows import event_segments

VERSION = 1
#: Bounds of one decoded report: extents, stretches per extent, ranks per extent.
MAX_EXTENTS = 4096
MAX_SEGMENTS = 64
MAX_RANKS = 1 << 18
_INT64_MAX = (1 << 63) - 1


class ReportError(ValueError):
    """A report that is not one (module docstring)."""


@dataclass(frozen=True)
class Extent:
    """What the owner needs of one stored batch of `job`: records of `kind` from `producer`
    with event times in [lo, hi] covering `segments`; `ranks[i]`'s newest call ends at
    `ends[i]` (calls only: `newest_call_ends`; empty otherwise)."""

    job: str
    kind: str
    producer: str
    lo: int
    hi: int
    segments: tuple[tuple[int, int], ...]
    ranks: np.ndarray
    ends: np.ndarray


_EMPTY = np.zeros(0, np.int64)


def newest_call_ends(cols: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, the newest moment of each one's calls) in a batch of calls: a call's end, or its
    enqueue while it is in flight (`t_end` 0)."""
    rank = np.asarray(cols["rank"], np.int64)
    n = len(rank)
    t_end = np.asarray(cols["t_end"], np.int64) if "t_end" in cols else np.zeros(n, np.int64)
    t_enq = np.asarray(cols["t_enqueue"], np.int64) if "t_enqueue" in cols \
        else np.zeros(n, np.int64)
    end = np.maximum(t_end, t_enq)
    if not n:
        return rank, end
    ranks, at = np.unique(rank, return_inverse=True)
    newest = np.zeros(ranks.size, dtype=np.int64)
    np.maximum.at(newest, at, end)
    return ranks, newest


def extent(kind: str, b: RecordBatch, gap_ns: int, *, ends: bool = True) -> Extent | None:
    """The extent of a stored batch (None when none of its records has a known time): the
    range of its record times and completions (`t_end`), the stretches they cover split where
    more than `gap_ns` holds none (`event_segments`), and for calls each rank's newest end
    unless `ends` is False (the owner's own batches: its listeners read them whole)."""
    t = np.asarray(b.cols[TIME_COLUMN[kind]])
    has = t > 0
    known = t[has]
    if not len(known):
        return None
    hi = int(known.max())
    end = known
    if "t_end" in b.cols and len(b.cols["t_end"]):  # a completion is an event too
        t_end = np.asarray(b.cols["t_end"])
        hi = max(hi, int(t_end.max()))
        end = t_end[has]
    segments = event_segments(known, end, gap_ns)
    segments[-1] = (segments[-1][0], max(segments[-1][1], hi))
    ranks, newest = newest_call_ends(b.cols) if kind == "ops" and ends else (_EMPTY, _EMPTY)
    return Extent(b.job_id, kind, b.producer, int(known.min()), hi, tuple(segments),
                  ranks, newest)


def encode_report(job: str, extents: list[Extent]) -> bytes:
    """One report of `job`'s extents (all of one job)."""
    return orjson.dumps({"v": VERSION, "job": job, "extents": [
        {"kind": e.kind, "producer": e.producer, "lo": e.lo, "hi": e.hi,
         "segments": [list(s) for s in e.segments], "ranks": e.ranks.tolist(),
         "ends": e.ends.tolist()} for e in extents if e.job == job]})


def decode_report(data: bytes) -> list[Extent]:
    """The extents of one report; ReportError naming what is wrong, for anything else."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ReportError(f"not JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise ReportError(f"not a version {VERSION} report")
    job = doc.get("job")
    if not isinstance(job, str) or not job:
        raise ReportError("no job")
    items = doc.get("extents")
    if not isinstance(items, list) or len(items) > MAX_EXTENTS:
        raise ReportError(f"extents must be a list of at most {MAX_EXTENTS}")
    return [_extent(job, i, item) for i, item in enumerate(items)]


def check_times(extents: list[Extent], min_ns: int, max_ns: int) -> None:
    """ReportError unless every extent lies in [min_ns, max_ns]: the raw sink's plausible
    times (`streams.raw_sink.TimeBounds`) around the report's own Kafka timestamp, so a forged
    report cannot move a job's windows where no stored batch could."""
    for e in extents:
        if e.lo < min_ns or e.hi > max_ns:
            raise ReportError(f"extent of {e.kind} from {e.producer!r} at [{e.lo}, {e.hi}] ns is "
                              f"outside the plausible times [{min_ns}, {max_ns}]")


def _extent(job: str, i: int, item: Any) -> Extent:
    if not isinstance(item, dict):
        raise ReportError(f"extent {i} is not an object")
    kind, producer = item.get("kind"), item.get("producer")
    if kind not in TIME_COLUMN or not isinstance(producer, str):
        raise ReportError(f"extent {i}: unknown kind {kind!r} or no producer")
    lo, hi = _time(i, "lo", item.get("lo")), _time(i, "hi", item.get("hi"))
    if lo > hi:
        raise ReportError(f"extent {i}: lo {lo} after hi {hi}")
    segs = item.get("segments")
    if not isinstance(segs, list) or not 0 < len(segs) <= MAX_SEGMENTS:
        raise ReportError(f"extent {i}: 1 to {MAX_SEGMENTS} segments expected")
    segments = []
    for s in segs:
        if not isinstance(s, list) or len(s) != 2:
            raise ReportError(f"extent {i}: a segment is not [start, end]")
        a, b = _time(i, "segment", s[0]), _time(i, "segment", s[1])
        if not lo <= a <= b <= hi:
            raise ReportError(f"extent {i}: segment [{a}, {b}] outside [{lo}, {hi}]")
        segments.append((a, b))
    ranks, ends = item.get("ranks"), item.get("ends")
    if not isinstance(ranks, list) or not isinstance(ends, list) or len(ranks) != len(ends) \
            or len(ranks) > MAX_RANKS:
        raise ReportError(f"extent {i}: ranks and ends must be lists of one length")
    try:
        r = np.asarray(ranks, np.int64) if ranks else _EMPTY
        e = np.asarray(ends, np.int64) if ends else _EMPTY
    except (TypeError, ValueError, OverflowError) as err:
        raise ReportError(f"extent {i}: ranks and ends must be integers") from err
    if r.ndim != 1 or e.ndim != 1 or (r.size and (r.min() < 0 or e.min() < 0)):
        raise ReportError(f"extent {i}: ranks and ends must be non-negative integers")
    return Extent(job, kind, producer, lo, hi, tuple(segments), r, e)


def _time(i: int, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= _INT64_MAX:
        raise ReportError(f"extent {i}: {name} must be a positive int64 time, got {v!r}")
    return v
