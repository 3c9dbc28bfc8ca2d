"""Streams throughput and worker memory, end to end from the broker, per record kind.

    rankwatch bench streams [--tp 8 --pp 4 --dp 32] [--comm-steps 48] [--kernel-steps 24]
                            [--only ops|kernels] [--json]
    rankwatch bench streams --in-process [--ranks 1024] [--kernel-events 4000000] [--json]

End to end (the default): starts a private local stack (the code of `rankwatch up`: a KRaft
broker and the whole worker — raw agents, derived windows at the default widths, diagnosis) and
runs two simulated jobs one after the other, each published from a separate process by
`rankwatch simulate --speed max --kinds …`:

1. **op/flow/chunk**: a job's ops, flows and chunk snapshots only. The worker stores them and
   derives the progress feed (1 s windows) and iteration rows (10 s windows; steps inferred from
   the DP gradient collective, there are no stage records) and runs the trigger agents on them.
2. **kernels**: the same job shape's kernel events only, stored raw and summarized (ARGUS §5.2
   KDE clusters per (rank, stream, kernel), 60 s windows).

Per phase it reads the worker process's CPU time (utime + stime of every thread, /proc) before
the first record is published, when the last raw record is queryable ("ingest") and when the
last derived row is written ("ingest + derived"). Derived rows are counted every 0.5 s; counts
are final once unchanged for the watermark's idle close (10 s) plus 3 s, and the CPU reading is
the one taken with the first sample that showed them. That span includes the worker's idle
ticking while the job's last windows wait for the idle close; the worker's background rate,
measured over 3 s before each phase, is reported so it can be judged. A phase starts once that
rate is below 0.1 CPU-s/s (at most 60 s of waiting): the previous job's last windows and
diagnosis work would otherwise be charged to the next phase (a sweep of a job with stage
records reads its raw window: about 1 CPU-s at 1,024 ranks; these jobs have none). Records
per worker CPU-second is the "per worker core" figure: it does not depend on how busy the
simulator and the broker kept the machine's other cores.

Checks, not figures: every published record is stored exactly once, and the kernel windows
never count more events than were published (`kernel_windows.events`); events stored after
their window closed (late) are reported.

Memory: the worker's resident set (VmRSS) and its anonymous part (RssAnon: the heap, Python's
and the embedded ClickHouse's; the rest is file-backed, mostly ClickHouse's library pages,
counted once touched) are sampled with every poll. Both are reported when 25, 50, 75 and 100 % of
the records are stored, with their peaks and the heap after the job: a flat series means memory
does not grow with the run's length.

`--in-process` times the derived stage alone, on raw rows inserted straight into a private
embedded ClickHouse (no broker, no raw ingest): how much of the per-core budget each derived
computation takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.ingest import sql
from bench.kde import _window
from bench.pipeline import RAW, counts, cpu_seconds
from ingest.units import SECOND as SEC
from rankwatch import stack
from rankwatch.settings import Settings
from streams.db import Database, migrate
from streams.derived import DerivedRunner
from streams.kernel_summaries import KernelSummarizer

T0 = 1_700_000_040_000_000_000  # a multiple of 60 s
POLL_S = 0.5
IDLE_CLOSE_S = 10.0  # streams.windows.WatermarkParams.idle_ns
IDLE_CPU = 0.1  # worker CPU-s/s below which it counts as idle before a phase
PHASES = {"op/flow/chunk": ("ops,flows,chunks", ("progress", "iterations")),
          "kernels": ("kernels", ("kernel_summaries", "kernel_windows"))}


def rss_mib(pid: int) -> tuple[float, float]:
    """(resident set, its anonymous part) of `pid` in MiB (VmRSS and RssAnon of
    /proc/<pid>/status). The rest is file-backed: mostly the embedded ClickHouse's 555 MB
    library, whose pages count once touched (more as more of its code runs) and are shared
    and reclaimable; the anonymous part is the heap, which is what the records can grow."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0]) / 1024
    if len(fields) < 2:
        raise RuntimeError(f"no VmRSS/RssAnon for pid {pid}")
    return fields["VmRSS"], fields["RssAnon"]


