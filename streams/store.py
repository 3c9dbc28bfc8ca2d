"""The raw sink's `Store` and the worker's other writes, over one `ClickHouseWriter`."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ingest.batch import RecordBatch
from ingest.records import JobTopology
from streams.raw_sink import DeadLetter
from streams.writer import RAW_TABLES, ClickHouseWriter, DlqRow


class ClickHouseStore:
    """What streams.raw_sink.RawSink and the jobs/DLQ paths of streams.app need."""

    def __init__(self, writer: ClickHouseWriter) -> None:
        self.writer = writer

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]]) -> int:
        return await self.writer.write(kind, batches, token, sources=sources)

    async def max_offset(self, table: str, partition: int, since: int) -> int:
        if table not in RAW_TABLES.values():
            raise ValueError(f"not a raw table: {table!r}")
        result = await self.writer.db.aquery(
            f"SELECT max(src_offset), count() FROM {table} "
            "WHERE src_partition = {p:Int32} AND src_offset >= {since:Int64}",
            parameters={"p": partition, "since": since})
        top, n = result.result_rows[0]
        return int(top) if n else -1

    async def write_topologies(self, topos: Sequence[JobTopology], token: str) -> None:
        await self.writer.write_topologies(topos, token)

    async def write_dead_letters(self, dead: Sequence[DeadLetter]) -> None:
        now = time.time_ns()
        rows = [DlqRow(now, d.topic, d.partition, d.offset, d.error.field, d.error.row,
                       d.reason(), d.excerpt) for d in dead]
        first, last = dead[0], dead[-1]
        await self.writer.write_dlq(
            rows, token=f"dlq:{first.topic}:{first.partition}:{first.offset}-{last.offset}")
