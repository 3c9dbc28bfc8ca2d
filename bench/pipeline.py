"""The whole ingest path under a simulated job: simulator process -> broker -> worker -> ClickHouse.

    rankwatch bench pipeline [--tp 8 --pp 4 --dp 32 --steps 12] [--raw-only] [--json]

Starts a private local stack (same code as `rankwatch up`), runs `rankwatch simulate --speed max
--out kafka` as a separate process (a 1,024-rank job by default: ops, flows, chunks, stages,
kernels, wr, beats), and polls the worker's SQL endpoint until every record is queryable and the
derived tables (progress, iterations, kernel summaries) have rows for the job (windows of 1 s,
2 s and 4 s here, so they close within a job of a few simulated seconds). Reports:

- records and kernel events, wall time from the first record published to the last queryable;
- the worker's own CPU time over that span (utime + stime of the worker process, from /proc), and
  records per worker CPU-second — the "per worker core" figure, independent of how busy the
  publisher and the broker kept the machine's other core. It covers everything the worker does
  meanwhile: the raw ingest, the derived windows and diagnosis (and the bench's own polling
  queries through the SQL endpoint).

`--raw-only` runs, instead of `rankwatch worker`, a worker with the raw agents alone (the same
streams.app.StreamsApp over the same store, no derived runner, no diagnosis agents): its CPU time
is the ingest path's own, broker to ClickHouse.

Everything it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.ingest import sql
from rankwatch import stack
from rankwatch.daemon import Daemon, tail
from rankwatch.settings import Settings

RAW = ("ops", "flows", "chunks", "stages", "kernels", "wr", "beats")


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (fields 14 and 15 of /proc/<pid>/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counts(settings: Settings, job: str) -> dict[str, int]:
    union = " UNION ALL ".join(
        f"SELECT '{k}', count() FROM {k} WHERE job_id = '{job}'" for k in RAW)
    out = sql(settings, union)
    return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines())}


def serve_raw() -> int:
    """A worker with the raw agents only (`--raw-only`): settings from the environment."""
    import faust

    from streams.app import AppConfig, StreamsApp
    from streams.db import Database, migrate
    from streams.sql_endpoint import start_sql_endpoint
    from streams.store import ClickHouseStore
    from streams.writer import ClickHouseWriter

    settings = Settings.load()
    db = Database(settings.clickhouse, settings.clickhouse_database)
    migrate(db)
    cfg = AppConfig(app_id=f"rankwatch-{settings.topic_prefix}", bootstrap=settings.bootstrap,
                    topics=settings.topics, max_messages=settings.writer_max_messages,
                    within_s=settings.writer_max_seconds,
                    latency_within_s=settings.writer_latency_seconds)
    sapp = StreamsApp(cfg, ClickHouseStore(ClickHouseWriter(db)))

    async def serve_sql() -> None:
        await start_sql_endpoint(db, settings.bind_host, settings.sql_port)

    sapp.app.task(serve_sql)
    try:
        faust.Worker(sapp.app, loglevel="warning", quiet=True,
                     override_logging=False).execute_from_commandline()
    except SystemExit:
        pass
    finally:
        db.close()
    return 0


def _start_raw_worker(settings: Settings, log: object) -> Daemon:
    d = Daemon("raw-worker", settings.run_dir / "raw-worker.pid",
               settings.home / "logs" / "raw-worker.log", marker="bench.pipeline")
    pid = d.start([sys.executable, "-m", "bench.pipeline", "--serve-raw"],
                  env=stack.child_env(settings), cwd=settings.home)
    if callable(log):
        log(f"raw worker: starting (pid {pid})")
    deadline = time.time() + 120
    while stack.ping_worker(settings):
        if d.exited() is not None or time.time() > deadline:
            d.stop(5)
            raise RuntimeError(f"raw worker did not start: {tail(d.log_file)}")
        time.sleep(0.25)
    return d


def run(args: argparse.Namespace, home: Path, say: object) -> dict[str, object]:
    log = say if callable(say) else (lambda m: None)
    # windows short enough to close inside a job of a few simulated seconds
    settings = stack.private_settings(home, topic_prefix="benchp", iteration_window_s=2.0,
                                      kernel_window_s=4.0)
    raw_worker = None
    try:
        stack.up(settings, progress=log, worker=not args.raw_only)
        raw_worker = _start_raw_worker(settings, log) if args.raw_only else None
        pid = raw_worker.pid() if raw_worker else stack.worker_daemon(settings).pid()
        assert pid is not None
        job = f"benchp-{int(time.time())}"
        cpu0, t0 = cpu_seconds(pid), time.time()
        log(f"simulating tp{args.tp}·pp{args.pp}·dp{args.dp}, {args.steps} steps, max speed…")
        sim = subprocess.run(
            [sys.executable, "-m", "rankwatch.cli", "simulate", "--tp", str(args.tp), "--pp",
             str(args.pp), "--dp", str(args.dp), "--steps", str(args.steps), "--job-id", job,
             "--speed", "max", "--out", "kafka", "--json", "--quiet"],
            env=stack.child_env(settings), capture_output=True, text=True, timeout=1800)
        if sim.returncode:
            raise RuntimeError(f"simulate failed: {sim.stderr.strip()[-2000:]}")
        t_published = time.time()
        summary = json.loads(sim.stdout)
        expected = int(summary["rows"])  # raw records; the topology is not counted in rows
        got: dict[str, int] = {}
        last = 0.0
        while sum(got.values()) < expected:
            got = counts(settings, job)
            if time.time() - last > 3:
                log(f"  {sum(got.values()):,} / {expected:,} records queryable")
                last = time.time()
            if time.time() - t_published > 900:
                raise RuntimeError(f"only {sum(got.values())} of {expected} stored after 900 s")
            time.sleep(0.2)
        t_stored, cpu_stored = time.time(), cpu_seconds(pid)
        if sum(got.values()) != expected:
            raise RuntimeError(f"{sum(got.values())} records stored, {expected} published: "
                               "some were stored twice")
        derived: dict[str, int] = {}
        while not args.raw_only and time.time() - t_stored < 120:
            derived = {t: int(sql(settings, f"SELECT count() FROM {t} WHERE job_id = '{job}'"))
                       for t in ("progress", "iterations", "kernel_summaries")}
            if all(derived.values()):
                break
            time.sleep(0.5)
        wall = t_stored - t0
        worker_cpu = cpu_stored - cpu0
        records = sum(got.values())
        return {
            "ranks": summary["world"], "steps": args.steps, "records": records,
            "by_kind": got, "kernel_events": got["kernels"],
            "simulate_wall_s": round(t_published - t0, 2),
            "end_to_end_s": round(wall, 2),
            "end_to_end_records_per_s": round(records / wall),
            "worker_cpu_s": round(worker_cpu, 2),
            "records_per_worker_cpu_s": round(records / worker_cpu) if worker_cpu else None,
            "worker_cpu_us_per_record": round(1e6 * worker_cpu / records, 3) if records else None,
            "derived_rows": derived,
            "derived_ready_after_stored_s": round(time.time() - t_stored, 2),
        }
    finally:
        if raw_worker is not None:
            raw_worker.stop(30)
        stack.down(settings, progress=log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench pipeline",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--dp", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--raw-only", action="store_true",
                   help="a worker with the raw agents only: the ingest path's own CPU")
    p.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.serve_raw:
        return serve_raw()

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-") as home:
        res = run(args, Path(home), say)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"pipeline: {res['ranks']:,}-rank simulated job, {res['steps']} steps, "
          f"{res['records']:,} records ({res['kernel_events']:,} kernel events)")
    print("  by kind: " + ", ".join(f"{k} {v:,}" for k, v in res["by_kind"].items()))  # type: ignore[attr-defined]
    print(f"  first record published to last queryable: {res['end_to_end_s']} s, "
          f"{res['end_to_end_records_per_s']:,} records/s (simulator, broker and worker "
          "share the machine)")
    what = ("the raw agents alone" if args.raw_only
            else "ingest, derived streams and diagnosis together")
    print(f"  worker CPU {res['worker_cpu_s']} s: {res['records_per_worker_cpu_s']:,} records per "
          f"worker CPU-second ({res['worker_cpu_us_per_record']} µs per record; {what})")
    if not args.raw_only:
        print(f"  derived rows {res['derived_rows']} ready {res['derived_ready_after_stored_s']} "
              "s after the last raw record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
