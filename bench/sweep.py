"""What one sweep of a job with stage records costs: its read from ClickHouse and its analysis.

    rankwatch bench sweep [--tp 8 --pp 4 --dp 32] [--steps 60] [--repeat 3] [--json]

The simulator (in process) stores a job's stage records, ops, chunk snapshots and kernels — the
kinds a sweep reads (`diagnosis.analyst.SWEEP_KINDS`) — with one GPU slowdown, into a private
embedded ClickHouse through the streams writer. Then, at the job's last record, alternately
`--repeat` times:

- **whole window**: the stage records and the other kinds over the analyst's 90 s window (what
  a sweep read before it started at the judged steps), then `slow.analyze`;
- **sweep**: `Analyst._sweep_window` — the stage records over 90 s, the other kinds from
  `slow.reach_start` on (the steps the analysis judges and `SWEEP_MARGIN_STEPS` before
  them) — then `slow.analyze`.

Reported per variant: ops read, CPU seconds of the read (this process, so ClickHouse's work is
in it) and of the analysis, and whether the two conclusions are identical (they must be). A
1.7 s-step job's 60 steps fit in the 90 s window; with fewer steps than the analysis judges
plus the margin the two reads are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Collection
from typing import Any

from ingest.units import SECOND


def run(tp: int, pp: int, dp: int, steps: int, repeat: int, say: Any) -> dict[str, Any]:
    from diagnosis import slow
    from diagnosis.agents import read_window
    from diagnosis.analyst import SWEEP_KINDS, SWEEP_MARGIN_STEPS, Analyst, AnalystConfig
    from diagnosis.window import Window
    from ingest.batch import decode_batch
    from ingest.records import MODELS
    from ingest.sim.config import JobConfig
    from ingest.sim.simulation import Simulation
    from streams.db import Database, migrate
    from streams.writer import ClickHouseWriter

    world = tp * pp * dp
    victim = world // 2 + 3
    cfg = JobConfig(job_id="bench-sweep", tp=tp, pp=pp, dp=dp, steps=steps, microbatches=8,
                    seed=2)
    sim = Simulation(cfg, [f"gpu_slow rank={victim} factor=1.5 at=20s"])
    topo = sim.topology()
    out: dict[str, Any] = {"ranks": world, "steps": steps, "victim": victim}
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-sweep-") as d:
        db = Database(f"chdb://{d}", "bench")
        try:
            migrate(db)
            writer = ClickHouseWriter(db)
            say(f"simulating tp{tp}·pp{pp}·dp{dp}, {steps} steps, into a private ClickHouse…")
            t0 = time.time()

            async def load() -> int:
                n = 0
                # the raw kinds of them (kernel summaries are the worker's, from the kernels)
                raw = frozenset(SWEEP_KINDS) & frozenset(MODELS)
                for i, (_, kind, data) in enumerate(sim.batches(kinds=raw)):
                    if kind != "jobs":  # the topology comes from `sim` (the reader's `topo`)
                        n += await writer.write(kind, [decode_batch(data)], f"sweep:{i}")
                return n

            out["records"] = asyncio.run(load())
            say(f"  {out['records']:,} records stored in {time.time() - t0:.0f} s")
            now = int(db.query("SELECT toUnixTimestamp64Nano(max(t_start)) FROM ops "
                               "WHERE job_id = 'bench-sweep'").result_rows[0][0])

            def read(job_id: str, start_ns: int, now_ns: int,
                     kinds: Collection[str] | None = None) -> Window:
                return read_window(db, topo, start_ns, now_ns, kinds)

            analyst = Analyst(read, AnalystConfig())
            start = now - int(analyst.config.window_s * SECOND)
            rest = [k for k in SWEEP_KINDS if k != "stages"]

            def whole() -> Window:
                st = read(topo.job_id, start, now, ("stages",))
                w = read(topo.job_id, start, now, rest)
                return Window(w.topo, {**w.tables, "stages": st.tables["stages"]}, start, now)

            def sweep() -> Window:
                w, _ = analyst._sweep_window(topo.job_id, now)
                if w is None or not w.get("stages"):
                    raise RuntimeError("the sweep read nothing: the job has no stage records")
                return w

            runs: dict[str, list[dict[str, Any]]] = {"whole": [], "sweep": []}
            found: dict[str, Any] = {}
            for i in range(repeat):
                for name, fn in (("whole", whole), ("sweep", sweep)):
                    c0 = time.process_time()
                    w = fn()
                    c1 = time.process_time()
                    c = slow.analyze(w, now)
                    c2 = time.process_time()
                    runs[name].append({"ops": len(w.tables["ops"]["rank"]),
                                       "read_cpu_s": round(c1 - c0, 3),
                                       "analysis_cpu_s": round(c2 - c1, 3)})
                    found[name] = c
                say(f"  run {i + 1}/{repeat}: whole window {runs['whole'][-1]['read_cpu_s']} "
                    f"CPU-s, sweep {runs['sweep'][-1]['read_cpu_s']} CPU-s")
            out["runs"] = runs
            out["identical"] = found["whole"] == found["sweep"]
            c = found["sweep"]
            out["found"] = None if c is None else [list(c.ranks)[:4], c.stage, c.component]
            lo = slow.reach_start(read(topo.job_id, start, now, ("stages",)).tables["stages"],
                                      SWEEP_MARGIN_STEPS)
            out["sweep_from_s"] = round((now - max(start, lo or start)) / SECOND, 1)
        finally:
            db.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench sweep", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--dp", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.tp, args.pp, args.dp, args.steps, args.repeat) < 1:
        p.error("--tp, --pp, --dp, --steps and --repeat must be at least 1")

    def say(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    r = run(args.tp, args.pp, args.dp, args.steps, args.repeat, say)
    if args.json:
        print(json.dumps(r))
        return 0 if r["identical"] else 1
    print(f"sweep of a {r['ranks']:,}-rank job with stage records ({r['steps']} steps, "
          f"{r['records']:,} records; slowdown injected on rank {r['victim']}):")
    for name, label in (("whole", "whole 90 s window"),
                        ("sweep", f"sweep (last {r['sweep_from_s']} s)")):
        rs = r["runs"][name]
        print(f"  {label}: {rs[0]['ops']:,} ops; read "
              f"{' / '.join(str(x['read_cpu_s']) for x in rs)} CPU-s; analysis "
              f"{' / '.join(str(x['analysis_cpu_s']) for x in rs)} CPU-s")
    print(f"  conclusions identical: {'yes' if r['identical'] else 'NO'}; found {r['found']}")
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
