"""Which ORDER BY serves diagnosis's main raw query: all ranks of one job in a 30 s window.

    rankwatch bench raw_order [--hours 24] [--ranks 1024] [--per-rank-hz 1] [--json]

Builds two copies of a raw table (the `ops` schema of sql/001_raw.sql: LowCardinality names,
Delta+ZSTD time codecs, partitioned by day) in a private embedded ClickHouse, filled with `--hours`
of a `--ranks`-rank job (plus a second job of the same size, so the job_id prefix matters), one
ordered `(job_id, t_start, rank)` and one `(job_id, rank, t_start)`. Then times, on each, the
query `all ranks of one job in a 30 s window` (per-rank count/max/sum over the window) at 20
random windows, and for contrast `one rank of one job over 10 minutes`. Prints medians and the
rows each read (from the query's own summary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np

from streams.db import Database

T0 = 1_700_000_000_000_000_000
SCHEMA = """
CREATE TABLE IF NOT EXISTS {name}
(
    job_id     LowCardinality(String),
    rank       Int32,
    comm_id    LowCardinality(String),
    op_seq     Int64,
    op         LowCardinality(String),
    bytes      Int64,
    t_start    DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    t_end      DateTime64(9, 'UTC') CODEC(Delta, ZSTD)
)
ENGINE = MergeTree PARTITION BY toDate(t_start) ORDER BY {order}
"""
ORDERS = {"time_first": "(job_id, t_start, rank)", "rank_first": "(job_id, rank, t_start)"}


def fill(db: Database, name: str, hours: float, ranks: int, hz: float) -> int:
    per_job = int(hours * 3600 * hz) * ranks
    step_ns = int(1e9 / hz)
    db.command(f"""
        INSERT INTO {name}
        SELECT if(number % 2 = 0, 'job-a', 'job-b') AS job_id,
               toInt32(intDiv(number, 2) % {ranks}) AS rank,
               concat('dp:', toString(rank % 8)) AS comm_id,
               intDiv(number, {2 * ranks}) AS op_seq,
               'AllReduce' AS op,
               268435456 AS bytes,
               fromUnixTimestamp64Nano(toInt64({T0} + op_seq * {step_ns} + rank * 1000)) AS t_start,
               fromUnixTimestamp64Nano(toInt64({T0} + op_seq * {step_ns} + rank * 1000
                                               + 50000000)) AS t_end
        FROM numbers({2 * per_job})
        SETTINGS max_insert_threads = 2, max_block_size = 1048576
    """)
    db.command(f"OPTIMIZE TABLE {name} FINAL")
    return 2 * per_job


def timed(db: Database, sql: str) -> float:
    t = time.perf_counter()
    db.query(sql, fmt="TabSeparated")
    return time.perf_counter() - t


def estimate(db: Database, sql: str) -> int:
    """Rows ClickHouse will read after primary-key pruning (EXPLAIN ESTIMATE)."""
    return int(sum(r[3] for r in db.query(f"EXPLAIN ESTIMATE {sql}").result_rows))


def measure(db: Database, name: str, hours: float, ranks: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    span = int(hours * 3600 - 30)
    window: list[float] = []
    one_rank: list[float] = []
    rows_read: list[int] = []
    for _ in range(20):
        a = T0 + int(rng.integers(0, span)) * 1_000_000_000
        b = a + 30_000_000_000
        q = f"""
            SELECT rank, count(), max(t_end), sum(bytes) FROM {name}
            WHERE job_id = 'job-a' AND t_start >= fromUnixTimestamp64Nano(toInt64({a}))
              AND t_start < fromUnixTimestamp64Nano(toInt64({b}))
            GROUP BY rank"""
        window.append(timed(db, q))
        rows_read.append(estimate(db, q))
        r = int(rng.integers(0, ranks))
        c = b + 570_000_000_000
        one_rank.append(timed(db, f"""
            SELECT count(), max(t_end) FROM {name}
            WHERE job_id = 'job-a' AND rank = {r}
              AND t_start >= fromUnixTimestamp64Nano(toInt64({a}))
              AND t_start < fromUnixTimestamp64Nano(toInt64({c}))"""))
    return {"window_ms_p50": round(statistics.median(window) * 1e3, 1),
            "window_ms_max": round(max(window) * 1e3, 1),
            "one_rank_10min_ms_p50": round(statistics.median(one_rank) * 1e3, 1),
            "window_rows_read": int(statistics.median(rows_read))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench raw_order",
                                description=__doc__.split("\n")[0])
    p.add_argument("--hours", type=float, default=24)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--per-rank-hz", type=float, default=1.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out: dict[str, object] = {"hours": args.hours, "ranks": args.ranks, "hz": args.per_rank_hz}
    with tempfile.TemporaryDirectory(prefix="rankwatch-order-") as d:
        db = Database(f"chdb://{d}", "bench")
        try:
            for name, order in ORDERS.items():
                db.command(SCHEMA.format(name=name, order=order))
                t = time.perf_counter()
                out["rows"] = fill(db, name, args.hours, args.ranks, args.per_rank_hz)
                if not args.json:
                    print(f"{name}: filled {out['rows']:,} rows in {time.perf_counter() - t:.0f} s",
                          file=sys.stderr)
            for name in ORDERS:
                out[name] = measure(db, name, args.hours, args.ranks, 7)
        finally:
            db.close()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"raw order: {out['rows']:,} rows ({args.hours} h, 2 jobs x {args.ranks} ranks, "
              f"{args.per_rank_hz}/s per rank)")
        for name, order in ORDERS.items():
            m = out[name]
            print(f"  ORDER BY {order}: all ranks / 30 s window p50 {m['window_ms_p50']} ms "  # type: ignore[index]
                  f"(max {m['window_ms_max']} ms, {m['window_rows_read']:,} rows read); "  # type: ignore[index]
                  f"one rank / 10 min p50 {m['one_rank_10min_ms_p50']} ms")  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
