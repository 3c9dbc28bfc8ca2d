"""Kernel-summary throughput: kernel events summarized per second on one core (streams/kde.py).

Synthetic window: `--keys` (rank, stream, kernel) keys, each with 1–3 log-normal duration modes and
`--events-per-key` events on average (ARGUS §1: 10^4–10^5 kernel events per GPU per minute over
~100 active (kernel, stream) combinations). Prints events/s for the binned (default) and exact KDE,
and the compression ratio. Run: `OMP_NUM_THREADS=1 .venv/bin/python -m bench.kde`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from streams.kde import KdeParams, summarize


def _window(n_keys: int, per_key: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(per_key // 2, per_key * 3 // 2 + 1, n_keys)
    keys = np.repeat(np.arange(n_keys), sizes)
    modes = rng.integers(1, 4, n_keys)
    which = rng.integers(0, 3, keys.size) % modes[keys]
    base = rng.uniform(np.log(5e3), np.log(5e6), n_keys)
    mu = base[keys] + 1.5 * which
    durations = np.exp(rng.normal(mu, 0.08))
    perm = rng.permutation(keys.size)
    return keys[perm], durations[perm]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--events-per-key", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    keys, durations = _window(args.keys, args.events_per_key, seed=1)
    for method in ("binned", "exact"):
        params = KdeParams(method=method)
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            out = summarize(keys, durations, params)
            best = min(best, time.perf_counter() - t0)
        print(
            f"kde {method:6s}: {keys.size} events, {args.keys} keys -> {out.n_rows} rows in "
            f"{best * 1e3:.1f} ms = {keys.size / best / 1e6:.2f} M events/s (one core), "
            f"compression {out.compression_ratio:.0f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
