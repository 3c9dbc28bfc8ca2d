"""`rankwatch export perfetto --job J [--around INCIDENT_ID] --out FILE`: a job's ops, stages
and kernels as a Perfetto trace (open it in https://ui.perfetto.dev), one track group per rank.

The span: with `--around`, `--seconds` either side of the incident's onset; otherwise the last
`--seconds` of the job's stored ops. Read through the worker's SQL endpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ingest.units import SECOND
from rankwatch.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export", help="export a job's records (perfetto)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("format", choices=["perfetto"])
    p.add_argument("--job", required=True, help="the job_id")
    p.add_argument("--around", metavar="INCIDENT_ID", help="centre the span on its onset")
    p.add_argument("--seconds", type=float, default=30.0,
                   help="span: this many seconds either side of the onset, or the job's last "
                        "2 x this many seconds (default 30)")
    p.add_argument("--limit", type=int, default=1_000_000, help="rows per kind at most")
    p.add_argument("--out", "-o", default="", help="trace file (default <job>.perfetto-trace)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from diagnosis.export import perfetto
    from diagnosis.export.records import job_span, load
    from diagnosis.page.data import load as load_incident
    from diagnosis.page.data import topology
    from rankwatch.commands.report import settings_query
    from streams.db import ClickHouseError

    if args.seconds <= 0 or args.limit <= 0:
        print("rankwatch export: --seconds and --limit must be > 0", file=sys.stderr)
        return 2
    query = settings_query(settings)
    half = int(args.seconds * SECOND)
    try:
        if args.around:
            inc = load_incident(query, args.around, bins=1)
            if inc is None or inc.latest.job_id != args.job:
                print(f"rankwatch export: no incident {args.around!r} of job {args.job!r} is "
                      "stored", file=sys.stderr)
                return 1
            t0, t1 = inc.onset_ns - half, inc.onset_ns + half
        else:
            bounds = job_span(query, args.job)
            if bounds is None:
                print(f"rankwatch export: job {args.job!r} has no ops stored", file=sys.stderr)
                return 1
            t1 = bounds[1] + SECOND
            t0 = max(bounds[0], t1 - 2 * half)
        span = load(query, args.job, t0, t1, args.limit)
        _world, hosts = topology(query, args.job)
    except (ClickHouseError, RuntimeError) as e:
        print(f"rankwatch export: cannot read the job: {e}", file=sys.stderr)
        return 1
    b = perfetto.TraceBuilder()
    for r, h in enumerate(hosts):
        b.rank_names[r] = f"rank {r} · {h}"
    perfetto.add_ops(b, span.ops, t1)
    perfetto.add_stages(b, span.stages)
    perfetto.add_kernels(b, span.kernels)
    if not b.slices:
        print(f"rankwatch export: job {args.job!r} has no ops, stages or kernels in the span; "
              "nothing written", file=sys.stderr)
        return 1
    out = Path(args.out or f"{args.job}.perfetto-trace")
    data = b.to_bytes()
    try:
        out.write_bytes(data)
    except OSError as e:
        print(f"rankwatch export: cannot write {out}: {e.strerror}", file=sys.stderr)
        return 1
    info = {"file": str(out.resolve()), "bytes": len(data), "slices": b.slices,
            "ranks": b.ranks(), "tracks": b.track_count(),
            "t0_ns": t0, "t1_ns": t1, "truncated": span.truncated}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"wrote {out}: {b.slices:,} slices on {info['tracks']} tracks of {info['ranks']} "
              f"ranks ({len(data):,} bytes); open it in https://ui.perfetto.dev")
        if span.truncated:
            print(f"  capped at --limit {args.limit:,} rows: {', '.join(span.truncated)}",
                  file=sys.stderr)
    return 0
