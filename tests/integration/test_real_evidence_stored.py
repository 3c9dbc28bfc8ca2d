"""bench.real.evidence.stored_ready on the real engine: a slowdown read from the store as it
stood at each moment (rows inserted by then) is named when its evidence was complete plus the
time its rows took to be stored — here set to exactly that, row by row."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench.real.evidence import evidence_ready, stored_ready
from diagnosis.slow.context import STAGE_COLS
from ingest.agent.capture import CaptureWriter
from ingest.batch import decode_batch
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation
from ingest.units import SECOND as S
from streams.db import Database
from streams.writer import ClickHouseWriter, dedup_token

#: each raw table's moment a row is made: what `evidence._AsMade` replays by
MADE = {"ops": "if(toUnixTimestamp64Nano(t_end) > 0, t_end, t_start)",
        "flows": "t_start", "kernels": "t_start", "chunks": "ts", "wr": "ts", "beats": "ts",
        "stages": "t_start + toIntervalNanosecond(" + " + ".join(STAGE_COLS) + ")"}


def _store_and_capture(db: Database, tmp_path: Path, cfg: JobConfig, fault: str) -> Path:
    cap = CaptureWriter(tmp_path / "cap")
    by_kind: dict[str, list[Any]] = {}
    sim = Simulation(cfg, [fault])
    for _, kind, data in sim.batches():
        cap.publish(kind, data, key=cfg.job_id)
        if kind != "jobs":
            by_kind.setdefault(kind, []).append(decode_batch(data))
    cap.close()
    writer = ClickHouseWriter(db)

    async def go() -> None:
        await writer.write_topologies([sim.topology()], "topo:test")
        for i, (kind, batches) in enumerate(sorted(by_kind.items())):
            await writer.write(kind, batches, dedup_token(f"rw.{kind}", 0, i, i))

    asyncio.run(go())
    return tmp_path / "cap"


def _stored_after_made(db: Database, delay_ns: int) -> None:
    """Every raw row's insert time set to when it was made plus `delay_ns`."""
    for table, made in MADE.items():
        db.command(f"ALTER TABLE {table} UPDATE ingest_ts = {made} + "
                   f"toIntervalNanosecond({delay_ns}) WHERE 1 SETTINGS mutations_sync = 2")


def test_a_slowdown_is_named_as_stored_its_record_path_later_than_as_made(
        clickhouse_db: Database, tmp_path: Path) -> None:
    # a job of the last minute: the raw tables drop rows a day past their time and insert
    cfg = JobConfig(job_id="evs", tp=2, pp=4, dp=2, steps=24, epoch_ns=time.time_ns() - 60 * S)
    cap = _store_and_capture(clickhouse_db, tmp_path, cfg, "gpu_slow rank=9 factor=2 at=6s")
    onset = cfg.epoch_ns + 6 * S
    made = evidence_ready(cap, onset, [9], horizon_s=6.0)
    assert made is not None and 9 in made.conclusion.ranks

    _stored_after_made(clickhouse_db, 0)  # stored the instant each row was made
    now = stored_ready(clickhouse_db, "evs", onset, [9], from_s=made.after_s - 0.1)
    assert now is not None and 9 in now.conclusion.ranks
    assert now.after_s == made.after_s

    _stored_after_made(clickhouse_db, S // 2)  # every row half a second on its way
    late = stored_ready(clickhouse_db, "evs", onset, [9], from_s=made.after_s)
    assert late is not None and 9 in late.conclusion.ranks
    assert abs(late.after_s - (made.after_s + 0.5)) <= 0.021  # one 20 ms scan step
    # what was stored before then does not name it, nor another rank after
    assert stored_ready(clickhouse_db, "evs", onset, [9], from_s=made.after_s,
                        horizon_s=made.after_s + 0.45) is None
    assert stored_ready(clickhouse_db, "evs", onset, [3], from_s=made.after_s + 0.5,
                        horizon_s=made.after_s + 1.5, every_ms=100) is None
    assert stored_ready(clickhouse_db, "no-such-job", onset, [9]) is None
