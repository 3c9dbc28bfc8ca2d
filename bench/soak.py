"""A soak: a simulated job in real time through a private stack, with the worker and the broker
killed now and then and poison messages mixed in.

    rankwatch bench soak --minutes 30 [--kill-worker-every 120] [--kill-broker-every 300]
                         [--poison-every 5] [--ranks 8] [--storm N] [--json]

Starts a private local stack (same code as `rankwatch up`), publishes the records of a simulated
job (ingest.sim, epoch = now) at the wall-clock time the simulator releases them, and meanwhile:
SIGKILLs the worker every `--kill-worker-every` s and the broker every `--kill-broker-every` s,
restarting each with `rankwatch up`'s code (the time to ready is reported); publishes a poison
message every `--poison-every` s on a raw topic in turn (garbage bytes, a batch with a row at
1 ns, one in 2262, one spanning 101 days, one a day ahead of its producer, a 13 MB non-batch
once); with `--storm N`, N threads keep sending queries that run until the SQL endpoint's time
limit stops them (N=1 leaves the endpoint's second query slot to the soak's own counts). Every
10 s it samples the worker's RSS and threads (/proc) and the consumer group's lag (high
watermark minus committed offset, summed over the raw topics).

At the end it waits for the worker to catch up and reports, per kind, rows acknowledged by the
broker vs rows stored (lost = fewer, duplicated = more), dead letters vs poison messages sent,
the samples, and whether any crash loop or stalled topic was seen. Exit status 1 when rows were
lost or duplicated or a poison message was not dead-lettered.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition

from bench.ingest import sql
from ingest.batch import TIME_COLUMN, decode_batch, encode_batch
from ingest.records import COLUMNS, MODELS
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation
from ingest.topics import MAX_MESSAGE_BYTES
from ingest.units import SECOND as SEC
from rankwatch import http, stack
from rankwatch.kafka.broker import Broker
from rankwatch.settings import Settings

RAW = tuple(sorted(MODELS))


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    threads: int
    lag: int
    stored: int
    dead_letters: int
    healthy: bool
    detail: str


@dataclass
class Soak:
    minutes: float
    ranks: int
    published: Counter[str] = field(default_factory=Counter)  # rows acked by the broker
    failed_messages: int = 0
    poison_sent: int = 0
    worker_kills: int = 0
    broker_kills: int = 0
    ready_s: list[float] = field(default_factory=list)
    storm_queries: int = 0
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _proc(pid: int | None) -> tuple[float, int]:
    """(RSS MiB, threads) of `pid` from /proc, (0, 0) when it is gone."""
    if pid is None:
        return 0.0, 0
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0, 0
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])


def _lag(settings: Settings) -> int:
    c = Consumer({"bootstrap.servers": settings.bootstrap,
                  "group.id": f"rankwatch-{settings.topic_prefix}", "enable.auto.commit": False,
                  "log_level": 2})
    try:
        tps = [TopicPartition(settings.topics.for_kind(k), p)
               for k in RAW for p in range(settings.kafka_partitions)]
        committed = c.committed(tps, timeout=5)
        lag = 0
        for tp in committed:
            _, high = c.get_watermark_offsets(tp, timeout=5)
            lag += high - max(tp.offset, 0)
        return lag
    finally:
        c.close()


def _poisons(now: int) -> list[tuple[str, bytes]]:
    """(kind, message) of every poison the soak sends, in turn."""

    def batch(kind: str, t: int) -> bytes:
        cols: dict[str, Any] = {}
        for c in COLUMNS[kind]:  # valid rows, but for the one time
            if c.kind == "str":
                cols[c.name] = [sorted(c.choices)[0] if c.choices else "x"] * 3
            else:
                cols[c.name] = np.full(3, now if c.name == TIME_COLUMN[kind] else
                                       max(c.ge or 0, 0), np.int64)
        cols[TIME_COLUMN[kind]][1] = t
        return encode_batch(kind, "soak-poison", cols)

    out: list[tuple[str, bytes]] = []
    for i, kind in enumerate(RAW):
        out += [(kind, b"\x00garbage" * (i + 1)), (kind, batch(kind, 1)),
                (kind, batch(kind, (1 << 63) - 1)), (kind, batch(kind, now - 101 * 86400 * SEC)),
                (kind, batch(kind, now + 86400 * SEC))]
    return out


class Publisher:
    """The job's records at their release times, counting rows the broker acknowledged."""

    def __init__(self, settings: Settings, soak: Soak) -> None:
        self.settings, self.soak = settings, soak
        self.producer = Producer({
            "bootstrap.servers": settings.bootstrap, "enable.idempotence": True,
            "compression.type": "zstd", "linger.ms": 20, "message.max.bytes": MAX_MESSAGE_BYTES,
            "message.timeout.ms": 600_000, "queue.buffering.max.kbytes": 512 * 1024,
            "log_level": 2})  # the broker's planned outages are not errors to print
        self.lock = threading.Lock()

    def send(self, kind: str, data: bytes, rows: int, key: str) -> None:
        def done(err: Any, msg: Any) -> None:
            with self.lock:
                if err is None:
                    self.soak.published[kind] += rows
                else:
                    self.soak.failed_messages += 1
                    if len(self.soak.errors) < 20:
                        self.soak.errors.append(f"delivery: {err}")

        while True:
            try:
                self.producer.produce(self.settings.topics.for_kind(kind), data, key=key,
                                      on_delivery=done)
                break
            except BufferError:
                self.producer.poll(0.1)
        self.producer.poll(0)


