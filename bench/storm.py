"""Ingest pace and trigger latency with and without a storm of heavy and stuck SQL queries.

    rankwatch bench storm [--storm 12] [--limit-s 5] [--burst-dp 8] [--burst-steps 60]
                          [--hang-at 6] [--wait-s 60] [--repeat 3] [--nice 10] [--json]

Starts a private local stack (same code as `rankwatch up`; the SQL endpoint's time limit is
`--limit-s`, its concurrency and queue the defaults: 2 running, 8 waiting) and runs the same
two measurements on a quiet worker and while `--storm` threads keep the SQL endpoint at its
concurrency limit and beyond (every slot taken, the queue full, the rest refused with 503 and
sent again), `--repeat` times each, interleaved (quiet, storm, quiet, storm, ...):

- ingest pace: a simulated job's records (tp2 pp2 dp`--burst-dp`, `--burst-steps` steps) are
  published as fast as the broker takes them; records/s is their count over the time from the
  first publish to the worker's `rankwatch_records_stored` counters (its /metrics, served off
  the event loop, not through the SQL endpoint the storm holds) covering them; then the time
  until the derived windows (progress, iterations, kernel summaries) of those records closed
  (`rankwatch_derived_windows` still for `--settle-s`);
- trigger latency: an 8-rank job (tp2 pp2 dp2) published in real time, whose rank 5 hangs in
  its backward pass `--hang-at` s in; the time from the hang's onset (wall clock: the job's
  epoch is now) to the first trigger for the job on rw.triggers and to its first diagnosis on
  rw.diagnoses, as the bench's own Kafka consumer receives them.

Half the storm threads send a heavy query (a scan the engine stops at the time limit), half a
stuck one: one block computing a `--stuck-elements` (40 M) array, which the engine only checks
against its limit when the block ends, seconds past it. Meanwhile /ping is polled every 0.5 s
(its answer time and status are reported). The report gives each figure for both runs and
their ratios (storm / quiet), the storm's queries (answered, refused, failed, by kind and HTTP
status), and whether the worker was healthy once the storm's queries ended. Exit status 1 when
a figure could not be measured or the worker was not healthy at the end. Each measurement is
repeated `--repeat` times per run; the figures are medians, every sample is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer

from bench.soak import STORM_SQL as HEAVY_SQL
from ingest.batch import decode_batch
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation
from ingest.topics import MAX_MESSAGE_BYTES
from ingest.units import SECOND as SEC
from rankwatch import http, stack
from rankwatch.settings import Settings

#: One block of one row: runs for seconds past a time limit of a few seconds (`{n}` elements).
STUCK_SQL = "SELECT length(arraySort(arrayMap(x -> sipHash64(x), range({n}))))"
_STORED = re.compile(r'^rankwatch_records_stored_total\{kind="\w+"\} (\S+)$', re.M)
_WINDOWS = re.compile(r'^rankwatch_derived_windows_total\{kind="\w+"\} (\S+)$', re.M)


@dataclass
class Run:
    """One measurement: quiet, or under the storm."""

    name: str
    burst_records: int = 0
    burst_s: float | None = None
    records_per_s: float | None = None
    #: from the burst's first publish to the last derived window its records made closed
    derived_s: float | None = None
    trigger_s: float | None = None
    trigger_kind: str = ""
    diagnosis_s: float | None = None
    diagnosis: str = ""
    ping_ms_p50: float | None = None
    ping_ms_max: float | None = None
    pings_unhealthy: int = 0
    pings_failed: int = 0
    #: every repetition's figure; the ones above are their medians
    samples: dict[str, list[float | None]] = field(default_factory=dict)
    #: what went wrong in the bench itself (a hanging job's publisher that failed)
    errors: list[str] = field(default_factory=list)

    def add(self, other: Run) -> None:
        """Keep `other`'s figures as samples; set this run's to their medians."""
        for key in ("records_per_s", "derived_s", "trigger_s", "diagnosis_s"):
            self.samples.setdefault(key, []).append(getattr(other, key))
            got = sorted(v for v in self.samples[key] if v is not None)
            setattr(self, key, got[len(got) // 2] if got else None)
        self.burst_records = other.burst_records
        self.burst_s = other.burst_s
        self.trigger_kind = self.trigger_kind or other.trigger_kind
        self.diagnosis = self.diagnosis or other.diagnosis
        self.errors += other.errors


@dataclass
class Storm:
    threads: int
    answered: int = 0  # ran to its end: the time limit's error for a heavy query
    refused: int = 0  # 503: every slot taken and the queue full
    failed: int = 0  # no HTTP answer (connection refused, timed out)
    #: "<kind> <HTTP status>" -> count (0: no answer); a stuck query that overran its limit
    #: ends with 400 (TIMEOUT_EXCEEDED), one the machine ran fast enough with 200
    codes: dict[str, int] = field(default_factory=dict)
    #: per query kind (heavy, stuck): the longest an answered one took, waiting included
    longest_s: dict[str, float] = field(default_factory=dict)


def counter(settings: Settings, pattern: re.Pattern[str]) -> int:
    """The sum over kinds of one of the worker's /metrics counters."""
    url = f"http://{settings.bind_host}:{settings.metrics_port}/metrics"
    text = http.get(url, timeout=30).body.decode()
    return int(sum(float(v) for v in pattern.findall(text)))


