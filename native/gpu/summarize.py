"""Summarize a GPU check run (native/gpu/check.sh): step-time overhead and the agent's records.

    python native/gpu/summarize.py OUT_DIR [--json]

Overhead: each variant's runs are paired with the baseline run of the same repeat (the variants
alternate, so slow drift of the machine falls on both); the figure is the median over repeats of
(variant median step time / baseline median step time − 1), with the min and max. Records: the
capture file decoded batch by batch, rows per (job, kind), plus checks a user would make — every
op has an end, op sequence numbers are dense per (rank, communicator), each kernel has a name
and a positive duration, chunk counters never exceed the transfer's chunk total. The short
capture run's and the fault run's batches are written to OUT_DIR/fixture-<job>.rwcap (fixtures).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from ingest.agent.capture import CaptureWriter, read_capture
from ingest.batch import BatchError, decode_batch


def overhead(steps: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in steps:
        if r["job"] in FIXTURE_JOBS:
            continue
        rep = int(r["job"].rsplit("-", 1)[1])
        by[(r["variant"], rep)].append(r["median_ms"])
    reps = sorted({rep for _, rep in by})
    out: dict[str, Any] = {"baseline_step_ms": statistics.median(
        statistics.fmean(by[("baseline", rep)]) for rep in reps)}
    for variant in ("native", "full"):
        ratios = [statistics.fmean(by[(variant, rep)]) / statistics.fmean(by[("baseline", rep)])
                  - 1 for rep in reps if by.get((variant, rep)) and by.get(("baseline", rep))]
        if ratios:
            out[variant] = {"overhead_pct": 100 * statistics.median(ratios),
                            "min_pct": 100 * min(ratios), "max_pct": 100 * max(ratios),
                            "repeats": len(ratios)}
    return out


FIXTURE_JOBS = ("gpu-capture", "gpu-stall")


def records(capture: Path, out: Path) -> dict[str, Any]:
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    cols: dict[tuple[str, str], list[dict[str, np.ndarray]]] = defaultdict(list)
    fix = {job: CaptureWriter(out / f"fixture-{job}.rwcap") for job in FIXTURE_JOBS}
    for fr in read_capture(capture):
        job = fr.key.split(b":", 1)[0].decode()
        if job in fix:
            fix[job].publish(fr.kind, fr.data, fr.key)
        if fr.kind == "jobs":
            rows[job]["jobs"] += 1
            continue
        try:
            b = decode_batch(fr.data)
        except BatchError as e:  # the worker would dead-letter it: a failure of the check
            rows[job][f"{fr.kind} refused"] += 1
            print(f"  {job} {fr.kind}: a batch the worker would refuse: {e}", file=sys.stderr)
            continue
        rows[job][fr.kind] += b.n
        if fr.kind in ("ops", "kernels", "chunks", "flows"):
            cols[(job, fr.kind)].append(b.cols)
    for f in fix.values():
        f.close()
    checks: dict[str, Any] = {}
    for (job, kind), parts in cols.items():
        c = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        if kind == "ops":
            ended = c["t_end"] > 0
            seq_ok = True
            keys = np.char.add(np.char.add(c["rank"].astype(str), ":"),
                               np.asarray(c["comm_id"], dtype=str))
            ops = np.char.add(np.char.add(keys, ":"), c["op_seq"].astype(str))
            for key in np.unique(keys):
                s = np.unique(c["op_seq"][keys == key])
                seq_ok &= bool(s.size == 0 or s[-1] - s[0] + 1 == s.size)
            checks[f"{job} ops complete / ops"] = (
                f"{np.unique(ops[ended]).size}/{np.unique(ops).size}")
            checks[f"{job} rows published in flight"] = int((~ended).sum())
            checks[f"{job} op_seq dense per (rank, comm)"] = seq_ok
        elif kind == "kernels":
            checks[f"{job} kernels named, duration > 0"] = bool(
                (np.asarray(c["kernel"], dtype=str) != "").all() and (c["duration"] > 0).all())
        elif kind == "chunks":
            checks[f"{job} chunk counters <= total"] = bool(
                (c["rdma_done"] <= c["total_chunks"]).all()
                and (c["gpu_ready"] <= c["total_chunks"]).all())
    return {"rows": {j: dict(k) for j, k in sorted(rows.items())}, "checks": checks}


def main() -> int:
    out = Path(sys.argv[1])
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines() if x]
    agent = json.loads((out / "agent.json").read_text() or "{}")
    summary = {"versions": (out / "versions.txt").read_text().strip(), "overhead": overhead(steps),
               **records(out / "capture.rwcap", out), "agent": agent}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if "--json" in sys.argv:
        print(json.dumps(summary, default=str))
        return 0
    o = summary["overhead"]
    print(summary["versions"])
    print(f"baseline step {o['baseline_step_ms']:.2f} ms (median of repeats)")
    for v in ("native", "full"):
        if v in o:
            print(f"  {v:7s} overhead {o[v]['overhead_pct']:+.2f} % "
                  f"(min {o[v]['min_pct']:+.2f}, max {o[v]['max_pct']:+.2f}, "
                  f"{o[v]['repeats']} repeats)")
    for job, kinds in summary["rows"].items():
        print(f"  {job}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    for k, v in summary["checks"].items():
        print(f"  check {k}: {v}")
    print("  agent: " + ", ".join(f"{k}={v}" for k, v in agent.items() if not isinstance(v, dict)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
