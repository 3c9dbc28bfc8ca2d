"""Scale-out: 1, 2 and 3 workers sharing the jobs, each job owned by one (streams/ownership.py).

    rankwatch bench scale [--workers 1,2,3] [--big-steps 3] [--small-jobs 16]
                          [--small-steps 30] [--no-kill] [--json]

For each worker count N it starts a private stack the way `rankwatch up --workers N` does — a
Kafka broker, the store process that owns the embedded ClickHouse and serves it over ClickHouse's
HTTP interface, N workers reaching it as a server (also for N = 1, so every N pays the same
per-record path) — waits until the workers have split the partitions, and then:

1. **one big job**: a simulated 1,024-rank job (TP 8 × PP 4 × DP 32, `--big-steps` steps;
   3 steps: 0.77 M records);
2. **many small jobs**: `--small-jobs` simulated 8-rank jobs (`--small-steps` steps each;
   16 x 30 steps: 0.85 M records);
3. **kill** (N ≥ 2, unless `--no-kill`): an 8-rank job in real time hangs 4 s in; once its
   incident is announced, the worker that owns it is SIGKILLed; reported: the seconds from the
   kill to the next diagnosis of that job on rw.diagnoses (the survivor's, after it took the job
   over), against the consumer group's session timeout that bounds it from below.

For 1 and 2 the jobs are simulated first; then every batch is published at once (keyed by job)
and it measures, from the first batch published until every raw row is stored and the workers
have been idle for `QUIET_S` (derived windows and diagnosis included), the CPU seconds of each
worker and of the store (/proc), and reports records per worker CPU-second (all raw records /
the workers' CPU seconds; per-record cost that does not grow with N keeps it flat), the same net
of the workers' idle CPU rate (sampled for `IDLE_S` before: timers, heartbeats, which grow with
N whatever the load), the store's CPU per million records and the wall time. Raw rows stored
are counted against the simulator's own counts (a difference is reported, not hidden).

A job is owned by one worker: the big job's records all go to its home partition, so with N
workers one of them does its work and the others idle; the 16 small jobs spread over them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer
from prometheus_client.parser import text_string_to_metric_families

from diagnosis.model import Diagnosis
from ingest.keys import batch_key
from ingest.publish import BatchPublisher
from ingest.records import MODELS
from ingest.sim.config import JobConfig
from ingest.sim.runner import KafkaSink
from ingest.sim.simulation import Simulation
from rankwatch import stack
from rankwatch.daemon import Daemon
from rankwatch.kafka.admin import ensure_topics
from rankwatch.kafka.broker import Broker
from rankwatch.kafka.jars import ensure_jars
from rankwatch.settings import Settings
from streams.db import Database
from streams.ownership import job_partition

PARTITIONS = 6
SESSION_S = 6.0
#: Idle this long after the last row is stored: past the windows' idle close (streams/windows.py,
#: `idle_ns`, 10 s), so the job's last derived windows are in the measured CPU.
QUIET_S = 12.0
#: How long the idle workers' CPU rate is sampled before each workload.
IDLE_S = 5.0
_ASSIGNED = re.compile(r"assigned partitions \[([0-9, ]*)\] of (\d+) of (\S+?):")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    workers: int
    workload: str
    records: int
    stored: int
    wall_s: float
    worker_cpu_s: list[float]
    store_cpu_s: float
    records_per_worker_cpu_s: float
    store_cpu_s_per_m_records: float
    #: the workers' CPU seconds per second before the records came (timers, heartbeats)
    idle_cpu_per_s: float
    #: records per worker CPU-second above that idle rate: the per-record cost alone
    records_per_net_worker_cpu_s: float
    #: each worker's CPU spent diagnosing meanwhile (`rankwatch_analysis_cpu_seconds_total`):
    #: the owner's sweeps of the big job, paced by wall time (a share of a core every
    #: `sweep_s`) over whatever is stored by then, not by the records
    analysis_cpu_s: list[float] = field(default_factory=list)
    #: records per worker CPU-second outside diagnosis: storing, windows, kernel summaries
    records_per_ingest_cpu_s: float = 0.0


@dataclass
class Kill:
    workers: int
    kill_to_diagnosis_s: float | None
    session_timeout_s: float
    announced_incidents: int


@dataclass
class Scaling:
    """One workload at one worker count over its repeats, against one worker's."""
    workload: str
    workers: int
    repeats: int
    #: median records per worker CPU-second, gross and net of idle
    median: float
    median_net: float
    #: those medians over one worker's (1.0: per-record cost flat in the workers)
    ratio: float
    ratio_net: float
    #: the same outside diagnosis (`Run.records_per_ingest_cpu_s`)
    median_ingest: float = 0.0
    ratio_ingest: float = 0.0
    #: gross, each run over the one-worker run of the workload just before it (interleaved
    #: turns: `--workers 1,3,1,3`): how far the machine's drift moves one comparison
    pair_ratios: list[float] = field(default_factory=list)


