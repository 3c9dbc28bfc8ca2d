"""The ClickHouse writer: decoded record batches in, one idempotent insert per kind per call out.

Contract (DESIGN.md, "Storage"):
- `write(kind, batches, token)` concatenates the batches' numpy columns (no per-record Python;
  string columns stay dictionary-encoded, `raw_block`), adds `job_id` (repeated per batch),
  `src_partition`/`src_offset` (the Kafka message of each batch, when given) and `ingest_ts`
  (one clock reading per call), and sends ONE Native insert (streams.native) into the kind's raw
  table with `async_insert=0`, `insert_deduplicate=1` and `insert_deduplication_token=token`.
  It returns when the rows are stored, or raises: the caller commits Kafka offsets only after
  it returns.
- The token is the deduplication key: a retry with the same token stores nothing twice, whatever
  `ingest_ts` says. It only covers a retry of the same messages; a redelivery grouped differently
  after a crash is caught by the stored offsets (streams.raw_sink skips messages at or below the
  highest `src_offset` already stored from the partition).
- Each `write` measures end-to-end lag, `ingest_ts` minus the record's own time
  (`ingest.batch.TIME_COLUMN`), over rows whose time is known (> 0). The last figures per kind are
  in `last_lag`; `write_metrics` stores them in `ingest_metrics`. Producer clocks may disagree
  with the writer's by milliseconds, so small negative lags are possible and kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from ingest.batch import TIME_COLUMN, Coded, RecordBatch
from ingest.records import COLUMNS, MODELS, JobTopology
from ingest.units import MILLISECOND as _NS_PER_MS
from streams.db import Database

#: The raw table of each raw columnar kind (sql/001_raw.sql): named like the kind. Derived kinds
#: (ingest.records.DERIVED) have their own tables and writers (streams/derived_store.py).
RAW_TABLES: dict[str, str] = {kind: kind for kind in MODELS}


def insert_settings(token: str | None) -> dict[str, object]:
    """Synchronous, deduplicated insert settings; without a token ClickHouse hashes the data."""
    settings: dict[str, object] = {"async_insert": 0, "insert_deduplicate": 1}
    if token is not None:
        if not token:
            raise ValueError("empty deduplication token")
        settings["insert_deduplication_token"] = token
    return settings


def dedup_token(topic: str, partition: int, first_offset: int, last_offset: int) -> str:
    """The deduplication token of a write holding the messages `first_offset..last_offset`
    (inclusive) of one topic partition: `"<topic>:<partition>:<first>-<last>"`.

    Same messages, same token: a retried insert is stored once. Batches cut at other offsets get
    other tokens, so a redelivery regrouped after a restart needs the stored offsets too.
    """
    if not topic:
        raise ValueError("empty topic")
    if partition < 0 or first_offset < 0 or last_offset < first_offset:
        raise ValueError(f"bad offset range: partition {partition}, offsets "
                         f"{first_offset}..{last_offset}")
    return f"{topic}:{partition}:{first_offset}-{last_offset}"


def dedup_token_ranges(topic: str, ranges: Sequence[tuple[int, int, int]]) -> str:
    """The token of a write holding, per `(partition, first, last)` of `ranges`, those messages
    of `topic`: the partitions' `dedup_token`s joined by ","; a single range gives exactly
    `dedup_token`. Same messages, same token (ranges are taken in partition order)."""
    if not ranges:
        raise ValueError("no offset ranges")
    tokens = [dedup_token(topic, p, a, b) for p, a, b in sorted(ranges)]
    return ",".join([tokens[0], *(t[len(topic) + 1:] for t in tokens[1:])])


@dataclass(frozen=True)
class LagStats:
    """End-to-end lag of one write, in milliseconds, over `rows` rows with a known record time."""

    rows: int
    p50_ms: float
    max_ms: float


@dataclass(frozen=True)
class DlqRow:
    """One rejected message: where it was, its first violation (row -1: whole batch), the bytes."""

    ts: int  # ns, when it was rejected
    topic: str
    partition: int
    offset: int
    field: str
    row: int
    reason: str
    payload: bytes


@dataclass(frozen=True)
class IngestMetric:
    """What one worker stored from one topic partition in one flush."""

    ts: int  # ns
    worker: str
    topic: str
    partition: int
    rows: int
    batches: int
    lag_p50_ms: float
    lag_max_ms: float


def raw_block(kind: str, batches: Sequence[RecordBatch], ingest_ts: int,
              sources: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray | Coded]:
    """The insert's columns for `batches` of `kind`, in table order: job_id, the contract's
    columns, src_partition/src_offset (from `sources`, one (partition, offset) per batch; the
    table's -1 default without), ingest_ts. String columns (job_id too) are `Coded`: the batches'
    dictionaries merged (one dict lookup per distinct value per batch), their codes remapped with
    one numpy gather. Pure; no Python object per row."""
    spec = COLUMNS.get(kind)
    if spec is None:
        raise ValueError(f"unknown record kind {kind!r}; expected one of {', '.join(COLUMNS)}")
    for b in batches:
        if b.kind != kind:
            raise ValueError(f"a {b.kind!r} batch (producer {b.producer!r}, seq {b.seq}) "
                             f"in a write of {kind!r}")
        missing = [c.name for c in spec if c.name not in b.cols and c.name not in b.strings]
        if missing:
            raise ValueError(f"batch from producer {b.producer!r}, seq {b.seq} lacks columns "
                             f"{missing}")
    sizes = np.fromiter((b.n for b in batches), dtype=np.int64, count=len(batches))
    n = int(sizes.sum())
    jobs = Coded.concat([Coded(np.zeros(1, np.int64), np.array([b.job_id], object))
                        for b in batches])
    cols: dict[str, np.ndarray | Coded] = {"job_id": Coded(np.repeat(jobs.codes, sizes),
                                                           jobs.values)}
    for c in spec:
        if c.kind == "str":
            cols[c.name] = Coded.concat([_coded(b, c.name) for b in batches])
            continue
        parts = [b.cols[c.name] for b in batches]
        cols[c.name] = np.concatenate(parts).astype(c.dtype, copy=False) if parts else \
            np.empty(0, c.dtype)
    if sources is not None:
        if len(sources) != len(batches):
            raise ValueError(f"{len(sources)} sources for {len(batches)} batches")
        src = np.array(sources, dtype=np.int64).reshape(len(batches), 2)
        cols["src_partition"] = np.repeat(src[:, 0].astype(np.int32), sizes)
        cols["src_offset"] = np.repeat(src[:, 1], sizes)
    cols["ingest_ts"] = np.full(n, ingest_ts, dtype=np.int64)
    return cols


def raw_columns(kind: str, batches: Sequence[RecordBatch], ingest_ts: int,
                sources: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray]:
    """`raw_block` with string columns as object arrays (one str reference per row)."""
    return {name: v.strings() if isinstance(v, Coded) else v
            for name, v in raw_block(kind, batches, ingest_ts, sources).items()}


def _coded(batch: RecordBatch, name: str) -> Coded:
    coded = batch.strings.get(name)
    return coded if coded is not None else Coded.factorize(batch.cols[name])


def lag_stats(record_ts: np.ndarray, ingest_ts: int) -> LagStats:
    """Lag of rows whose record time is known (> 0): median and max, in ms."""
    known = record_ts[record_ts > 0]
    if not len(known):
        return LagStats(0, 0.0, 0.0)
    lag = (ingest_ts - known).astype(np.float64) / _NS_PER_MS
    return LagStats(len(known), float(np.median(lag)), float(lag.max()))


class ClickHouseWriter:
    """Writes record batches, topologies, dead letters and metrics through one `Database`.

    `clock` returns int64 nanoseconds (the ingest time); tests inject their own.
    """

    def __init__(self, db: Database, *, clock: Callable[[], int] = time.time_ns) -> None:
        self.db = db
        self.clock = clock
        #: The lag of the last write of each kind.
        self.last_lag: dict[str, LagStats] = {}

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]] | None = None) -> int:
        """Store `batches` of `kind` in one insert deduplicated by `token`; return the rows sent
        (a duplicate is sent and dropped by ClickHouse). `sources` is each batch's Kafka
        (partition, offset). Raises on failure."""
        now = self.clock()
        cols = raw_block(kind, batches, now, sources)
        n = len(cols["ingest_ts"])
        if n == 0:
            return 0
        settings = insert_settings(token)
        await self.db.ainsert(RAW_TABLES[kind], cols, settings)
        time_col = cols[TIME_COLUMN[kind]]
        assert isinstance(time_col, np.ndarray)  # every kind's time column is an int column
        self.last_lag[kind] = lag_stats(time_col, now)
        return n

    async def write_topologies(self, topologies: Sequence[JobTopology], token: str) -> int:
        """Store job topologies (few and small: built per topology, not a hot path)."""
        if not topologies:
            return 0
        now = self.clock()
        comms = [t.communicators for t in topologies]

        def ints(name: str) -> np.ndarray:
            return np.array([getattr(t, name) for t in topologies], dtype=np.uint32)

        def objects(values: list[object]) -> np.ndarray:
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            return arr

        cols: dict[str, np.ndarray] = {
            "job_id": objects([t.job_id for t in topologies]),
            "ts": np.array([t.ts for t in topologies], dtype=np.int64),
            **{k: ints(k) for k in ("world_size", "tp", "pp", "dp", "ep", "cp", "microbatches")},
            "rank_order": objects([t.rank_order for t in topologies]),
            "schedule": objects([t.schedule for t in topologies]),
            "hosts": objects([list(t.hosts) for t in topologies]),
            "comm_ids": objects([[c.comm_id for c in cs] for cs in comms]),
            "comm_kinds": objects([[c.kind for c in cs] for cs in comms]),
            "comm_members": objects([[list(c.members) for c in cs] for cs in comms]),
            "topology": objects([t.model_dump_json() for t in topologies]),
            "ingest_ts": np.full(len(topologies), now, dtype=np.int64),
        }
        return await self.db.ainsert("jobs", cols, insert_settings(token))

    async def write_dlq(self, rows: Sequence[DlqRow], token: str | None = None) -> int:
        """Store rejected messages; `token` (e.g. the dedup_token of their offsets) makes a retry
        idempotent, without it identical rows inserted twice are dropped by content hash."""
        if not rows:
            return 0
        cols = _dataclass_columns(rows, {"ts": np.int64, "partition": np.int32,
                                         "offset": np.int64, "row": np.int64})
        return await self.db.ainsert("dlq", cols, insert_settings(token))

    async def write_metrics(self, rows: Sequence[IngestMetric]) -> int:
        """Store the writer's own metrics (`ts` in ns; stored with ms precision)."""
        if not rows:
            return 0
        cols = _dataclass_columns(rows, {"ts": np.int64, "partition": np.int32,
                                         "rows": np.uint64, "batches": np.uint32,
                                         "lag_p50_ms": np.float64, "lag_max_ms": np.float64})
        cols["ts"] //= _NS_PER_MS
        return await self.db.ainsert("ingest_metrics", cols, insert_settings(None))


def _dataclass_columns(rows: Sequence[DlqRow] | Sequence[IngestMetric],
                       numeric: Mapping[str, type]) -> dict[str, np.ndarray]:
    """Columns of a few small dataclass rows: numeric fields typed, the others as objects."""
    names = [f.name for f in fields(rows[0])]
    out: dict[str, np.ndarray] = {}
    for name in names:
        values = [getattr(r, name) for r in rows]
        if name in numeric:
            out[name] = np.array(values, dtype=numeric[name])
        else:
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            out[name] = arr
    return out