def stored(settings: Settings) -> int:
    """Records the worker has stored, every raw kind."""
    return counter(settings, _STORED)


def producer(settings: Settings) -> Producer:
    return Producer({"bootstrap.servers": settings.bootstrap, "enable.idempotence": True,
                     "compression.type": "zstd", "linger.ms": 20,
                     "message.max.bytes": MAX_MESSAGE_BYTES, "log_level": 2})


def publish(p: Producer, settings: Settings, kind: str, data: bytes, key: str) -> None:
    while True:
        try:
            p.produce(settings.topics.for_kind(kind), data, key=key)
            break
        except BufferError:
            p.poll(0.1)
    p.poll(0)


def burst(settings: Settings, run: Run, dp: int, steps: int, wait_s: float,
          settle_s: float) -> None:
    """Publish a job's records as fast as the broker takes them; time until all are stored,
    then until the derived windows they made have closed (no window closed for `settle_s`: the
    hanging job that follows is measured on a worker with nothing left to do)."""
    job = f"burst-{run.name}-{uuid.uuid4().hex[:6]}"
    sim = Simulation(JobConfig(job_id=job, tp=2, pp=2, dp=dp, steps=steps, microbatches=4,
                               epoch_ns=time.time_ns()))
    batches = list(sim.batches(framing="binary"))
    n = sum(decode_batch(d).n for _, k, d in batches if k != "jobs")
    before = stored(settings)
    p = producer(settings)
    t0 = time.monotonic()
    for i, (_, kind, data) in enumerate(batches):
        publish(p, settings, kind, data, f"{job}:{i % 7}")
    p.flush(120)
    deadline = t0 + wait_s
    while time.monotonic() < deadline:
        if stored(settings) - before >= n:
            run.burst_s = round(time.monotonic() - t0, 2)
            run.records_per_s = round(n / run.burst_s)
            break
        time.sleep(0.1)
    run.burst_records = n
    last, changed = counter(settings, _WINDOWS), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - changed < settle_s:
        time.sleep(0.2)
        now = counter(settings, _WINDOWS)
        if now != last:
            last, changed = now, time.monotonic()
    if time.monotonic() - changed >= settle_s:
        run.derived_s = round(changed - t0, 2)


