"""`rankwatch replay FILE`: publish a capture file (`rankwatch agent --capture`) to the broker.

The batches go to their kinds' raw topics with the keys the agent gave them, so the worker stores
them exactly as if the agent had been connected. The worker's exactly-once storage is per Kafka
message, and a second replay makes new messages: so a successful replay is noted beside the file
(`FILE.replayed.json`, per broker and topic set) and a second replay to the same place is refused
unless `--force` (its records would be stored twice).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from ingest.agent.capture import CaptureError, read_capture
from ingest.publish import BatchPublisher
from rankwatch.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("replay", help="publish a capture file written by `agent --capture`",
                       description=__doc__)
    p.add_argument("file", help="the capture file")
    p.add_argument("--force", action="store_true",
                   help="replay even if this file was replayed to this broker before")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run)


def _target(settings: Settings) -> str:
    return f"{settings.bootstrap}/{settings.topics.ops}"


def _done_before(note: Path, target: str) -> str | None:
    try:
        done = json.loads(note.read_text())
    except (OSError, ValueError):
        return None
    when = done.get(target) if isinstance(done, dict) else None
    return str(when) if when else None


def run(args: argparse.Namespace, settings: Settings) -> int:
    note = Path(f"{args.file}.replayed.json")
    target = _target(settings)
    when = _done_before(note, target)
    if when and not args.force:
        print(f"rankwatch replay: {args.file} was replayed to {target} at {when}; a second "
              "replay would store its records twice (--force to do it anyway)", file=sys.stderr)
        return 2
    truncated: list[int] = []
    pub = BatchPublisher(settings.bootstrap, settings.topics, block_s=30.0)
    batches: Counter[str] = Counter()
    size = 0
    t0 = time.perf_counter()
    try:
        for i, frame in enumerate(read_capture(args.file, truncated.append)):
            try:
                settings.topics.for_kind(frame.kind)
            except AttributeError:
                print(f"rankwatch replay: batch {i} has unknown kind {frame.kind!r}; skipped",
                      file=sys.stderr)
                continue
            if not pub.publish(frame.kind, frame.data, key=frame.key):
                print(f"rankwatch replay: the client refused batch {i}: "
                      f"{pub.stats.errors[-1:]}", file=sys.stderr)
                return 1
            batches[frame.kind] += 1
            size += len(frame.data)
    except (OSError, CaptureError) as e:
        print(f"rankwatch replay: {e}", file=sys.stderr)
        return 2
    left = pub.flush(30)
    summary = {"file": args.file, "batches": dict(batches), "bytes": size,
               "undelivered": left, "failed": pub.stats.failed,
               "truncated_at": truncated[0] if truncated else None,
               "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(batches.items())) or "nothing"
        print(f"replayed {sum(batches.values())} batches ({kinds}; {size / 1e6:.1f} MB) "
              f"from {args.file} to {settings.bootstrap} in {summary['seconds']} s")
    if truncated:
        print(f"rankwatch replay: the file ends in a partial batch at byte {truncated[0]} "
              "(the agent stopped mid-write); everything before it was replayed",
              file=sys.stderr)
    if not left and not pub.stats.failed:
        try:
            done = json.loads(note.read_text()) if note.exists() else {}
            done = done if isinstance(done, dict) else {}
            done[target] = time.strftime("%Y-%m-%d %H:%M:%S")
            note.write_text(json.dumps(done))
        except (OSError, ValueError) as e:
            print(f"rankwatch replay: could not note the replay in {note}: {e}",
                  file=sys.stderr)
    if left or pub.stats.failed:
        print(f"rankwatch replay: {left} undelivered, {pub.stats.failed} failed — is the "
              f"broker up at {settings.bootstrap}? (`rankwatch status`)", file=sys.stderr)
        return 1
    return 0
