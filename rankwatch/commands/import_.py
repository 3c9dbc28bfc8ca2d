"""`rankwatch import FORMAT PATH… --job NAME`: replay existing traces through the raw topics.

Formats: kineto (PyTorch profiler traces, JSON or .json.gz), flight-recorder (PyTorch Flight
Recorder dumps, pickle or JSON), megatrace (MegaTrace's per-rank NCCL call logs, or NCCL INFO
lines with timestamps). Every file is parsed and every batch encoded and validated before the
first one is published: a malformed or truncated file is reported with its name and line, and
nothing of the import is sent.

Every import publishes the job's topology first (inferred from the communicators the files name,
or given with --tp/--pp/--dp; the line printed says which), since diagnosis looks only at jobs
with one. An import that would store nothing says why and exits 1. A file imported before into
the same job on the same broker is refused (exit 2) unless --force: its records would be stored
twice. The note of what was imported is kept in the rankwatch home (`imports.json`), keyed by the
files' content, so a renamed copy is recognised too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ingest.batch import encode_topology
from ingest.importers import flight_recorder, kineto, megatrace
from ingest.importers.common import BatchError, Collected, TraceError, encode_all, publish_all
from ingest.importers.topology import TopologyError, infer
from ingest.publish import BatchPublisher
from rankwatch.settings import Settings

PARSERS: dict[str, Callable[..., Collected]] = {
    "kineto": kineto.parse, "flight-recorder": flight_recorder.parse,
    "megatrace": megatrace.parse}
#: what each format turns into, for the message when a file holds none of it
HOLDS = {"kineto": "GPU kernels (cat: kernel events) or NCCL kernels",
         "flight-recorder": "Flight Recorder entries",
         "megatrace": "MegaTrace call lines or NCCL INFO call lines"}
TIME_COLUMNS = ("t_start", "ts")
PROGRESS_AFTER_S = 2.0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("import", help="import Kineto, Flight Recorder or NCCL-log traces",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("format", choices=sorted(PARSERS))
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    p.add_argument("--job", required=True, help="job_id the records belong to")
    p.add_argument("--rank", type=int, help="rank, when neither the file nor its name says")
    for dim in ("tp", "pp", "dp"):
        p.add_argument(f"--{dim}", type=int, metavar="N",
                       help=f"{dim.upper()} size (default: inferred from the communicators)")
    p.add_argument("--force", action="store_true",
                   help="import files already imported into this job on this broker")
    p.add_argument("--dry-run", action="store_true", help="parse and validate, publish nothing")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def collect(fmt: str, paths: list[Path], rank: int | None = None,
            progress: Callable[[str], None] | None = None,
            sizes: tuple[int | None, int | None, int | None] = (None, None, None)
            ) -> Collected:
    """Parse every file (raises TraceError on the first bad one); MegaTrace's per-rank
    streams are then linked into job-wide communicators."""
    total = Collected()
    t0 = time.perf_counter()
    for i, path in enumerate(paths, 1):
        lines: dict[str, Callable[[int, int], None]] = {}
        if fmt == "megatrace" and progress is not None:
            lines["progress"] = _line_progress(progress, path)
        part = PARSERS[fmt](path, rank, **lines)
        total.merge(part)
        if progress is not None and time.perf_counter() - t0 > PROGRESS_AFTER_S:
            n = sum(part.counts().values())
            progress(f"[{i}/{len(paths)}] {path}: {n} records "
                     f"({time.perf_counter() - t0:.1f} s so far)")
    if fmt == "megatrace":
        megatrace.link_channels(total, _same_group(sizes, total))
    return total


def _line_progress(say: Callable[[str], None], path: Path) -> Callable[[int, int], None]:
    def line(n: int, total: int) -> None:
        say(f"{path}: line {n:,} of {total:,}")

    return line


def _same_group(sizes: tuple[int | None, int | None, int | None],
                c: Collected) -> Callable[[int, int], bool] | None:
    """With all of --tp/--pp/--dp: only ranks that share a TP, DP or PP group are linked."""
    tp, pp, dp = sizes
    if not (tp and pp and dp):
        return None

    def pos(r: int) -> tuple[int, int, int]:
        return r % tp, (r // tp) % dp, r // (tp * dp)

    def allowed(a: int, b: int) -> bool:
        pa, pb = pos(a), pos(b)
        return sum(x == y for x, y in zip(pa, pb, strict=True)) >= 2

    return allowed


def _fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _notes_path(settings: Settings) -> Path:
    return Path(settings.home) / "imports.json"


def _read_notes(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _span(c: Collected) -> tuple[int, int]:
    lo, hi = 0, 0
    for table in c.cols.values():
        for k in TIME_COLUMNS:
            vals = [v for v in table.get(k, []) if v > 0]
            if vals:
                lo = min(lo or min(vals), min(vals))
                hi = max(hi, max(vals))
    return lo, hi


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _summary(args: argparse.Namespace, c: Collected, how: str, seconds: float) -> dict[str, Any]:
    lo, hi = _span(c)
    ranks = sorted({r for t in c.cols.values() for r in t.get("rank", [])})
    return {"job": args.job, "format": args.format, "files": len(args.paths),
            "records": c.counts(), "ranks": ranks, "first": _iso(lo) if lo else None,
            "last": _iso(hi) if hi else None, "span_s": round((hi - lo) / 1e9, 3),
            "topology": how, "seconds": round(seconds, 2)}


def _print_summary(s: dict[str, Any], verb: str) -> None:
    counts = ", ".join(f"{n} {k}" for k, n in s["records"].items())
    ranks = s["ranks"]
    rank_words = f"{len(ranks)} rank(s) {ranks[:16]}" + ("…" if len(ranks) > 16 else "")
    print(f"{verb} {counts} for job {s['job']!r} from {s['files']} file(s) in {s['seconds']} s")
    print(f"  ranks: {rank_words}")
    if s["first"]:
        print(f"  time span: {s['first']} .. {s['last']} ({s['span_s']} s)")
    print(f"  topology: {s['topology']}")


def _refused(args: argparse.Namespace, notes: dict[str, Any], target: str,
             prints: dict[Path, str]) -> list[str]:
    seen = []
    for path, fp in prints.items():
        when = notes.get(f"{target}|{args.job}|{fp}")
        if when:
            seen.append(f"{path} (imported {when})")
    return seen


def run(args: argparse.Namespace, settings: Settings) -> int:
    t0 = time.perf_counter()
    sizes = (args.tp, args.pp, args.dp)
    bad = [f"--{k} {v}" for k, v in zip(("tp", "pp", "dp"), sizes, strict=True)
           if v is not None and v < 1]
    if bad:
        print(f"rankwatch import: {', '.join(bad)}: sizes are at least 1", file=sys.stderr)
        return 2

    def progress(msg: str) -> None:
        print(f"rankwatch import: {msg}", file=sys.stderr, flush=True)

    target = f"{settings.bootstrap}/{settings.topics.ops}"
    notes_path = _notes_path(settings)
    notes = _read_notes(notes_path)
    try:
        prints = {p: _fingerprint(p) for p in args.paths}
    except OSError as e:
        print(f"rankwatch import: cannot read {e.filename}: {e.strerror} — nothing was "
              "published", file=sys.stderr)
        return 1
    seen = _refused(args, notes, target, prints)
    if seen and not args.force and not args.dry_run:
        print(f"rankwatch import: already imported into job {args.job!r} on {target}: "
              f"{'; '.join(seen[:4])}{'…' if len(seen) > 4 else ''}. A second import would "
              "store its records twice (--force to do it anyway)", file=sys.stderr)
        return 2

    try:
        collected = collect(args.format, args.paths, args.rank, progress, sizes)
        counts = collected.counts()
        records = {k: n for k, n in counts.items() if k != "beats"}
        if not records:
            print(f"rankwatch import: no records in {len(args.paths)} file(s): they hold no "
                  f"{HOLDS[args.format]} — is this the right format ({args.format})? "
                  "Nothing was published", file=sys.stderr)
            return 1
        inferred = infer(collected, args.job, time.time_ns(), tp=args.tp, pp=args.pp,
                         dp=args.dp)
        batches = encode_all(collected, args.job, producer=f"rankwatch-import/{args.format}")
        topo = encode_topology(inferred.topology, producer=f"rankwatch-import/{args.format}")
    except (TraceError, BatchError, TopologyError) as e:
        print(f"rankwatch import: {e} — nothing was published", file=sys.stderr)
        return 1
    summary = _summary(args, collected, inferred.how, time.perf_counter() - t0)
    if args.dry_run:
        if args.json:
            print(json.dumps(summary))
        else:
            _print_summary(summary, "would publish")
        return 0
    pub = BatchPublisher(settings.bootstrap, settings.topics, block_s=30.0)
    pub.publish("jobs", topo, key=args.job)
    if pub.flush(30):  # the topology first: the worker diagnoses only jobs that have one
        print(f"rankwatch import: the topology was not delivered — is the broker up at "
              f"{settings.bootstrap}? (`rankwatch status`). Nothing was imported",
              file=sys.stderr)
        return 1
    left = publish_all(batches, args.job, pub)
    if left or pub.stats.failed or pub.stats.dropped:
        print(f"rankwatch import: {left} undelivered, {pub.stats.failed} failed "
              f"({pub.stats.errors[:2]}) — is the broker up at {settings.bootstrap}?",
              file=sys.stderr)
        return 1
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    notes.update({f"{target}|{args.job}|{fp}": when for fp in prints.values()})
    try:
        notes_path.parent.mkdir(parents=True, exist_ok=True)
        notes_path.write_text(json.dumps(notes))
    except OSError as e:
        print(f"rankwatch import: could not note the import in {notes_path}: {e}",
              file=sys.stderr)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["batches"] = len(batches) + 1
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary, "published")
    return 0