@dataclass
class Report:
    runs: list[Run] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    scaling: list[Scaling] = field(default_factory=list)
    cores: int = field(default_factory=lambda: os.cpu_count() or 0)


def scaling(runs: list[Run]) -> list[Scaling]:
    """Per workload and worker count, the median of its repeats and its ratio to one worker's
    median (none without a one-worker run of that workload). Medians, because on a few shared
    cores one run's CPU cost moves by ±15 %: repeat the counts interleaved (`--workers
    1,3,1,3,1,3`) so that the machine's drift falls on both sides."""
    out = []
    loads = dict.fromkeys(r.workload for r in runs)
    pairs: dict[tuple[str, int], list[float]] = {}
    last_one: dict[str, Run] = {}
    for r in runs:
        if r.workers == 1:
            last_one[r.workload] = r
        elif r.workload in last_one and last_one[r.workload].records_per_worker_cpu_s:
            pairs.setdefault((r.workload, r.workers), []).append(round(
                r.records_per_worker_cpu_s / last_one[r.workload].records_per_worker_cpu_s, 3))
    for load in loads:
        by_n: dict[int, list[Run]] = {}
        for r in runs:
            if r.workload == load:
                by_n.setdefault(r.workers, []).append(r)
        if 1 not in by_n:
            continue
        one = float(np.median([r.records_per_worker_cpu_s for r in by_n[1]]))
        one_net = float(np.median([r.records_per_net_worker_cpu_s for r in by_n[1]]))
        one_ingest = float(np.median([r.records_per_ingest_cpu_s for r in by_n[1]]))
        for n, rs in sorted(by_n.items()):
            med = float(np.median([r.records_per_worker_cpu_s for r in rs]))
            net = float(np.median([r.records_per_net_worker_cpu_s for r in rs]))
            ingest = float(np.median([r.records_per_ingest_cpu_s for r in rs]))
            out.append(Scaling(load, n, len(rs), round(med), round(net),
                               round(med / one, 3) if one else 0.0,
                               round(net / one_net, 3) if one_net else 0.0,
                               round(ingest), round(ingest / one_ingest, 3) if one_ingest
                               else 0.0, pairs.get((load, n), [])))
    return out


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of `pid` (all its threads), 0 when it is gone."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def analysis_cpu(port: int) -> float:
    """The worker's `rankwatch_analysis_cpu_seconds_total`, all kinds of work, from its
    /metrics on `port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text)
               if fam.name == "rankwatch_analysis_cpu_seconds" for s in fam.samples
               if s.name.endswith("_total"))


def assignments(d: Daemon, ops_topic: str) -> set[int] | None:
    last = None
    for m in _ASSIGNED.finditer(d.log_file.read_text(errors="replace")):
        if m.group(3) == ops_topic:
            last = {int(p) for p in m.group(1).split(",") if p.strip()}
    return last


def wait_split(settings: Settings, n: int, timeout: float = 120) -> list[set[int]]:
    daemons = stack.worker_daemons(settings)[:n]
    deadline = time.monotonic() + timeout
    got: list[set[int] | None] = []
    while time.monotonic() < deadline:
        got = [assignments(d, settings.topics.ops) for d in daemons]
        parts = [g for g in got if g]
        if len(parts) == n and sum(len(g) for g in parts) == PARTITIONS \
                and set().union(*parts) == set(range(PARTITIONS)):
            return parts
        time.sleep(0.5)
    raise RuntimeError(f"the {n} workers did not split the partitions: {got}")


def stored_rows(db: Database, jobs: list[str]) -> int:
    total = 0
    for kind in MODELS:
        r = db.query(f"SELECT count() FROM {kind} WHERE job_id IN {{j:Array(String)}}",
                     {"j": jobs})
        total += int(r.result_rows[0][0])
    return total


def idle_rate(pids: list[int | None], seconds: float = IDLE_S) -> float:
    """The workers' CPU seconds per wall second, all together, while no record arrives."""
    c0, t0 = sum(cpu_s(p) for p in pids), time.monotonic()
    time.sleep(seconds)
    return (sum(cpu_s(p) for p in pids) - c0) / (time.monotonic() - t0)