def fault_job(settings: Settings, run: Run, hang_at: float, wait_s: float) -> None:
    """A hanging job in real time; fault onset to its first trigger and first diagnosis."""
    job = f"hang-{run.name}-{uuid.uuid4().hex[:6]}"
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"storm-{job}",
                  "auto.offset.reset": "latest", "log_level": 2})
    c.subscribe([settings.topics.triggers, settings.topics.diagnoses])
    deadline = time.monotonic() + 30
    while not c.assignment() and time.monotonic() < deadline:
        c.poll(0.2)  # assigned before the job starts, so "latest" misses nothing of it
    epoch = time.time_ns() + SEC
    sim = Simulation(JobConfig(job_id=job, tp=2, pp=2, dp=2, steps=int(hang_at / 0.4) + 20,
                               microbatches=4, hang_tail_s=wait_s, epoch_ns=epoch),
                     [f"hang rank=5 stage=bwd mb=2 at={hang_at}s"])
    onset = epoch / SEC + hang_at
    stop = threading.Event()

    def publisher() -> None:
        try:
            p = producer(settings)
            start = epoch / SEC
            for i, (release, kind, data) in enumerate(sim.batches(framing="binary")):
                # one clock read per turn: reading it twice let the sleep go negative
                while not stop.is_set() and (left := start + release - time.time()) > 0:
                    time.sleep(min(0.05, left))
                    p.poll(0)
                if stop.is_set():
                    break
                publish(p, settings, kind, data, f"{job}:{i % 7}")
            p.flush(30)
        except Exception as e:  # the job stops publishing: say so, and stop waiting for it
            run.errors.append(f"{run.name}: the hanging job's publisher failed: "
                              f"{type(e).__name__}: {e}")

    pub = threading.Thread(target=publisher, daemon=True)
    pub.start()
    try:
        end = onset + wait_s
        while time.time() < end and (run.trigger_s is None or run.diagnosis_s is None) \
                and not run.errors:
            m = c.poll(0.2)
            if m is None or m.error():
                continue
            got = time.time()
            try:
                rec = orjson.loads(m.value() or b"{}")
            except orjson.JSONDecodeError:
                continue
            if not isinstance(rec, dict) or rec.get("job_id") != job:
                continue
            if m.topic() == settings.topics.triggers and run.trigger_s is None:
                run.trigger_s, run.trigger_kind = round(got - onset, 2), str(rec.get("kind"))
            elif m.topic() == settings.topics.diagnoses and run.diagnosis_s is None:
                run.diagnosis_s = round(got - onset, 2)
                run.diagnosis = (f"{rec.get('kind')} ranks {rec.get('culprit_ranks')} "
                                 f"{rec.get('component')}")
    finally:
        stop.set()
        pub.join(60)
        c.close()


def pinger(settings: Settings, stop: threading.Event, run: Run, times: list[float]) -> None:
    """/ping every 0.5 s until `stop`: answer times into `times`, 503s and failures into
    `run`."""
    url = f"{stack.sql_endpoint(settings)}/ping"
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            http.get(url, timeout=10)
            times.append(time.monotonic() - t0)
        except http.StatusError:
            times.append(time.monotonic() - t0)
            run.pings_unhealthy += 1
        except OSError:
            run.pings_failed += 1
        stop.wait(0.5)


def storm_thread(settings: Settings, name: str, sql: str, stop: threading.Event, storm: Storm,
                 lock: threading.Lock) -> None:
    url = f"{stack.sql_endpoint(settings)}/"
    while not stop.is_set():
        code, t0 = 200, time.monotonic()
        try:
            http.post(url, sql.encode(), timeout=settings.sql_max_execution_time_s + 300)
        except http.StatusError as e:
            code = e.status
        except OSError:
            code = 0
        with lock:
            key = f"{name} {code}"
            storm.codes[key] = storm.codes.get(key, 0) + 1
            if code == 503:
                storm.refused += 1
            elif code:
                storm.answered += 1
                took = round(time.monotonic() - t0, 1)
                storm.longest_s[name] = max(storm.longest_s.get(name, 0.0), took)
            else:
                storm.failed += 1
        if code in (0, 503):
            stop.wait(0.2)


