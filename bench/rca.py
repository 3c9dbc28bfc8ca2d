"""Root-cause time for one trigger on large jobs, and the trigger agents' cost per job.

    rankwatch bench rca [--sizes 1024,4096,16384] [--json]

For each size the simulator (in process, max speed) produces a job with one fault — a hang and,
separately, a GPU slowdown — and the records are decoded into one window (all ranks, as the
root-cause agent reads it from ClickHouse). Timed: `engine.diagnose` for a hang trigger on the
hang window and for a straggler trigger on the slowdown window (analysis only: the ClickHouse
read is not included; a straggler trigger first checks that nothing is stuck, so the slowdown
figure includes the hang checks, and `slowdown_analysis_s` is `slow.analyze` alone on a
fresh copy of the window), and `JobWatch.observe` per one-second progress window of the sampled
ranks (the trigger agent's work per job and window). Shapes: 1,024 = tp8·pp4·dp32,
4,096 = tp8·pp8·dp64, 16,384 = tp8·pp16·dp128 (16 microbatches, kernels every 2nd step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

SHAPES = {1024: (8, 4, 32, 8, 6, 1), 4096: (8, 8, 64, 8, 4, 2), 16384: (8, 16, 128, 16, 3, 2)}


def _window(size: int, fault: str) -> tuple[Any, Any, int]:
    from diagnosis.window import Window
    from ingest.sim.config import JobConfig
    from ingest.sim.simulation import Simulation, collect

    tp, pp, dp, mb, steps, ke = SHAPES[size]
    cfg = JobConfig(job_id=f"bench-{size}", tp=tp, pp=pp, dp=dp, microbatches=mb, steps=steps,
                    kernel_every=ke, hang_tail_s=4.0)
    sim = Simulation(cfg, [fault])
    d = collect(sim.batches())
    topo = d.pop("jobs")["topology"][0]
    now = int(max(d["beats"]["ts"].max(), d["ops"]["t_enqueue"].max()))
    return Window(topo, d, now - 90 * 10**9, now), sim, now


def bench(size: int) -> dict[str, Any]:
    from diagnosis import engine, slow
    from diagnosis.triggers.base import Trigger
    from diagnosis.triggers.watch import JobWatch
    from diagnosis.window import Window

    world = size
    victim = world // 2 + 3
    out: dict[str, Any] = {"ranks": size}
    w, _, now = _window(size, f"hang rank={victim} stage=bwd mb=1 at=1.5s")
    t0 = time.perf_counter()
    c = engine.diagnose(w, Trigger(w.topo.job_id, now, "hang", ()), now)
    out["hang_rca_s"] = round(time.perf_counter() - t0, 3)
    out["hang_found"] = None if c is None else [list(c.ranks)[:4], c.stage]
    out["hang_expected"] = victim
    watch = JobWatch(w.topo)
    ops, beats = w.get("ops"), w.get("beats")
    lo = int(ops["t_start"].min())
    times = []
    for t in range(lo + 10**9, now, 10**9):
        sel = (ops["t_start"] < t) & (ops["t_start"] >= t - 10**9)
        bsel = (beats["ts"] < t) & (beats["ts"] >= t - 10**9)
        o = {k: v[sel] for k, v in ops.items()}
        b = {k: v[bsel] for k, v in beats.items()}
        t1 = time.perf_counter()
        watch.observe(t, ops=o, beats=b)
        times.append(time.perf_counter() - t1)
    out["trigger_ms_per_window"] = round(1e3 * float(np.median(times)), 2) if times else None
    del w
    w, _, now = _window(size, f"gpu_slow rank={victim} factor=2.0 at=0.5s")
    # the slowdown analysis alone, on its own copy of the columns (nothing memoized yet)
    fresh = Window(w.topo, {k: {c: np.array(v, copy=True) for c, v in t.items()}
                            for k, t in w.tables.items()}, w.start_ns, w.now_ns)
    t0 = time.perf_counter()
    slow.analyze(fresh, now)
    out["slowdown_analysis_s"] = round(time.perf_counter() - t0, 3)
    del fresh
    t0 = time.perf_counter()
    c = engine.diagnose(w, Trigger(w.topo.job_id, now, "straggler", ()), now)
    out["slowdown_rca_s"] = round(time.perf_counter() - t0, 3)
    out["slowdown_found"] = None if c is None else [list(c.ranks)[:4], c.stage]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench rca", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1024,4096,16384")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for s in (int(x) for x in args.sizes.split(",")):
        r = bench(s)
        rows.append(r)
        if not args.json:
            print(f"{s:6d} ranks: hang root cause {r['hang_rca_s']:.3f} s -> {r['hang_found']} "
                  f"(injected rank {r['hang_expected']}); slowdown root cause "
                  f"{r['slowdown_rca_s']:.3f} s -> {r['slowdown_found']} (slowdown analysis "
                  f"alone on an uncached copy: {r['slowdown_analysis_s']:.3f} s); trigger agent "
                  f"{r['trigger_ms_per_window']} ms per job-window", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