def measure(settings: Settings, n: int, workload: str, cfgs: list[JobConfig],
            progress: Any, metrics_ports: list[int]) -> Run:
    """Simulate the jobs first (outside the measurement), then publish every batch at once,
    keyed as the simulator's own sink does (ingest/keys.py), and measure until stored and
    idle."""
    batches: list[tuple[str, str, bytes]] = []
    published = 0
    epoch = time.time_ns()
    for cfg in cfgs:
        sim = Simulation(cfg.with_(epoch_ns=epoch))
        batches += [(batch_key(kind, cfg.job_id, producer), kind, data)
                    for _, kind, producer, data in sim.uploads(framing=KafkaSink.framing)]
        published += int(sim.rows)
    workers = [d.pid() for d in stack.worker_daemons(settings)[:n]]
    store_pid = stack.store_daemon(settings).pid()
    idle = idle_rate(workers)
    cpu0 = [cpu_s(p) for p in workers]
    analysis0 = [analysis_cpu(port) for port in metrics_ports]
    store0 = cpu_s(store_pid)
    t0 = time.monotonic()
    pub = BatchPublisher(settings.bootstrap, settings.topics)
    for key, kind, data in batches:
        pub.publish(kind, data, key=key)
    if pub.flush(120):
        raise RuntimeError(f"{workload}: batches not delivered: {pub.stats.errors[:3]}")
    progress(f"  {workload}: published {published:,} records in {time.monotonic() - t0:.1f} s")
    jobs = [c.job_id for c in cfgs]
    stored = 0
    with Database(stack.store_url(settings), settings.clickhouse_database, create=False) as db:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            stored = stored_rows(db, jobs)
            if stored >= published:
                break
            time.sleep(1.0)
    last, quiet_since = sum(cpu_s(p) for p in workers), time.monotonic()
    while time.monotonic() - quiet_since < QUIET_S and time.monotonic() - t0 < 900:
        time.sleep(0.5)
        now = sum(cpu_s(p) for p in workers)
        if now - last > 0.1 * n * 0.5:  # busier than 10 % of a core per worker
            quiet_since = time.monotonic()
        last = now
    span = time.monotonic() - t0  # the CPU below is counted over all of it, quiet tail too
    wall = span - QUIET_S
    used = [cpu_s(p) - c for p, c in zip(workers, cpu0, strict=True)]
    analysis = [analysis_cpu(port) - a for port, a in zip(metrics_ports, analysis0, strict=True)]
    store = cpu_s(store_pid) - store0
    total = sum(used)
    net = total - idle * span
    ingest = total - sum(analysis)
    run = Run(n, workload, published, stored, round(wall, 1), [round(u, 2) for u in used],
              round(store, 2), round(published / total) if total else 0.0,
              round(store / published * 1e6, 2) if published else 0.0,
              round(idle, 3), round(published / net) if net > 0 else 0.0,
              [round(a, 2) for a in analysis], round(published / ingest) if ingest > 0 else 0.0)
    progress(f"  {workload}: {run.records_per_worker_cpu_s:,.0f} records per worker CPU-s "
             f"(workers {run.worker_cpu_s} CPU-s, of it diagnosing {run.analysis_cpu_s}; "
             f"{run.records_per_ingest_cpu_s:,.0f} outside diagnosis; store "
             f"{run.store_cpu_s} CPU-s), stored {stored:,}/{published:,}")
    return run


