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
The slowdown job runs longer than the hang job: the slowdown analysis names a rank only from
`2 × onset_steps` steps that carry its evidence (`diagnosis.slow.context`), kernels on every
2nd step need twice as many, and a window shorter than that concludes nothing in milliseconds
— `slowdown_found` says which (None: no verdict, and its time is no analysis's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

#: size -> (tp, pp, dp, microbatches, steps of the hang job, kernels every k-th step, steps of
#: the slowdown job)
#: the 16,384-rank slowdown job at 18 steps (36.9 M calls) takes 21.6 GiB to simulate in
#: process: past a 24 GiB machine with the copy timed below, so its default is the hang job's
#: 3 steps, which no analysis can judge (`--slow-steps 18` where memory allows)
SHAPES = {1024: (8, 4, 32, 8, 6, 1, 10), 4096: (8, 8, 64, 8, 4, 2, 18),
          16384: (8, 16, 128, 16, 3, 2, 3)}


def _window(size: int, fault: str, slow_steps: int = 0) -> tuple[Any, Any, int]:
    from diagnosis.window import Window
    from ingest.sim.config import JobConfig
    from ingest.sim.simulation import Simulation, collect

    tp, pp, dp, mb, hang_steps, ke, _ = SHAPES[size]
    steps = slow_steps or hang_steps
    cfg = JobConfig(job_id=f"bench-{size}", tp=tp, pp=pp, dp=dp, microbatches=mb, steps=steps,
                    kernel_every=ke, hang_tail_s=4.0)
    sim = Simulation(cfg, [fault])
    d = collect(sim.batches())
    topo = d.pop("jobs")["topology"][0]
    now = int(max(d["beats"]["ts"].max(), d["ops"]["t_enqueue"].max()))
    return Window(topo, d, now - 90 * 10**9, now), sim, now


def bench(size: int, slow_steps: int | None = None) -> dict[str, Any]:
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
    out["slowdown_steps"] = steps = slow_steps or SHAPES[size][6]
    w, _, now = _window(size, f"gpu_slow rank={victim} factor=2.0 at=0.5s", steps)
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
    p.add_argument("--slow-steps", type=int, default=None,
                   help="steps of the slowdown job at every size (default: per size, SHAPES)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    if unknown := sorted(set(sizes) - set(SHAPES)):
        p.error(f"--sizes: no shape for {unknown}; one of {sorted(SHAPES)}")
    if args.slow_steps is not None and args.slow_steps < 1:
        p.error("--slow-steps must be at least 1")
    rows = []
    for s in sizes:
        r = bench(s, args.slow_steps)
        rows.append(r)
        if not args.json:
            print(f"{s:6d} ranks: hang root cause {r['hang_rca_s']:.3f} s -> {r['hang_found']} "
                  f"(injected rank {r['hang_expected']}); slowdown root cause "
                  f"{r['slowdown_rca_s']:.3f} s over {r['slowdown_steps']} steps -> "
                  f"{r['slowdown_found'] or 'no verdict'} (slowdown analysis "
                  f"alone on an uncached copy: {r['slowdown_analysis_s']:.3f} s); trigger agent "
                  f"{r['trigger_ms_per_window']} ms per job-window", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
