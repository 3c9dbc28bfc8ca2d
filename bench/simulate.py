"""Simulator throughput and memory.

    python -m bench.simulate            # both figures
    python -m bench.simulate --ranks 1024 --steps 20
    python -m bench.simulate --ranks 1024 --realism cpu   # the same job with realism on

Figure 1: simulated rank-seconds per wall-second for a 1,024-rank job (tp8 pp4 dp32, 8
microbatches) in max mode on one core, into a null sink that still encodes every batch.
Figure 2: peak RSS of a 16,384-rank job (tp8 pp16 dp128, 16 microbatches) for a few steps, run in
a child process so the figure is its own. `--realism PRESET` runs the jobs with a realism
preset (ingest/sim/realism.py; kernels kept, so the record volume is comparable).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time

from ingest.sim.config import JobConfig
from ingest.sim.runner import NullSink, run
from ingest.sim.simulation import Simulation


def throughput(cfg: JobConfig) -> dict[str, float]:
    sim = Simulation(cfg)
    t0 = time.perf_counter()
    stats = run(sim, NullSink())
    wall = time.perf_counter() - t0
    sim_s = sim.t_last
    return {"world": cfg.world, "steps": sim.steps_done, "sim_s": round(sim_s, 2),
            "wall_s": round(wall, 2), "rank_s_per_wall_s": round(cfg.world * sim_s / wall),
            "realtime_factor": round(sim_s / wall, 2), "records": sim.rows,
            "records_per_s": round(sim.rows / wall), "mib": round(stats.bytes / 2**20, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.simulate")
    p.add_argument("--ranks", type=int, choices=(1024, 16384), default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--realism", default="off", help="realism preset (default off)")
    args = p.parse_args(argv)
    real: dict[str, object] = {}
    if args.realism != "off":
        from ingest.sim.realism import PRESETS
        if args.realism not in PRESETS:
            p.error(f"--realism {args.realism!r}: expected off or one of {', '.join(PRESETS)}")
        real = {**PRESETS[args.realism], "kernels": True}
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    if args.ranks == 1024:
        cfg = JobConfig(tp=8, pp=4, dp=32, steps=args.steps).with_(**real)
        print(json.dumps(throughput(cfg)))
        return 0
    if args.ranks == 16384:
        cfg = JobConfig(tp=8, pp=16, dp=128, microbatches=16, steps=args.steps,
                        kernel_every=2).with_(**real)
        print(json.dumps(throughput(cfg)))
        return 0
    for ranks, steps in ((1024, args.steps), (16384, 3)):
        out = subprocess.run([sys.executable, "-m", "bench.simulate", "--ranks", str(ranks),
                              "--steps", str(steps), "--realism", args.realism],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout)
        print(f"{ranks:6d} ranks, {r['steps']} steps: {r['sim_s']} simulated s in "
              f"{r['wall_s']} s on one core = {r['rank_s_per_wall_s']:,} rank-s/wall-s "
              f"({r['realtime_factor']}x real time), {r['records_per_s']:,} records/s, "
              f"{r['mib']} MiB encoded, peak RSS {r['peak_rss_mib']} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