def kill_owner(settings: Settings, n: int, split: list[set[int]], progress: Any) -> Kill:
    job = f"kill-{n}-{uuid.uuid4().hex[:6]}"
    home = job_partition(job, PARTITIONS)
    daemons = stack.worker_daemons(settings)[:n]
    owner = next(i for i, parts in enumerate(split) if home in parts)
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"bench-{job}",
                  "auto.offset.reset": "earliest"})
    c.subscribe([settings.topics.diagnoses])
    sim = subprocess.Popen(
        [sys.executable, "-m", "rankwatch.cli", "simulate", "--tp", "2", "--pp", "2", "--dp", "2",
         "--steps", "30", "--job-id", job, "--fault", "hang rank=5 stage=bwd mb=2 at=4s",
         "--speed", "realtime", "--out", "kafka", "--quiet"], env=stack.child_env(settings),
        stdout=subprocess.DEVNULL)
    killed_at: float | None = None
    after: float | None = None
    incidents: set[str] = set()
    try:
        # the hang's incident stays open after the job's records end: wait for it whatever
        # the simulator's state (on a loaded machine it may come after the last record)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and after is None:
            m = c.poll(0.2)
            if m is None or m.error():
                continue
            d = Diagnosis.model_validate_json(m.value() or b"{}")
            if d.job_id != job:
                continue
            incidents.add(d.incident_id)
            if killed_at is None:
                pid = daemons[owner].pid()
                if pid is not None:
                    os.killpg(pid, signal.SIGKILL)
                killed_at = time.monotonic()
                progress(f"  kill: incident announced; SIGKILLed worker {owner + 1} (the job's "
                         "owner)")
            else:
                after = time.monotonic() - killed_at
    finally:
        sim.kill()
        sim.wait()
        c.close()
    k = Kill(n, round(after, 1) if after is not None else None, SESSION_S, len(incidents))
    progress(f"  kill: next diagnosis {k.kill_to_diagnosis_s} s after the kill (session "
             f"timeout {SESSION_S:.0f} s), {k.announced_incidents} incident(s)")
    return k


