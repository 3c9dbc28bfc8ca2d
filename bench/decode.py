"""Wire format: decode cost per record of one ops batch, by encoding, on one core.

    rankwatch bench decode [--rows 10000] [--rounds 30] [--json]

Encodes one batch of `--rows` synthetic op records (ingest.synthetic.ops_columns) three ways —
JSON with plain integer arrays, JSON with packed (base64 little-endian) integer columns, and
framed binary (docs/records.md) — compresses each with zstd (cramjam, as the Kafka client
does), and times `decode_batch` alone and zstd decompression + `decode_batch`, interleaving the
encodings round by round. Prints the median over rounds in ns per record and M records/s, and
each encoding's bytes per record before and after zstd. Nothing else runs; no services.
"""

from __future__ import annotations

import argparse
import json
import time

import cramjam
import numpy as np

from ingest.batch import decode_batch, encode_batch
from ingest.synthetic import ops_columns

ENCODINGS = {"json-plain": {"packed": False}, "json-packed": {}, "binary": {"framing": "binary"}}


def measure(rows: int, rounds: int) -> dict[str, dict[str, float]]:
    cols = ops_columns(64, 0, rows, 1_763_000_000_000_000_000)
    data = {name: encode_batch("ops", "bench", cols, **kw)  # type: ignore[arg-type]
            for name, kw in ENCODINGS.items()}
    packed = {name: bytes(cramjam.zstd.compress(d)) for name, d in data.items()}
    plain: dict[str, list[float]] = {n: [] for n in data}
    with_zstd: dict[str, list[float]] = {n: [] for n in data}
    for _ in range(rounds):
        for name in data:
            t = time.perf_counter_ns()
            decode_batch(data[name])
            plain[name].append((time.perf_counter_ns() - t) / rows)
            t = time.perf_counter_ns()
            decode_batch(bytes(cramjam.zstd.decompress(packed[name])))
            with_zstd[name].append((time.perf_counter_ns() - t) / rows)
    return {name: {"decode_ns_per_record": round(float(np.median(plain[name])), 1),
                   "decode_m_records_s": round(1e3 / float(np.median(plain[name])), 2),
                   "zstd_decode_ns_per_record": round(float(np.median(with_zstd[name])), 1),
                   "bytes_per_record": round(len(data[name]) / rows, 1),
                   "zstd_bytes_per_record": round(len(packed[name]) / rows, 1)}
            for name in data}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rankwatch bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000, help="records in the batch")
    ap.add_argument("--rounds", type=int, default=30, help="timed decodes per encoding")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    if a.rows < 1 or a.rounds < 1:
        ap.error("--rows and --rounds must be at least 1")
    out = measure(a.rows, a.rounds)
    if a.json:
        print(json.dumps({"rows": a.rows, "rounds": a.rounds, "encodings": out}))
        return 0
    print(f"one ops batch of {a.rows:,} records, median of {a.rounds} rounds, one core")
    print(f"  {'encoding':12} {'decode ns/rec':>14} {'M rec/s':>8} {'zstd+decode ns/rec':>19} "
          f"{'B/rec':>6} {'zstd B/rec':>10}")
    for name, r in out.items():
        print(f"  {name:12} {r['decode_ns_per_record']:>14} {r['decode_m_records_s']:>8} "
              f"{r['zstd_decode_ns_per_record']:>19} {r['bytes_per_record']:>6} "
              f"{r['zstd_bytes_per_record']:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
