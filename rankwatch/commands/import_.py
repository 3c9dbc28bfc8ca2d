"""`rankwatch import FORMAT PATH… --job NAME`: replay existing traces through the raw topics.

Formats: kineto (PyTorch profiler traces), flight-recorder (PyTorch Flight Recorder dumps),
megatrace (per-rank NCCL API log lines). Every file is parsed and every batch encoded and
validated before the first one is published: a malformed or truncated file is reported with its
name and line, and nothing of the import is sent.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ingest.importers import flight_recorder, kineto, megatrace
from ingest.importers.common import BatchError, Collected, TraceError, encode_all, publish_all
from ingest.publish import BatchPublisher
from rankwatch.settings import Settings

PARSERS = {"kineto": kineto.parse, "flight-recorder": flight_recorder.parse,
           "megatrace": megatrace.parse}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("import", help="import Kineto, Flight Recorder or NCCL-log traces",
                       description=__doc__)
    p.add_argument("format", choices=sorted(PARSERS))
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    p.add_argument("--job", required=True, help="job_id the records belong to")
    p.add_argument("--rank", type=int, help="rank, when the file does not say")
    p.add_argument("--dry-run", action="store_true", help="parse and validate, publish nothing")
    p.set_defaults(func=run)


def collect(fmt: str, paths: list[Path], rank: int | None = None) -> Collected:
    """Parse every file (raises TraceError on the first bad one)."""
    total = Collected()
    for path in paths:
        total.merge(PARSERS[fmt](path, rank))
    return total


def run(args: argparse.Namespace, settings: Settings) -> int:
    try:
        collected = collect(args.format, args.paths, args.rank)
        batches = encode_all(collected, args.job, producer=f"rankwatch-import/{args.format}")
    except (TraceError, BatchError) as e:
        print(f"rankwatch import: {e} — nothing was published", file=sys.stderr)
        return 1
    counts = ", ".join(f"{n} {k}" for k, n in collected.counts().items()) or "no records"
    if args.dry_run:
        print(f"would publish {counts} in {len(batches)} batch(es) for job {args.job!r}")
        return 0
    pub = BatchPublisher(settings.bootstrap, settings.topics)
    left = publish_all(batches, args.job, pub)
    if left or pub.stats.failed or pub.stats.dropped:
        print(f"rankwatch import: {left} undelivered, {pub.stats.failed} failed "
              f"({pub.stats.errors[:2]}) — is the broker up at {settings.bootstrap}?",
              file=sys.stderr)
        return 1
    print(f"published {counts} in {len(batches)} batch(es) for job {args.job!r}")
    return 0