def measure(settings: Settings, run: Run, i: int, args: argparse.Namespace, say: Any,
            times: list[float]) -> None:
    """One repetition: a burst, then a hanging job; its figures added to `run`."""
    stop = threading.Event()
    ping = threading.Thread(target=pinger, args=(settings, stop, run, times), daemon=True)
    ping.start()
    one = Run(run.name)
    try:
        say(f"{run.name} {i + 1}/{args.repeat}: publishing a burst (tp2 pp2 dp{args.burst_dp}, "
            f"{args.burst_steps} steps)")
        burst(settings, one, args.burst_dp, args.burst_steps, args.wait_s, args.settle_s)
        say(f"{run.name} {i + 1}/{args.repeat}: {one.burst_records} records stored in "
            f"{one.burst_s} s, their windows closed after {one.derived_s} s; now a job "
            f"hanging {args.hang_at} s in, in real time")
        fault_job(settings, one, args.hang_at, args.wait_s)
        say(f"{run.name} {i + 1}/{args.repeat}: trigger {one.trigger_s} s, diagnosis "
            f"{one.diagnosis_s} s after the hang")
    finally:
        stop.set()
        ping.join(30)
        run.add(one)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def stormy(settings: Settings, args: argparse.Namespace, storm: Storm, lock: threading.Lock,
           stop: threading.Event) -> list[threading.Thread]:
    """Start the storm's threads: half heavy queries, half stuck ones."""
    threads = [threading.Thread(target=storm_thread, daemon=True, args=(
        settings, *(("heavy", HEAVY_SQL) if i % 2 == 0 else
                    ("stuck", STUCK_SQL.format(n=args.stuck_elements))), stop,
        storm, lock)) for i in range(args.storm)]
    for t in threads:
        t.start()
    return threads


