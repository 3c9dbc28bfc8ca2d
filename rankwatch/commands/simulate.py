"""`rankwatch simulate`: run the training-cluster simulator into Kafka or a directory."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import orjson

from rankwatch.settings import Settings


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "simulate", help="simulate a training job (with faults) and publish its records",
        description="Simulate a hybrid-parallel training job and emit its record batches. "
                    "Fault spec: 'FAMILY key=value ...', e.g. 'hang rank=13 stage=bwd mb=3 "
                    "at=30s'; run with --fault help to list families and keys.")
    p.add_argument("--scenario", help="a named scenario of the catalog (--list shows them)")
    p.add_argument("--list", action="store_true", help="list catalog scenarios and exit")
    p.add_argument("--catalog", help="catalog: standard (default), realistic, or a TOML file")
    p.add_argument("--realism", help="apply a realism preset (e.g. cpu: heavy-tailed jitter, OS "
                   "pauses, shared cores, uneven communicators, no kernels; ingest/sim/realism.py) "
                   "or off (the clean model)")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--microbatches", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--job-id")
    p.add_argument("--clock-skew-ms", type=float)
    p.add_argument("--kernel-every", type=int,
                   help="kernel events every k-th step only (default 1: every step)")
    p.add_argument("--ranks-per-host", type=int)
    p.add_argument("--uploaders", type=int,
                   help="publish the hosts' calls, flows, chunks and work requests as this many "
                        "producers, spread over the partitions (default 1; ingest/keys.py)")
    p.add_argument("--kinds", help="publish only these raw kinds, comma-separated (e.g. "
                   "ops,flows,chunks; default all): benchmarks of one kind's path")
    p.add_argument("--fault", action="append", default=[], help="fault spec (repeatable)")
    p.add_argument("--speed", choices=("realtime", "max"), default="max")
    p.add_argument("--out", default="kafka", help="'kafka' or a directory")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from ingest.sim.config import JobConfig
    from ingest.sim.faults import FaultSpecError, describe_families, parse_fault
    from ingest.sim.runner import DirSink, KafkaSink, Sink, stderr_progress
    from ingest.sim.runner import run as run_sim
    from ingest.sim.scenario import get_scenario, load_catalog
    from ingest.sim.simulation import Simulation

    if args.list:
        try:
            catalog = load_catalog(args.catalog)
        except (OSError, ValueError) as e:
            print(f"rankwatch simulate: {e}", file=sys.stderr)
            return 2
        for name, sc in catalog.items():
            print(f"{name:32s} {sc.config.world:5d} ranks  {'; '.join(sc.faults) or '-'}")
        return 0
    if any(f.strip() == "help" for f in args.fault):
        print("fault families and keys:\n" + describe_families())
        return 0
    try:
        if args.scenario:
            sc = get_scenario(args.scenario, args.catalog)
            cfg, faults = sc.config, list(sc.faults)
        else:
            cfg, faults = JobConfig(), []
        overrides = {k: getattr(args, k) for k in ("tp", "pp", "dp", "microbatches", "steps",
                                                   "seed", "job_id", "clock_skew_ms",
                                                   "kernel_every", "uploaders",
                                                   "ranks_per_host")
                     if getattr(args, k) is not None}
        if args.realism is not None:
            from ingest.sim.realism import PRESETS
            if args.realism == "off":
                base = JobConfig()
                overrides.update({k: getattr(base, k) for p_ in PRESETS.values() for k in p_})
            elif args.realism in PRESETS:
                overrides.update(PRESETS[args.realism])
            else:
                raise ValueError(f"--realism {args.realism!r}: expected off or one of "
                                 f"{', '.join(PRESETS)}")
        if args.out == "kafka":  # live pipelines window and expire by wall-clock time
            overrides["epoch_ns"] = time.time_ns()
        cfg = cfg.with_(**overrides)
        faults += args.fault
        kinds = None
        if args.kinds:
            from ingest.records import MODELS
            kinds = frozenset(k.strip() for k in args.kinds.split(",") if k.strip())
            unknown = sorted(kinds - set(MODELS))
            if unknown or not kinds:
                raise ValueError(f"--kinds {args.kinds!r}: unknown kinds {unknown}; expected "
                                 f"some of {','.join(MODELS)}")
        for spec in faults:
            parse_fault(spec).target(cfg.layout)
    except FaultSpecError as e:
        print(f"rankwatch simulate: bad fault spec: {e}", file=sys.stderr)
        return 2
    except (KeyError, ValueError) as e:
        print(f"rankwatch simulate: {e}", file=sys.stderr)
        return 2
    sim = Simulation(cfg, faults)
    sink: Sink = (KafkaSink(settings.bootstrap, settings.topics, cfg.job_id)
                  if args.out == "kafka" else DirSink(args.out))
    stats = run_sim(sim, sink, args.speed, None if args.quiet else stderr_progress, kinds=kinds)
    summary = stats.summary(sim)
    if args.json:
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    elif not args.quiet:
        print(f"simulated {summary['world']} ranks, {summary['steps']} steps, "
              f"{summary['sim_s']} s in {summary['wall_s']} s "
              f"({summary['rank_s_per_wall_s']:,} rank-s/s), {summary['rows']:,} records, "
              f"{len(sim.truth)} faults", file=sys.stderr)
    return 0
