"""ns per record of the Python ring paths (prints figures; not a test).

    .venv/bin/python tests/native/bench_ring.py

- write(pre-filled batch): RingWriter.write of a ready numpy batch (the ctypes call + C copy);
- packer.add: the tracer's per-record path (RecordPacker: struct.pack_into a staging buffer,
  one write per 256 records);
- numpy row fill+write: the same with one structured-row assignment per record, for comparison;
- drain: RingReader.drain (one ctypes call per block) plus split_kinds.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ingest import ring


def main(batch: int = 256, rounds: int = 2000) -> None:
    name = f"/rwbench.py.{os.getpid()}"
    cap = 1 << 16
    with ring.RingWriter(name, capacity=cap) as w, ring.RingReader(name, batch=cap) as r:
        recs = w.records("op", batch)
        recs["t_enqueue"] = np.arange(batch)
        per_drain = cap // batch
        for _ in range(per_drain):  # touch every page of the ring once before timing
            w.write(recs)
        r.drain()
        t_write = t_drain = 0.0
        n_written = 0
        for k in range(rounds):
            t0 = time.perf_counter()
            w.write(recs)
            t_write += time.perf_counter() - t0
            if k % per_drain == per_drain - 1:
                t0 = time.perf_counter()
                raw = r.drain()
                ring.split_kinds(raw)
                t_drain += time.perf_counter() - t0
                n_written += len(raw)
        r.drain()

        packer = w.packer("op", ["ts", "comm_hash", "op_seq", "bytes", "t_enqueue", "peer"])
        n_pack = rounds * batch // 4
        t0 = time.perf_counter()
        for i in range(n_pack):
            packer.add(i, 77, i, 1024, i, -1)
            if i % (cap // 2) == 0:
                r.drain()
        packer.flush()
        t_pack = time.perf_counter() - t0
        r.drain()

        names = recs.dtype.names or ()
        row = tuple(0 for _ in names)
        kind_i = names.index("kind")
        ts_i = names.index("t_enqueue")
        n_fill = rounds * batch // 8
        t0 = time.perf_counter()
        for i in range(n_fill):
            j = i % batch
            rec = list(row)
            rec[kind_i] = ring.KINDS["op"]
            rec[ts_i] = i
            recs[j] = tuple(rec)
            if j == batch - 1:
                w.write(recs)
                if i % (cap // 2) < batch:
                    r.drain()
        t_fill = time.perf_counter() - t0
        r.drain()
        w.unlink()
    n = rounds * batch
    print(
        f"python ring: write(pre-filled batch of {batch}) {t_write / n * 1e9:.1f} ns/record; "
        f"packer.add (6 fields) {t_pack / n_pack * 1e9:.0f} ns/record; "
        f"numpy row fill+write {t_fill / n_fill * 1e9:.0f} ns/record; "
        f"drain+split_kinds {t_drain / n_written * 1e9:.1f} ns/record ({n_written} records)"
    )


if __name__ == "__main__":
    main()