def one_count(n: int, broker: Broker, base: Path, args: argparse.Namespace,
              progress: Any, turn: int = 0) -> tuple[list[Run], Kill | None]:
    """One stack of `n` workers, its own home and topics; `turn` tells repeated counts apart."""
    home = base / f"w{turn}-{n}"
    settings = Settings.load(env={}, home=home, kafka_bootstrap=broker.bootstrap,
                             kafka_port=broker.settings.kafka_port,
                             topic_prefix=f"s{n}{uuid.uuid4().hex[:8]}",
                             kafka_partitions=PARTITIONS, kafka_session_timeout_s=SESSION_S,
                             store_port=stack.free_port(), sql_port=stack.free_port(),
                             store_token=uuid.uuid4().hex, metrics_port=0, page_port=0)
    ensure_topics(broker.bootstrap, settings.topics.specs(PARTITIONS))
    runs: list[Run] = []
    kill = None
    try:
        progress(f"{n} worker(s): starting the store and the workers…")
        ports = [stack.free_port() for _ in range(n)]  # every worker's /metrics
        stack.start_workers(settings, n, lambda m: None, 180, metrics_ports=ports)
        split = wait_split(settings, n)
        progress(f"{n} worker(s): partitions {split}")
        big = JobConfig(job_id=f"big-{n}-{turn}", tp=8, pp=4, dp=32, steps=args.big_steps, seed=3,
                        uploaders=args.uploaders)
        runs.append(measure(settings, n, "1 job x 1,024 ranks", [big], progress, ports))
        small = [JobConfig(job_id=f"small-{n}-{turn}-{i}", tp=2, pp=2, dp=2,
                           steps=args.small_steps, seed=i) for i in range(args.small_jobs)]
        if small:  # `--small-jobs 0`: the big job alone
            runs.append(measure(settings, n, f"{args.small_jobs} jobs x 8 ranks", small,
                                progress, ports))
        if n >= 2 and not args.no_kill:
            kill = kill_owner(settings, n, split, progress)
    finally:
        stack.down(settings, progress=lambda m: None)
    return runs, kill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rankwatch bench scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,3",
                    help="worker counts, comma-separated; repeat them interleaved (1,3,1,3) "
                    "for medians")
    ap.add_argument("--big-steps", type=int, default=3)
    ap.add_argument("--uploaders", type=int, default=16,
                    help="producers the big job's 128 hosts publish as (ingest/keys.py)")
    ap.add_argument("--small-jobs", type=int, default=16)
    ap.add_argument("--small-steps", type=int, default=30)
    ap.add_argument("--no-kill", action="store_true", help="skip the kill measurement")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    args = ap.parse_args(argv)
    try:
        counts = [int(x) for x in args.workers.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--workers {args.workers!r}: expected numbers such as 1,2,3")
    if not counts or any(not 1 <= c <= PARTITIONS for c in counts):
        ap.error(f"--workers: each count from 1 to {PARTITIONS}")
    if args.big_steps < 1 or args.small_jobs < 0 or args.small_steps < 1 or args.uploaders < 1:
        ap.error("--big-steps, --small-steps and --uploaders take 1 or more; --small-jobs 0 "
                 "or more")

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    report = Report()
    with tempfile.TemporaryDirectory(prefix="rankwatch-scale-") as tmp:
        base = Path(tmp)
        bs = Settings.load(env={}, home=base / "kafka", kafka_port=stack.free_port(),
                           kafka_controller_port=stack.free_port())
        broker = Broker(bs, ensure_jars(bs, progress))
        broker.start(timeout=120, progress=progress)
        try:
            for turn, n in enumerate(counts):
                runs, kill = one_count(n, broker, base, args, progress, turn)
                report.runs += runs
                if kill is not None:
                    report.kills.append(kill)
        finally:
            broker.stop()
    report.scaling = scaling(report.runs)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(f"{'workers':>7}  {'workload':<22}{'records':>11}{'stored':>11}{'wall s':>8}"
              f"{'rec/worker CPU-s':>18}{'net of idle':>13}{'outside diag.':>15}"
              f"{'store CPU-s/M':>15}  worker CPU-s (of it diagnosing)")
        for r in report.runs:
            print(f"{r.workers:>7}  {r.workload:<22}{r.records:>11,}{r.stored:>11,}"
                  f"{r.wall_s:>8}{r.records_per_worker_cpu_s:>18,.0f}"
                  f"{r.records_per_net_worker_cpu_s:>13,.0f}"
                  f"{r.records_per_ingest_cpu_s:>15,.0f}"
                  f"{r.store_cpu_s_per_m_records:>15}  {r.worker_cpu_s} ({r.analysis_cpu_s})")
        if report.scaling:
            print(f"\n{'workers':>7}  {'workload':<22}{'repeats':>8}{'median':>10}"
                  f"{'/ 1 worker':>12}{'net median':>12}{'/ 1 worker':>12}"
                  f"{'outside diag.':>15}{'/ 1 worker':>12}  pair by pair")
            for g in report.scaling:
                print(f"{g.workers:>7}  {g.workload:<22}{g.repeats:>8}{g.median:>10,.0f}"
                      f"{g.ratio:>12}{g.median_net:>12,.0f}{g.ratio_net:>12}"
                      f"{g.median_ingest:>15,.0f}{g.ratio_ingest:>12}  "
                      f"{', '.join(map(str, g.pair_ratios))}")
        for k in report.kills:
            print(f"{k.workers} workers, owner killed mid-incident: next diagnosis after "
                  f"{k.kill_to_diagnosis_s} s (session timeout {k.session_timeout_s:.0f} s); "
                  f"{k.announced_incidents} incident(s) announced")
    bad = any(r.stored != r.records for r in report.runs) \
        or any(k.announced_incidents != 1 for k in report.kills)
    return 1 if bad else 0