def run(args: argparse.Namespace, home: Path, say: Any) -> dict[str, Any]:
    settings = stack.private_settings(home, topic_prefix="soak", kafka_partitions=3,
                                      iteration_window_s=5.0, kernel_window_s=10.0)
    soak = Soak(args.minutes, args.ranks)
    stored: dict[str, int] = {}
    dead = -1
    try:
        stack.up(settings, progress=say)
        _soak(args, settings, soak, say)
        stored, dead = _stored(settings), _dead_letters(settings)
    except Exception as e:
        soak.errors.append(f"soak stopped: {type(e).__name__}: {str(e)[:300]}")
    finally:
        stack.down(settings, progress=say)
    return report(soak, stored, dead)


def _dead_letters(settings: Settings) -> int:
    """Distinct messages dead-lettered (a worker killed between the dead letter and its commit
    writes it again: repeated, never lost)."""
    return int(sql(settings, "SELECT uniqExact(topic, partition, offset) FROM dlq"))


def _soak(args: argparse.Namespace, settings: Settings, soak: Soak, say: Any) -> None:
    tp, pp = 2, 2
    dp = max(args.ranks // (tp * pp), 1)
    steps = int(args.minutes * 60 / 0.3) + 10
    t0_ns = time.time_ns()
    sim = Simulation(JobConfig(job_id="soak", tp=tp, pp=pp, dp=dp, steps=steps, microbatches=4,
                               epoch_ns=t0_ns, grad_mib=32.0))
    pub = Publisher(settings, soak)
    poisons = _poisons(t0_ns)
    huge_sent = False
    start = time.monotonic()
    end = start + args.minutes * 60
    next_kill_w = start + args.kill_worker_every
    next_kill_b = start + args.kill_broker_every
    next_poison = start + args.poison_every
    next_sample = start
    stop = threading.Event()
    storm = [threading.Thread(target=_storm, args=(settings, stop, soak), daemon=True)
             for _ in range(args.storm)]
    for t in storm:
        t.start()
    pending_restart: list[str] = []

    restarting = threading.Lock()

    def restart_now(what: str) -> None:
        with restarting:
            time.sleep(1.0)  # let the killed process go (its pid file is checked for life)
            t = time.monotonic()
            try:
                stack.up(settings, progress=lambda m: None)
                soak.ready_s.append(round(time.monotonic() - t, 1))
            except Exception as e:  # reported, and retried at the next event
                soak.errors.append(f"restart after {what}: {type(e).__name__}: {str(e)[:300]}")
                pending_restart.append(what)

    def restart(what: str) -> None:
        """Restart in the background: the job keeps publishing meanwhile, as a real one would."""
        threading.Thread(target=restart_now, args=(what,), daemon=True).start()

    for release, kind, data in sim.batches(framing="binary"):
        now = time.monotonic()
        if now >= end:
            break
        wait = start + release - now
        while wait > 0 and not stop.is_set():
            time.sleep(min(wait, 0.2))
            pub.producer.poll(0)
            now = time.monotonic()
            wait = start + release - now
            if now >= next_sample:
                next_sample = now + 10
                _sample(settings, soak, now - start)
                say(f"soak: {now - start:6.0f} s  {_last(soak)}")
            if now >= next_poison:
                next_poison = now + args.poison_every
                if not huge_sent and soak.poison_sent == 7:
                    pub.send("ops", b"[" + b"1," * 6_500_000 + b"1]", 0, "poison")
                    huge_sent = True
                else:
                    k, bad = poisons[soak.poison_sent % len(poisons)]
                    pub.send(k, bad, 0, "poison")
                soak.poison_sent += 1
            if now >= next_kill_w and not restarting.locked():
                next_kill_w = now + args.kill_worker_every
                pid = stack.worker_daemon(settings).pid()
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    soak.worker_kills += 1
                    say(f"soak: killed the worker (pid {pid})")
                    time.sleep(0.5)
                    restart("worker kill")
            if now >= next_kill_b and not restarting.locked():
                next_kill_b = now + args.kill_broker_every
                pid = Broker(settings).pid()
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    soak.broker_kills += 1
                    say(f"soak: killed the broker (pid {pid})")
                    restart("broker kill")
            if pending_restart and not restarting.locked():
                pending_restart.clear()
                restart("an earlier failed restart")
        rows = 1 if kind == "jobs" else decode_batch(data).n
        pub.send(kind, data, rows, f"{kind}:{soak.published.total() % 64}")
    stop.set()
    say("soak: publishing done; waiting for delivery and for the worker to catch up")
    left = pub.producer.flush(600)
    if left:
        soak.errors.append(f"{left} messages never delivered")
    expected = dict(soak.published)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if stack.worker_daemon(settings).pid() is None and not restarting.locked():
            restart_now("worker gone at the end")
        try:
            stored = _stored(settings)
            dead = _dead_letters(settings)
        except Exception:
            time.sleep(2)
            continue
        if all(stored.get(k, 0) >= n for k, n in expected.items()) and dead >= soak.poison_sent:
            break
        time.sleep(2)
    _sample(settings, soak, time.monotonic() - start)


#: What a query storm sends: a query that runs until the endpoint's time limit stops it.
STORM_SQL = "SELECT count() FROM system.numbers WHERE sipHash64(number) = 0"


def _storm(settings: Settings, stop: threading.Event, soak: Soak) -> None:
    """Heavy queries through the SQL endpoint, one after another, until `stop`."""
    while not stop.is_set():
        try:
            http.post(f"http://{settings.bind_host}:{settings.sql_port}/", STORM_SQL.encode(),
                      timeout=settings.sql_max_execution_time_s + 60)
        except Exception:  # the time limit's error, or the worker being restarted
            soak.storm_queries += 1
            time.sleep(0.5)


def _stored(settings: Settings) -> dict[str, int]:
    union = " UNION ALL ".join(
        f"SELECT '{k}', count() FROM {k} WHERE job_id = 'soak'" for k in RAW)
    out = sql(settings, union + " UNION ALL SELECT 'jobs', count() FROM jobs FINAL WHERE "
              "job_id = 'soak'")
    return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines())}


