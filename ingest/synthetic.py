"""Synthetic op records for smoke tests, the first demo and the ingest benchmark.

Not a model of training (that is the simulator, ingest/sim/): just well-formed `ops` columns of a
data-parallel AllReduce loop, generated with numpy so a million records take milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

STEP_NS = 500_000_000  # one AllReduce per rank every 0.5 s of simulated time


def ops_columns(ranks: int, start_seq: int, count: int, t0_ns: int, seed: int = 0,
                ) -> dict[str, object]:
    """`count` op records: ranks 0..ranks-1 round-robin, each rank's op_seq counting up."""
    rng = np.random.default_rng(seed + start_seq)
    i = np.arange(start_seq, start_seq + count, dtype=np.int64)
    rank = i % ranks
    op_seq = i // ranks
    t_enqueue = t0_ns + op_seq * STEP_NS + rng.integers(0, 2_000_000, count)
    t_start = t_enqueue + rng.integers(10_000, 200_000, count)
    t_end = t_start + rng.integers(50_000_000, 60_000_000, count)
    return {
        "rank": rank,
        "comm_id": (np.zeros(count, np.int64), ["dp:world"]),
        "op_seq": op_seq,
        "op": (np.zeros(count, np.int64), ["AllReduce"]),
        "bytes": np.full(count, 256 << 20, np.int64),
        "stream": np.ones(count, np.int64),
        "t_enqueue": t_enqueue,
        "t_start": t_start,
        "t_end": t_end,
        "step": op_seq,
    }


def ops_batches(ranks: int, total: int, batch_rows: int, t0_ns: int, seed: int = 0,
                ) -> Iterator[dict[str, object]]:
    """`total` records cut into batches of at most `batch_rows`."""
    for start in range(0, total, batch_rows):
        yield ops_columns(ranks, start, min(batch_rows, total - start), t0_ns, seed)