def run(args: argparse.Namespace, home: Path, say: Any) -> dict[str, Any]:
    """Quiet and storm repetitions interleaved (quiet, storm, quiet, ...), so that a change in
    the machine's load during the run falls on both alike."""
    settings = stack.private_settings(home, topic_prefix="storm", kafka_partitions=3,
                                      metrics_port=stack.free_port(), page_port=0,
                                      sql_max_execution_time_s=args.limit_s,
                                      sql_nice=args.nice)
    quiet, loud = Run("quiet"), Run("storm")
    pings: dict[str, list[float]] = {"quiet": [], "storm": []}
    storm, lock = Storm(args.storm), threading.Lock()
    healthy_after: bool | None = None
    detail = ""
    load: list[float] = []
    try:
        stack.up(settings, progress=say)
        say("warm-up: a first burst, not measured (the first inserts of each table, the "
            "broker's new partitions)")
        burst(settings, Run("warmup"), 2, 10, args.wait_s, 1.0)
        load = [round(x, 2) for x in os.getloadavg()]
        for i in range(args.repeat):
            measure(settings, quiet, i, args, say, pings["quiet"])
            stop = threading.Event()
            threads = stormy(settings, args, storm, lock, stop)
            time.sleep(2)  # every slot taken, the queue full
            say(f"storm: {args.storm} threads of heavy and stuck queries")
            try:
                measure(settings, loud, i, args, say, pings["storm"])
            finally:
                stop.set()
                say("storm: stopping; waiting for the queries in flight to end")
                for t in threads:
                    t.join(args.limit_s + 120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = stack.status(settings)
            healthy_after, detail = bool(st["healthy"]), str(st["worker"]["detail"])
            if healthy_after:
                break
            time.sleep(1)
    finally:
        stack.down(settings, progress=say)
    for r in (quiet, loud):
        times = sorted(pings[r.name])
        if times:
            r.ping_ms_p50 = round(1e3 * times[len(times) // 2], 1)
            r.ping_ms_max = round(1e3 * times[-1], 1)
    return {
        "limit_s": args.limit_s, "concurrency": settings.sql_concurrency, "nice": args.nice,
        "quiet": asdict(quiet), "storm": asdict(loud), "queries": asdict(storm),
        "ratios": {"records_per_s": ratio(loud.records_per_s, quiet.records_per_s),
                   "derived_s": ratio(loud.derived_s, quiet.derived_s),
                   "trigger_s": ratio(loud.trigger_s, quiet.trigger_s),
                   "diagnosis_s": ratio(loud.diagnosis_s, quiet.diagnosis_s)},
        "healthy_after": healthy_after, "detail_after": detail,
        "cpus": os.cpu_count(), "loadavg_before": load, "loadavg_after": [
            round(x, 2) for x in os.getloadavg()],
    }


def _print(out: dict[str, Any]) -> None:
    q, s, r = out["quiet"], out["storm"], out["ratios"]
    print(f"\n{'':<28}{'quiet':>12}{'storm':>12}{'storm/quiet':>14}")
    for label, key, rk in (("records/s stored (burst)", "records_per_s", "records_per_s"),
                           ("burst's windows closed (s)", "derived_s", "derived_s"),
                           ("hang -> trigger (s)", "trigger_s", "trigger_s"),
                           ("hang -> diagnosis (s)", "diagnosis_s", "diagnosis_s"),
                           ("/ping p50 (ms)", "ping_ms_p50", None),
                           ("/ping max (ms)", "ping_ms_max", None)):
        ratio_text = str(r[rk]) if rk else ""
        print(f"{label:<28}{q[key]!s:>12}{s[key]!s:>12}{ratio_text:>14}")
    qs = out["queries"]
    print(f"{out['cpus']} CPUs, load average {out['loadavg_before']} before, "
          f"{out['loadavg_after']} after; burst "
          f"{q['burst_records']} records; diagnosis quiet: {q['diagnosis']}; "
          f"storm: {s['diagnosis']}")
    print(f"storm: {qs['threads']} threads, {qs['answered']} queries answered (time limit "
          f"{out['limit_s']} s, {out['concurrency']} at once, nice {out['nice']}), "
          f"{qs['refused']} refused (503), {qs['failed']} failed; longest answered "
          f"{qs['longest_s']} s; {qs['codes']}")
    print(f"/ping during the storm: unhealthy {s['pings_unhealthy']}, failed "
          f"{s['pings_failed']}; worker healthy after: {out['healthy_after']} "
          f"({out['detail_after']})")
    for e in q["errors"] + s["errors"]:
        print(f"error: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench storm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storm", type=int, default=12, metavar="N",
                   help="query threads (half heavy, half stuck; default 12: 2 run, 8 wait, "
                        "2 refused)")
    p.add_argument("--limit-s", type=int, default=5, help="the SQL endpoint's time limit")
    p.add_argument("--stuck-elements", type=int, default=40_000_000, metavar="N",
                   help="array length of the stuck queries (40 M: ~1 GB, past a 5 s limit on "
                        "a 2-core machine)")
    p.add_argument("--burst-dp", type=int, default=8)
    p.add_argument("--burst-steps", type=int, default=60)
    p.add_argument("--settle-s", type=float, default=12.0, metavar="S",
                   help="a burst's windows are done when none closed for this long (the "
                        "last ones close once its sources were idle for 10 s)")
    p.add_argument("--hang-at", type=float, default=6.0, metavar="S")
    p.add_argument("--wait-s", type=float, default=60.0, metavar="S",
                   help="longest wait for a burst to be stored, and for a trigger and "
                        "diagnosis after the hang")
    p.add_argument("--nice", type=int, default=10, choices=range(20), metavar="0-19",
                   help="RANKWATCH_SQL_NICE: the endpoint's queries' CPU priority below the "
                        "worker's (0: the same)")
    p.add_argument("--repeat", type=int, default=3,
                   help="bursts and hanging jobs per run (figures are medians)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.repeat, args.storm, args.burst_dp, args.burst_steps) < 1 or args.hang_at < 2:
        p.error("--repeat, --storm, --burst-dp and --burst-steps must be >= 1, --hang-at >= 2")
    say = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    with tempfile.TemporaryDirectory(prefix="rankwatch-storm-") as tmp:
        out = run(args, Path(tmp), say)
    if args.json:
        print(json.dumps(out))
    else:
        _print(out)
    measured = all(out[r][k] is not None for r in ("quiet", "storm")
                   for k in ("records_per_s", "derived_s", "trigger_s", "diagnosis_s"))
    failed = out["quiet"]["errors"] + out["storm"]["errors"]
    return 0 if measured and out["healthy_after"] and not failed else 1
