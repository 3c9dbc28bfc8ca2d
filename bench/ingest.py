"""End-to-end ingest: records/s through broker -> Faust worker -> ClickHouse.

    rankwatch bench ingest [--records 1000000] [--batch-rows 10000] [--json]

Starts a private local stack (same code as `rankwatch up`, in a temporary home on free ports),
publishes `--records` op records from a *separate process* (`rankwatch publish`), and polls the
worker's SQL endpoint until every record is queryable. Reports:

- publish rate (records/s the producer process pushed into the broker),
- end-to-end rate: records / (last record queryable - first record published),
- drain time: last record queryable - last record acknowledged by the broker.

Everything it started is stopped at the end, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rankwatch import http, stack
from rankwatch.settings import Settings


def sql(settings: Settings, query: str) -> str:
    return http.post(f"http://{settings.bind_host}:{settings.sql_port}/", query.encode(),
                     timeout=30).body.decode().strip()


def run(records: int, batch_rows: int, home: Path, log: bool) -> dict[str, float]:
    settings = stack.private_settings(home, topic_prefix="bench")

    def say(message: str) -> None:
        if log:
            print(message, file=sys.stderr)

    try:
        stack.up(settings, progress=say)
        job = f"bench-{int(time.time())}"
        say(f"publishing {records:,} op records from a separate process…")
        t0 = time.time()
        pub = subprocess.run(
            [sys.executable, "-m", "rankwatch.cli", "publish", "--job", job, "--ranks", "1024",
             "--records", str(records), "--batch-rows", str(batch_rows), "--json"],
            env=stack.child_env(settings), capture_output=True, text=True, timeout=900)
        t_published = time.time()
        if pub.returncode:
            raise RuntimeError(f"publisher failed: {pub.stderr.strip()}")
        stored, last_report = 0, 0.0
        while stored < records:
            stored = int(sql(settings, f"SELECT count() FROM ops WHERE job_id = '{job}'"))
            if time.time() - last_report > 2:
                say(f"  {stored:,} / {records:,} queryable")
                last_report = time.time()
            if stored < records:
                if time.time() - t_published > 600:
                    raise RuntimeError(f"only {stored} of {records} records stored after 600 s")
                time.sleep(0.05)
        t_done = time.time()
        return {
            "records": records,
            "batch_rows": batch_rows,
            "publish_s": round(t_published - t0, 3),
            "publish_records_per_s": round(records / (t_published - t0)),
            "end_to_end_s": round(t_done - t0, 3),
            "end_to_end_records_per_s": round(records / (t_done - t0)),
            "drain_after_publish_s": round(t_done - t_published, 3),
        }
    finally:
        stack.down(settings, progress=say)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench ingest", description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--batch-rows", type=int, default=10_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-") as home:
        res = run(args.records, args.batch_rows, Path(home), log=not args.json)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"ingest: {res['records']:,} op records, {res['batch_rows']:,} per message")
        print(f"  publish (separate process): {res['publish_s']:.2f} s, "
              f"{res['publish_records_per_s']:,.0f} records/s")
        print(f"  broker -> Faust -> ClickHouse, first publish to last queryable: "
              f"{res['end_to_end_s']:.2f} s, {res['end_to_end_records_per_s']:,.0f} records/s")
        print(f"  last record queryable {res['drain_after_publish_s']:.2f} s after the publisher "
              "finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