def derived_counts(settings: Settings, job: str, tables: tuple[str, ...]) -> dict[str, int]:
    union = " UNION ALL ".join(
        f"SELECT '{t}', count() FROM {t} FINAL WHERE job_id = '{job}'" for t in tables)
    return {k: int(v) for k, v in (line.split("\t") for line in sql(settings, union).splitlines())}


@dataclass
class Phase:
    name: str
    kinds: str
    tables: tuple[str, ...]
    published: dict[str, int] = field(default_factory=dict)


def run_phase(settings: Settings, pid: int, phase: Phase, args: argparse.Namespace,
              steps: int, say: Any) -> dict[str, Any]:
    job = f"benchs-{phase.kinds.split(',')[0]}-{int(time.time())}"
    waited = time.time()
    while True:  # a previous phase's job may still be judged (its last sweeps): wait it out
        cpu_a, t_a = cpu_seconds(pid), time.time()
        time.sleep(3.0)
        idle_rate = (cpu_seconds(pid) - cpu_a) / (time.time() - t_a)
        if idle_rate < IDLE_CPU or time.time() - waited > 60:
            break
        say(f"  the worker is busy ({idle_rate:.2f} CPU-s/s); waiting for it to settle…")
    rss0 = rss_mib(pid)
    say(f"{phase.name}: simulating tp{args.tp}·pp{args.pp}·dp{args.dp}, {steps} steps "
        f"(--kinds {phase.kinds}), max speed…")
    cpu0, t0 = cpu_seconds(pid), time.time()
    sim = subprocess.Popen(
        [sys.executable, "-m", "rankwatch.cli", "simulate", "--tp", str(args.tp), "--pp",
         str(args.pp), "--dp", str(args.dp), "--steps", str(steps), "--job-id", job,
         "--kinds", phase.kinds, "--speed", "max", "--out", "kafka", "--json", "--quiet"],
        env=stack.child_env(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss: list[tuple[int, tuple[float, float]]] = []  # (records stored, (RSS, anon) MiB)
    expected: int | None = None
    stored, last_note = 0, 0.0
    try:
        while expected is None or stored < expected:
            if expected is None and sim.poll() is not None:
                out, err = sim.communicate()
                if sim.returncode:
                    raise RuntimeError(f"simulate failed: {err.strip()[-2000:]}")
                summary = json.loads(out)
                phase.published = {k: int(v) for k, v in summary["rows_by_kind"].items()}
                expected = sum(phase.published.values())
                t_published = time.time()
            got = counts(settings, job)
            stored = sum(got.values())
            rss.append((stored, rss_mib(pid)))
            if time.time() - last_note > 3:
                say(f"  {stored:,} records queryable" + (f" of {expected:,}" if expected else ""))
                last_note = time.time()
            if expected is not None and time.time() - t_published > 900:
                raise RuntimeError(f"only {stored:,} of {expected:,} stored after 900 s")
            time.sleep(POLL_S)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
    t_stored, cpu_stored = time.time(), cpu_seconds(pid)
    if got != {k: phase.published.get(k, 0) for k in RAW}:
        raise RuntimeError(f"stored {got}, published {phase.published}: lost or duplicated")
    say(f"  all {expected:,} stored; waiting for the last derived windows (idle close)…")
    final: dict[str, int] = {}
    at = (t_stored, cpu_stored)
    while True:
        now_counts = derived_counts(settings, job, phase.tables)
        sample = (time.time(), cpu_seconds(pid))
        rss.append((stored, rss_mib(pid)))
        if now_counts != final:
            final, at = now_counts, sample
        elif all(final.values()) and sample[0] - at[0] > IDLE_CLOSE_S + 3:
            break
        if sample[0] - t_stored > 300:
            raise RuntimeError(f"derived rows still changing 300 s after the last raw row: {final}")
        time.sleep(POLL_S)
    records = sum(phase.published.values())
    ingest_cpu, total_cpu = cpu_stored - cpu0, at[1] - cpu0
    res: dict[str, Any] = {
        "job": job, "steps": steps, "records": records, "by_kind": phase.published,
        "derived_rows": final, "wall_to_stored_s": round(t_stored - t0, 2),
        "derived_done_after_stored_s": round(at[0] - t_stored, 2),
        "worker_idle_cpu_per_s": round(idle_rate, 3),
        "ingest_worker_cpu_s": round(ingest_cpu, 2),
        "ingest_records_per_worker_cpu_s": round(records / ingest_cpu),
        "total_worker_cpu_s": round(total_cpu, 2),
        "records_per_worker_cpu_s": round(records / total_cpu),
        "rss_mib_before": round(rss0[0], 1), "anon_mib_before": round(rss0[1], 1),
        "rss_mib_peak": round(max(r[0] for _, r in rss), 1),
        "anon_mib_peak": round(max(r[1] for _, r in rss), 1),
        "anon_mib_after": round(rss[-1][1][1], 1),
    }
    fractions, anon = {}, {}
    for q in (25, 50, 75, 100):
        first = next(r for n, r in rss if n >= records * q / 100)
        fractions[f"{q}%"], anon[f"{q}%"] = round(first[0], 1), round(first[1], 1)
    res["rss_mib_at_stored"], res["anon_mib_at_stored"] = fractions, anon
    diag = sql(settings, "SELECT kind, status, summary FROM diagnoses FINAL "
               f"WHERE job_id = '{job}' ORDER BY detected_ns")
    res["diagnoses"] = [line.split("\t") for line in diag.splitlines() if line]
    # every trigger makes root cause read the job's whole raw window: on a healthy job each
    # one is a false alarm that costs worker CPU
    worker_log = (settings.home / "logs" / "worker.log").read_text(errors="replace")
    res["triggers"] = [line.split(" trigger ", 1)[1].split()[1] for line in
                       worker_log.splitlines() if f" trigger {job} " in line]
    if "kernel_windows" in phase.tables:
        kw = sql(settings, "SELECT sum(events), sum(keys), sum(summary_rows), "
                 "round(avg(compression_ratio), 1) FROM kernel_windows FINAL "
                 f"WHERE job_id = '{job}'").split("\t")
        events, keys, rows, ratio = int(kw[0]), int(kw[1]), int(kw[2]), float(kw[3])
        missed = phase.published.get("kernels", 0) - events
        if missed < 0:
            raise RuntimeError(f"kernel windows summarized {events:,} events, "
                               f"{phase.published.get('kernels', 0):,} published")
        log = settings.home / "logs" / "worker.log"
        read_back = sum(1 for line in log.read_text(errors="replace").splitlines()
                        if f"of {job}:" in line and "read back from the table" in line)
        res.update(kernel_windows_events=events, kernel_keys=keys, kernel_summary_rows=rows,
                   kernel_compression=ratio, kernel_events_late=missed,
                   kernel_windows_read_back=read_back)
    return res


def run_end_to_end(args: argparse.Namespace, home: Path, say: Any) -> dict[str, Any]:
    settings = stack.private_settings(home, topic_prefix="benchs")
    try:
        stack.up(settings, progress=say)
        pid = stack.worker_daemon(settings).pid()
        if pid is None:
            raise RuntimeError("the worker is not running")
        out: dict[str, Any] = {"ranks": args.tp * args.pp * args.dp}
        for name, (kinds, tables) in PHASES.items():
            if name not in args.phases:
                continue
            steps = args.comm_steps if name == "op/flow/chunk" else args.kernel_steps
            out[name] = run_phase(settings, pid, Phase(name, kinds, tables), args, steps, say)
        return out
    finally:
        stack.down(settings, progress=say)


def insert_kernels(db: Database, ranks: int, events: int) -> None:
    keys, durations = _window(ranks * 9, max(1, events // (ranks * 9)), 1)
    n = len(keys)
    names = np.array([f"kernel_{i}" for i in range(9)], dtype=object)
    cols = {"job_id": np.full(n, "bench", dtype=object), "rank": (keys // 9).astype(np.int32),
            "stream": np.zeros(n, np.int64), "kernel": names[keys % 9],
            "t_start": T0 + np.sort(np.random.default_rng(0).integers(0, 60 * SEC, n)),
            "duration": np.maximum(durations, 1).astype(np.int64)}
    for lo in range(0, n, 1_000_000):
        db.insert_columns("kernels", {k: v[lo:lo + 1_000_000] for k, v in cols.items()})


def insert_ops(db: Database, ranks: int, per_s: int, seconds: int) -> int:
    comms = np.array(["tp:0", "pp:0", "dp:0"], dtype=object)
    total = 0
    per_rank_comm = max(1, per_s // (ranks * 3))
    for s in range(seconds):
        n = ranks * 3 * per_rank_comm
        i = np.arange(n)
        rank = (i % ranks).astype(np.int32)
        comm = (i // ranks) % 3
        seq = s * per_rank_comm + i // (ranks * 3)
        start = T0 + s * SEC + (i // (ranks * 3)) * (SEC // per_rank_comm)
        db.insert_columns("ops", {
            "job_id": np.full(n, "bench", dtype=object), "rank": rank, "comm_id": comms[comm],
            "op_seq": seq, "op": np.full(n, "AllReduce", dtype=object),
            "bytes": np.full(n, 1 << 20), "peer": np.full(n, -1, np.int32),
            "stream": np.zeros(n, np.int64), "t_enqueue": start, "t_start": start,
            "t_end": start + SEC // per_rank_comm // 2, "step": seq})
        total += n
    return total


async def run_in_process(ranks: int, kernel_events: int, ops_per_s: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-streams-") as d:
        db = Database(f"chdb://{d}", "bench")
        try:
            migrate(db)
            insert_kernels(db, ranks, kernel_events)
            n = int(db.query("SELECT count() FROM kernels").result_rows[0][0])
            ks = KernelSummarizer(db)
            t = time.perf_counter()
            _, window = await ks.compute("bench", T0, offload=False)
            dt = time.perf_counter() - t
            out.update(kernel_events=n, kernel_s=round(dt, 3),
                       kernel_events_per_s=round(n / dt),
                       kernel_compression=round(float(window["compression_ratio"][0]), 1))
            seconds = 12
            n_ops = insert_ops(db, ranks, ops_per_s, seconds)

            async def nothing(kind: str, job: str, data: bytes) -> None:
                return None

            runner = DerivedRunner(db, nothing)
            t = time.perf_counter()
            for s in range(6, seconds):
                await runner.progress.compute("bench", T0 + s * SEC)
            dt = time.perf_counter() - t
            per_window = n_ops / seconds
            out.update(ops=n_ops, progress_window_ms=round(dt / (seconds - 6) * 1e3, 1),
                       progress_ops_per_s=round(per_window * (seconds - 6) / dt),
                       progress_rows_per_window=ranks * 3)
            t = time.perf_counter()
            it = await runner._iterations("bench", T0)
            dt = time.perf_counter() - t
            out.update(iteration_window_s=round(dt, 3), iteration_rows=len(it["rank"]),
                       iteration_ops_per_s=round(min(n_ops, per_window * 10) / dt))
        finally:
            db.close()
    return out


def print_end_to_end(r: dict[str, Any]) -> None:
    print(f"streams, end to end from the broker ({r['ranks']:,}-rank simulated job; "
          "simulator, broker and worker on this machine; per worker CPU-second):")
    for name in PHASES:
        if name not in r:
            continue
        p = r[name]
        kinds = ", ".join(f"{k} {v:,}" for k, v in p["by_kind"].items())
        print(f"  {name}: {p['records']:,} records ({kinds}), {p['steps']} steps")
        print(f"    ingest (broker -> ClickHouse): {p['ingest_worker_cpu_s']} CPU-s = "
              f"{p['ingest_records_per_worker_cpu_s']:,} records per worker CPU-second")
        derived = ", ".join(f"{k} {v:,}" for k, v in p["derived_rows"].items())
        print(f"    ingest + derived ({derived}; last row {p['derived_done_after_stored_s']} s "
              f"after the last raw row): {p['total_worker_cpu_s']} CPU-s = "
              f"{p['records_per_worker_cpu_s']:,} records per worker CPU-second")
        if "kernel_compression" in p:
            print(f"    kernel windows: {p['kernel_windows_events']:,} events summarized into "
                  f"{p['kernel_summary_rows']:,} rows over {p['kernel_keys']:,} keys, "
                  f"compression {p['kernel_compression']}x; "
                  f"{p['kernel_windows_read_back']} window(s) read back from the table "
                  "(the others summarized from the events kept as they were stored)")
            if p["kernel_events_late"]:
                print(f"    {p['kernel_events_late']:,} kernel events were stored after their "
                      "window closed (late: at max speed event time runs ~10x faster than "
                      "wall time, so the 2 s allowed lateness is ~0.2 s of partition skew)")
        if p["triggers"]:
            kinds = ", ".join(f"{k} {p['triggers'].count(k)}" for k in sorted(set(p["triggers"])))
            print(f"    triggers for this healthy job: {len(p['triggers'])} ({kinds}); each "
                  "one read the job's raw window for root cause")
        if p["diagnoses"]:  # a healthy simulated job: every diagnosis is a false alarm
            print(f"    diagnoses raised for this healthy job: {len(p['diagnoses'])} "
                  f"({'; '.join(d[-1] for d in p['diagnoses'])[:300]})")
        rss = ", ".join(f"{q} {v:.0f}" for q, v in p["rss_mib_at_stored"].items())
        anon = ", ".join(f"{q} {v:.0f}" for q, v in p["anon_mib_at_stored"].items())
        print(f"    worker heap (anonymous RSS) MiB: before {p['anon_mib_before']:.0f}; at records "
              f"stored {anon}; peak {p['anon_mib_peak']:.0f}; after the job "
              f"{p['anon_mib_after']:.0f}")
        print(f"    worker RSS MiB: before {p['rss_mib_before']:.0f}; at records stored {rss}; "
              f"peak {p['rss_mib_peak']:.0f} (background CPU {p['worker_idle_cpu_per_s']} "
              "CPU-s/s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench streams",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--dp", type=int, default=32)
    p.add_argument("--comm-steps", type=int, default=48,
                   help="steps of the op/flow/chunk job (default 48)")
    p.add_argument("--kernel-steps", type=int, default=24,
                   help="steps of the kernel job (default 24)")
    p.add_argument("--only", choices=("ops", "kernels"),
                   help="run one phase: op/flow/chunk records or kernel events")
    p.add_argument("--in-process", action="store_true",
                   help="the derived stage alone, in process, without broker or raw ingest")
    p.add_argument("--ranks", type=int, default=1024, help="--in-process: ranks")
    p.add_argument("--kernel-events", type=int, default=4_000_000,
                   help="--in-process: kernel events in the window")
    p.add_argument("--ops-per-s", type=int, default=500_000, help="--in-process: op rate")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    for name in ("tp", "pp", "dp", "comm_steps", "kernel_steps", "ranks", "kernel_events",
                 "ops_per_s"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    a.phases = {"ops": ("op/flow/chunk",), "kernels": ("kernels",), None: tuple(PHASES)}[a.only]
    if not a.in_process:
        def say(message: str) -> None:
            if not a.json:
                print(message, file=sys.stderr, flush=True)

        with tempfile.TemporaryDirectory(prefix="rankwatch-bench-") as home:
            res = run_end_to_end(a, Path(home), say)
        if a.json:
            print(json.dumps(res))
        else:
            print_end_to_end(res)
        return 0
    r = asyncio.run(run_in_process(a.ranks, a.kernel_events, a.ops_per_s))
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"streams (derived stage alone, in process, {a.ranks} ranks):")
    print(f"  kernel summaries: {r['kernel_events']:,} events in one 60 s window read and "
          f"summarized in {r['kernel_s']} s = {r['kernel_events_per_s']:,} events/s, "
          f"compression {r['kernel_compression']}x")
    print(f"  progress: {r['progress_rows_per_window']:,} rows per 1 s window over "
          f"{a.ops_per_s:,} ops/s: {r['progress_window_ms']} ms per window = "
          f"{r['progress_ops_per_s']:,} ops/s")
    print(f"  iterations: one 10 s window ({r['iteration_rows']:,} rows) in "
          f"{r['iteration_window_s']} s = {r['iteration_ops_per_s']:,} ops/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