def _sample(settings: Settings, soak: Soak, t: float) -> None:
    pid = stack.worker_daemon(settings).pid()
    rss, threads = _proc(pid)
    try:
        lag = _lag(settings)
    except Exception:
        lag = -1
    try:
        stored = sum(_stored(settings).values())
        dead = _dead_letters(settings)
    except Exception:
        stored = dead = -1
    st = stack.status(settings)
    soak.samples.append(Sample(round(t, 1), round(rss, 1), threads, lag, stored, dead,
                               bool(st["healthy"]), str(st["worker"]["detail"])[:200]))


def _last(soak: Soak) -> str:
    s = soak.samples[-1] if soak.samples else None
    if s is None:
        return ""
    return (f"RSS {s.rss_mib:.0f} MiB, {s.threads} threads, lag {s.lag}, stored {s.stored}, "
            f"dead letters {s.dead_letters}, {'healthy' if s.healthy else s.detail}")


def report(soak: Soak, settings_stored: dict[str, int], dead: int) -> dict[str, Any]:
    kinds = sorted(set(soak.published) | set(settings_stored))
    per_kind = {k: {"published": soak.published.get(k, 0), "stored": settings_stored.get(k, 0),
                    "lost": max(soak.published.get(k, 0) - settings_stored.get(k, 0), 0),
                    "duplicated": max(settings_stored.get(k, 0) - soak.published.get(k, 0), 0)}
                for k in kinds}
    warm = [s for s in soak.samples if s.t_s >= 60 and s.rss_mib > 0]
    return {
        "minutes": soak.minutes, "ranks": soak.ranks, "rows": per_kind,
        "dead_letters": dead, "poison_sent": soak.poison_sent,
        "worker_kills": soak.worker_kills, "broker_kills": soak.broker_kills,
        "ready_after_kill_s": soak.ready_s,
        "rss_mib_after_warmup": [min((s.rss_mib for s in warm), default=0),
                                 max((s.rss_mib for s in warm), default=0)],
        "threads_after_warmup": [min((s.threads for s in warm), default=0),
                                 max((s.threads for s in warm), default=0)],
        "max_lag": max((s.lag for s in soak.samples), default=0),
        "unhealthy_samples": [asdict(s) for s in soak.samples if not s.healthy],
        "storm_queries": soak.storm_queries,
        "failed_messages": soak.failed_messages, "errors": soak.errors,
        "samples": [asdict(s) for s in soak.samples],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--ranks", type=int, default=8, help="ranks of the simulated job (tp=pp=2)")
    p.add_argument("--kill-worker-every", type=float, default=120.0, metavar="S")
    p.add_argument("--kill-broker-every", type=float, default=300.0, metavar="S")
    p.add_argument("--poison-every", type=float, default=5.0, metavar="S")
    p.add_argument("--storm", type=int, default=0, metavar="N",
                   help="N threads sending queries that run to the endpoint's time limit")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    say = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    with tempfile.TemporaryDirectory(prefix="rankwatch-soak-") as tmp:
        out = run(args, Path(tmp), say)
    bad = any(r["lost"] or r["duplicated"] for r in out["rows"].values()) or (
        out["dead_letters"] != out["poison_sent"]) or any(
        e.startswith("soak stopped") for e in out["errors"])
    if args.json:
        print(json.dumps(out))
    else:
        print(f"\nsoak: {out['minutes']} min, {out['ranks']} ranks, {out['worker_kills']} worker "
              f"and {out['broker_kills']} broker kills (ready again after "
              f"{out['ready_after_kill_s']} s)")
        print(f"{'kind':<10}{'published':>12}{'stored':>12}{'lost':>8}{'duplicated':>12}")
        for k, r in out["rows"].items():
            print(f"{k:<10}{r['published']:>12}{r['stored']:>12}{r['lost']:>8}"
                  f"{r['duplicated']:>12}")
        print(f"dead letters {out['dead_letters']} of {out['poison_sent']} poison messages; "
              f"RSS after warm-up {out['rss_mib_after_warmup']} MiB, threads "
              f"{out['threads_after_warmup']}, max lag {out['max_lag']} messages; "
              f"unhealthy samples {len(out['unhealthy_samples'])}")
        for e in out["errors"]:
            print(f"error: {e}")
    return 1 if bad else 0
