"""`rankwatch publish`: publish synthetic op records to the broker from this process."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ingest.batch import encode_batch
from ingest.publish import BatchPublisher
from ingest.synthetic import ops_batches
from rankwatch.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("publish", help="publish synthetic op records (smoke tests, demo)")
    p.add_argument("--job", default="demo", help="job_id (default demo)")
    p.add_argument("--ranks", type=int, default=8, help="ranks in the job (default 8)")
    p.add_argument("--records", type=int, default=64, help="op records to publish (default 64)")
    p.add_argument("--batch-rows", type=int, default=4096, help="records per message")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.ranks < 1 or args.records < 0 or args.batch_rows < 1:
        print("rankwatch publish: --ranks and --batch-rows must be >= 1, --records >= 0",
              file=sys.stderr)
        return 2
    pub = BatchPublisher(settings.bootstrap, settings.topics)
    t0 = time.time_ns()
    start = time.perf_counter()
    for seq, cols in enumerate(ops_batches(args.ranks, args.records, args.batch_rows, t0)):
        data = encode_batch("ops", args.job, cols, producer="rankwatch-publish", seq=seq)
        pub.publish("ops", data, key=args.job)
    left = pub.flush(30)
    elapsed = time.perf_counter() - start
    summary = {"job_id": args.job, "records": args.records, "messages": pub.stats.sent,
               "delivered": pub.stats.delivered, "undelivered": left,
               "failed": pub.stats.failed, "seconds": round(elapsed, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"published {args.records} op records of job {args.job!r} in "
              f"{pub.stats.sent} message(s) to {settings.topics.ops} in {elapsed:.2f}s")
    if left or pub.stats.failed:
        print(f"rankwatch publish: {left} undelivered, {pub.stats.failed} failed: "
              f"{pub.stats.errors[:3]} — is the broker up at {settings.bootstrap}? "
              "(`rankwatch status`)", file=sys.stderr)
        return 1
    return 0
