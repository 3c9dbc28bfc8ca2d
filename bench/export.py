"""Perfetto export cost: encode `--slices` op slices over `--ranks` ranks.

    rankwatch bench export [--slices 500000] [--ranks 1024]

Prints the CPU seconds to build the slices, to write the trace, and its size.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from diagnosis.export import perfetto


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench export", description=__doc__)
    p.add_argument("--slices", type=int, default=500_000)
    p.add_argument("--ranks", type=int, default=1024)
    args = p.parse_args(argv)
    n = args.slices
    ops = {"rank": np.arange(n) % args.ranks, "comm_id": np.array(["dp:world"] * n, object),
           "op_seq": np.arange(n) // args.ranks, "op": np.array(["AllReduce"] * n, object),
           "bytes": np.full(n, 1 << 20), "t_start": np.arange(n) * 1000,
           "t_end": np.arange(n) * 1000 + 500}
    b = perfetto.TraceBuilder()
    t0 = time.process_time()
    perfetto.add_ops(b, ops, 10**12)
    t1 = time.process_time()
    data = b.to_bytes()
    t2 = time.process_time()
    print(f"{n:,} op slices over {args.ranks:,} ranks: build {t1 - t0:.2f} CPU-s "
          f"({(t1 - t0) / n * 1e6:.1f} µs a slice), write {t2 - t1:.2f} CPU-s, "
          f"{len(data) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
