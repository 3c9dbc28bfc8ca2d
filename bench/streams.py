"""Derived streams throughput: how fast the derived runner turns stored raw rows into progress
windows, iteration rows and kernel summaries (streams/derived.py), per core.

    rankwatch bench streams [--ranks 1024] [--kernel-events 4000000] [--ops-per-s 500000] [--json]

In-process, on a private embedded ClickHouse: raw rows are inserted directly (not through the
broker: `rankwatch bench ingest` measures that path), then each derived computation is timed on
the windows they fill. Figures are the derived stage's own cost — the raw ingest's cost adds to
it on the same cores. Run with OMP_NUM_THREADS=1 for per-core numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

import numpy as np

from bench.kde import _window
from streams.db import Database, migrate
from streams.derived import DerivedRunner
from streams.kernel_summaries import KernelSummarizer

T0 = 1_700_000_040_000_000_000  # a multiple of 60 s
SEC = 1_000_000_000


def insert_kernels(db: Database, ranks: int, events: int) -> None:
    keys, durations = _window(ranks * 9, max(1, events // (ranks * 9)), 1)
    n = len(keys)
    names = np.array([f"kernel_{i}" for i in range(9)], dtype=object)
    cols = {"job_id": np.full(n, "bench", dtype=object), "rank": (keys // 9).astype(np.int32),
            "stream": np.zeros(n, np.int64), "kernel": names[keys % 9],
            "t_start": T0 + np.sort(np.random.default_rng(0).integers(0, 60 * SEC, n)),
            "duration": np.maximum(durations, 1).astype(np.int64)}
    for lo in range(0, n, 1_000_000):
        db.insert_columns("kernels", {k: v[lo:lo + 1_000_000] for k, v in cols.items()})


def insert_ops(db: Database, ranks: int, per_s: int, seconds: int) -> int:
    comms = np.array(["tp:0", "pp:0", "dp:0"], dtype=object)
    total = 0
    per_rank_comm = max(1, per_s // (ranks * 3))
    for s in range(seconds):
        n = ranks * 3 * per_rank_comm
        i = np.arange(n)
        rank = (i % ranks).astype(np.int32)
        comm = (i // ranks) % 3
        seq = s * per_rank_comm + i // (ranks * 3)
        start = T0 + s * SEC + (i // (ranks * 3)) * (SEC // per_rank_comm)
        db.insert_columns("ops", {
            "job_id": np.full(n, "bench", dtype=object), "rank": rank, "comm_id": comms[comm],
            "op_seq": seq, "op": np.full(n, "AllReduce", dtype=object),
            "bytes": np.full(n, 1 << 20), "peer": np.full(n, -1, np.int32),
            "stream": np.zeros(n, np.int64), "t_enqueue": start, "t_start": start,
            "t_end": start + SEC // per_rank_comm // 2, "step": seq})
        total += n
    return total


async def run(ranks: int, kernel_events: int, ops_per_s: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-streams-") as d:
        db = Database(f"chdb://{d}", "bench")
        try:
            migrate(db)
            insert_kernels(db, ranks, kernel_events)
            n = int(db.query("SELECT count() FROM kernels").result_rows[0][0])
            ks = KernelSummarizer(db)
            t = time.perf_counter()
            _, window = await ks.compute("bench", T0, offload=False)
            dt = time.perf_counter() - t
            out.update(kernel_events=n, kernel_s=round(dt, 3),
                       kernel_events_per_s=round(n / dt),
                       kernel_compression=round(float(window["compression_ratio"][0]), 1))
            seconds = 12
            n_ops = insert_ops(db, ranks, ops_per_s, seconds)

            async def nothing(kind: str, job: str, data: bytes) -> None:
                return None

            runner = DerivedRunner(db, nothing)
            t = time.perf_counter()
            for s in range(6, seconds):
                await runner.progress.compute("bench", T0 + s * SEC)
            dt = time.perf_counter() - t
            per_window = n_ops / seconds
            out.update(ops=n_ops, progress_window_ms=round(dt / (seconds - 6) * 1e3, 1),
                       progress_ops_per_s=round(per_window * (seconds - 6) / dt),
                       progress_rows_per_window=ranks * 3)
            t = time.perf_counter()
            it = await runner._iterations("bench", T0)
            dt = time.perf_counter() - t
            out.update(iteration_window_s=round(dt, 3), iteration_rows=len(it["rank"]),
                       iteration_ops_per_s=round(min(n_ops, per_window * 10) / dt))
        finally:
            db.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench streams", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--kernel-events", type=int, default=4_000_000)
    p.add_argument("--ops-per-s", type=int, default=500_000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = asyncio.run(run(a.ranks, a.kernel_events, a.ops_per_s))
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"streams (derived stage, in process, {a.ranks} ranks):")
    print(f"  kernel summaries: {r['kernel_events']:,} events in one 60 s window read and "
          f"summarized in {r['kernel_s']} s = {r['kernel_events_per_s']:,} events/s, "
          f"compression {r['kernel_compression']}x")
    print(f"  progress: {r['progress_rows_per_window']:,} rows per 1 s window over "
          f"{a.ops_per_s:,} ops/s: {r['progress_window_ms']} ms per window = "
          f"{r['progress_ops_per_s']:,} ops/s")
    print(f"  iterations: one 10 s window ({r['iteration_rows']:,} rows) in "
          f"{r['iteration_window_s']} s = {r['iteration_ops_per_s']:,} ops/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
