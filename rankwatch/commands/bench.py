"""`rankwatch bench NAME`: benchmarks that print figures (bench/). Never timed assertions."""

from __future__ import annotations

import argparse
import importlib

from rankwatch.settings import Settings

#: bench name -> module under bench/ with `main(argv) -> int`
BENCHES = {
    "rca": "bench.rca",
    "ingest": "bench.ingest",
    "pipeline": "bench.pipeline",
    "simulate": "bench.simulate",
    "kde": "bench.kde",
    "overhead": "bench.overhead",
    "streams": "bench.streams",
    "raw_order": "bench.raw_order",
    "sweep": "bench.sweep",
    "spans": "bench.spans",
    "agent": "bench.agent",
    "notify": "bench.notify",
    "export": "bench.export",
    "soak": "bench.soak",
    "scale": "bench.scale",
    "storm": "bench.storm",
    "decode": "bench.decode",
    "tries": "bench.tries",
}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run a benchmark and print its figures",
                       description="Benchmarks: " + ", ".join(BENCHES))
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark (--help)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    module = importlib.import_module(BENCHES[args.name])
    return int(module.main(args.args))
