"""`rankwatch bench agent`: what the host agent costs the host, idle and busy, and its latency.

The agent (`ingest.agent.agent.Agent.run`, its real loop and defaults: 50 ms poll, 1 s beats,
0.25 s linger, 0.05 s for stage records, calls and beats) runs in a child process publishing to an
in-memory publisher (no Kafka: the client's own cost is not the agent's); this process owns the
rings, so their producer is alive.
Phases, `--seconds` each, the agent's CPU time (user + system, /proc/<pid>/stat) measured over
each (per-thread run time from /proc/<pid>/task/*/schedstat):

1. ``idle, no rings`` — nothing to drain;
2. ``idle, N rings`` — `--rings` Python-tracer rings whose producer writes nothing (a job between
   steps, or hung);
3. ``busy`` — the same rings written at `--rate` stage records per second in total, in bursts of
   one record per ring every 1/(rate/rings) s (a job's step boundaries). CPU per 1,000 records is
   the phase's CPU minus phase 2's rate over the same time, per 1,000 records; the publish
   latency is, per published batch, the publish time minus the write time of its oldest record
   (p50, p99, max over batches);
4. ``bursts`` — one record per ring every `--burst-every` s, quiet in between: the latency of an
   agent woken from idle (its slower idle polling shows here);
5. with ``--job-steps N``: a real traced job (examples/train.py, DDP over gloo, `--rings` ranks
   under torchrun, needs torch): the agent's CPU from the job's start to one second after its
   end, and per 1,000 records it published.

With ``--baseline FILE`` (another version of ingest/agent/agent.py, e.g. ``git show
REV:ingest/agent/agent.py > /tmp/agent_old.py``) the phases run for that agent too, interleaved
with this one's (baseline, current, baseline, current … per phase, `--repeat` times), and the
ratios current / baseline are printed. Prints a table, or JSON with --json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ingest import ring

_TICK = os.sysconf("SC_CLK_TCK")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rankwatch bench agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    p.add_argument("--rings", type=int, default=4, help="rings (ranks) on the host")
    p.add_argument("--rate", type=float, default=2000.0, help="records/s in the busy phase")
    p.add_argument("--burst-every", type=float, default=3.0,
                   help="seconds between the bursts of the last phase (an idle agent waking)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every phase per agent")
    p.add_argument("--job-steps", type=int, default=0,
                   help="also trace a real DDP job (examples/train.py, torch) of this many steps")
    p.add_argument("--baseline", help="another agent.py to compare against (before/after)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _cpu_s(pid: int) -> float:
    """CPU time of every thread of `pid`, s: schedstat's run time (ns) where the kernel has it,
    else utime + stime (clock ticks, 10 ms)."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK


class _Sink:
    """Publisher that keeps (publish time, kind, bytes) for the latency afterwards."""

    def __init__(self) -> None:
        self.got: list[tuple[int, str, bytes]] = []

    def publish(self, kind: str, data: bytes, key: Any = None, topic: Any = None,
                on_delivery: Any = None) -> bool:
        self.got.append((time.time_ns(), kind, data))
        if on_delivery is not None:
            on_delivery(None, None)
        return True

    def flush(self, timeout: float = 30.0) -> int:
        return 0


def _agent_main(agent_file: str | None, sidecars: str, prefix: str, stop: Any,
                results: Any) -> None:
    if agent_file:
        spec = importlib.util.spec_from_file_location("rankwatch_bench_baseline_agent",
                                                      agent_file)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    else:
        from ingest.agent import agent as mod
    pub = _Sink()
    a = mod.Agent(mod.AgentConfig(Path(sidecars), prefix=prefix), pub)
    a.run(stop.is_set)
    lat: list[float] = []
    records = 0
    from ingest.batch import decode_batch

    for t, kind, data in pub.got:
        if kind == "jobs":
            continue
        b = decode_batch(data)
        records += b.n
        if kind == "stages":
            lat.append((t - int(b.cols["t_start"].min())) / 1e6)
    results.put((lat, records))


def _phase(agent_file: str | None, rings: int, rate: float, seconds: float,
           writers: list[Any] | None, burst_every: float = 0.0) -> dict[str, float]:
    """One phase against a fresh agent process; `writers` None: no rings at all. With
    `burst_every`, one record per ring every that many seconds (quiet in between) instead of
    `rate`."""
    prefix = f"/rwbagent{os.getpid()}"
    ctx = mp.get_context("fork")
    stop, results = ctx.Event(), ctx.Queue()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # where tracers keep sidecars
    with tempfile.TemporaryDirectory(dir=shm) as sidecars:
        proc = ctx.Process(target=_agent_main, args=(agent_file, sidecars, prefix, stop,
                                                     results), daemon=True)
        sinks = []
        if writers is not None:
            from ingest.torch.comms import CommTable
            from ingest.torch.sink import RingSink

            sinks = [RingSink("bench-agent", r, 1 << 16, prefix) for r in range(rings)]
            (Path(sidecars) / "bench-agent").mkdir()
            for r, sink in enumerate(sinks):  # what a tracer writes: sidecar, world group
                CommTable(Path(sidecars) / "bench-agent" / f"rank-{r}.json", "bench-agent", r,
                          rings).index(sink, "world", list(range(rings)))
                sink.comm("world")
        proc.start()
        assert proc.pid is not None
        time.sleep(1.0)  # start-up (imports, first discovery) is not the loop's cost
        c0, t0 = _cpu_s(proc.pid), time.monotonic()
        written = 0
        if (rate > 0 or burst_every > 0) and sinks:
            period = burst_every or len(sinks) / rate
            nxt = time.monotonic()
            step = 0
            while time.monotonic() - t0 < seconds:
                now = time.time_ns()
                for s in sinks:
                    s.stage(step, now, 1, 2, 3, 4, 5, 6, -1)
                written += len(sinks)
                step += 1
                nxt += period
                time.sleep(max(0.0, nxt - time.monotonic()))
        else:
            time.sleep(seconds)
        cpu, wall = _cpu_s(proc.pid) - c0, time.monotonic() - t0
        time.sleep(0.5)  # let the last records out before stopping
        stop.set()
        lat, _ = results.get(timeout=60)
        proc.join(30)
        for s in sinks:
            s.close(unlink=True)
    for name in ring.list_rings(prefix):
        ring.load_library().rw_ring__unlink(name.encode())
    lat.sort()
    return {"cpu_s": cpu, "wall_s": wall, "records": written,
            "lat_p50_ms": statistics.median(lat) if lat else 0.0,
            "lat_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
            "lat_max_ms": lat[-1] if lat else 0.0}


def _job(agent_file: str | None, args: argparse.Namespace) -> dict[str, float]:
    """A real job: examples/train.py (DDP, gloo, CPU) under torchrun with `--rings` ranks for
    `--job-steps` steps, traced; the agent's CPU from the job's start to its end."""
    from ingest.torch.provision import pythonpath_with_torch

    prefix = f"/rwbjob{os.getpid()}"
    ctx = mp.get_context("fork")
    stop, results = ctx.Event(), ctx.Queue()
    root = Path(__file__).resolve().parent.parent
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm) as sidecars:
        proc = ctx.Process(target=_agent_main, args=(agent_file, sidecars, prefix, stop,
                                                     results), daemon=True)
        proc.start()
        assert proc.pid is not None
        time.sleep(1.0)
        env = pythonpath_with_torch({
            **{k: v for k, v in os.environ.items() if not k.startswith("RANKWATCH_")},
            "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "RANKWATCH_JOB": "bench-job",
            "RANKWATCH_RING_DIR": sidecars, "RANKWATCH_RING_PREFIX": prefix})
        from rankwatch.stack import free_port

        c0, t0 = _cpu_s(proc.pid), time.monotonic()
        train = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
             str(args.rings), "--master-port", str(free_port()), "-m", "ingest.torch.run",
             "examples/train.py", "--mode", "ddp", "--steps", str(args.job_steps),
             "--width", "128"], env=env, cwd=root, capture_output=True, timeout=600)
        time.sleep(1.0)  # the last records out
        cpu, wall = _cpu_s(proc.pid) - c0, time.monotonic() - t0
        stop.set()
        _, records = results.get(timeout=60)
        proc.join(30)
    for name in ring.list_rings(prefix):
        ring.load_library().rw_ring__unlink(name.encode())
    if train.returncode:
        raise SystemExit(f"bench agent: the training job failed: {train.stderr[-2000:]!r}")
    return {"cpu_s": round(cpu, 3), "wall_s": round(wall, 2), "records": records,
            "cpu_ms_per_1k_records": round(cpu / max(records, 1) * 1e6, 2)}


def _measure(agent_file: str | None, args: argparse.Namespace,
             progress: Any) -> dict[str, dict[str, float]]:
    name = "baseline" if agent_file else "current"
    progress(f"{name}: idle, no rings")
    none = _phase(agent_file, 0, 0, args.seconds, None)
    progress(f"{name}: idle, {args.rings} rings")
    idle = _phase(agent_file, args.rings, 0, args.seconds, [])
    progress(f"{name}: busy, {args.rate:g} records/s")
    busy = _phase(agent_file, args.rings, args.rate, args.seconds, [])
    progress(f"{name}: a burst every {args.burst_every:g} s")
    bursts = _phase(agent_file, args.rings, 0, args.seconds, [], args.burst_every)
    job = None
    if args.job_steps:
        progress(f"{name}: a real {args.rings}-rank DDP job, {args.job_steps} steps")
        job = _job(agent_file, args)
    idle_rate = idle["cpu_s"] / idle["wall_s"]
    net = busy["cpu_s"] - idle_rate * busy["wall_s"]
    return {
        "idle_no_rings": {"cpu_s_per_min": none["cpu_s"] / none["wall_s"] * 60},
        "idle_rings": {"cpu_s_per_min": idle_rate * 60},
        "busy": {"cpu_s_per_min": busy["cpu_s"] / busy["wall_s"] * 60,
                 "cpu_ms_per_1k_records": net / max(busy["records"], 1) * 1e6,
                 "records": busy["records"], "lat_p50_ms": busy["lat_p50_ms"],
                 "lat_p99_ms": busy["lat_p99_ms"], "lat_max_ms": busy["lat_max_ms"]},
        "bursts": {"lat_p50_ms": bursts["lat_p50_ms"], "lat_max_ms": bursts["lat_max_ms"]},
        **({"job": job} if job else {}),
    }


def _median(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {ph: {k: round(statistics.median(r[ph][k] for r in runs), 4) for k in runs[0][ph]}
            for ph in runs[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        ring.load_library()
    except ring.RingLibraryMissing as e:
        print(f"bench agent: {e}", file=sys.stderr)
        return 2
    if args.baseline and not Path(args.baseline).is_file():
        print(f"bench agent: --baseline {args.baseline}: no such file", file=sys.stderr)
        return 2

    def progress(msg: str) -> None:
        print(f"  … {msg}", file=sys.stderr, flush=True)

    agents: list[str | None] = [args.baseline, None] if args.baseline else [None]
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"baseline": [], "current": []}
    for _ in range(args.repeat):
        for f in agents:
            runs["baseline" if f else "current"].append(_measure(f, args, progress))
    out: dict[str, Any] = {k: _median(v) for k, v in runs.items() if v}
    out["config"] = {"seconds": args.seconds, "rings": args.rings, "rate": args.rate,
                     "repeat": args.repeat, "cpus": os.cpu_count(),
                     "loadavg": os.getloadavg()[0]}
    if args.baseline:
        b, c = out["baseline"], out["current"]
        out["ratio"] = {f"{ph}.{k}": round(c[ph][k] / b[ph][k], 3) if b[ph][k] else None
                        for ph in c for k in c[ph] if k != "records"}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"host agent, {args.rings} rings, {args.seconds:g} s per phase, busy at "
          f"{args.rate:g} records/s (load average {out['config']['loadavg']:.1f}, "
          f"{os.cpu_count()} CPUs):")
    for name in ("baseline", "current"):
        if name not in out:
            continue
        r = out[name]
        print(f"  {name}:")
        print(f"    idle, no rings      {r['idle_no_rings']['cpu_s_per_min']:7.3f} CPU-s/min")
        print(f"    idle, {args.rings} rings      {r['idle_rings']['cpu_s_per_min']:7.3f} "
              "CPU-s/min")
        bz = r["busy"]
        print(f"    busy                {bz['cpu_s_per_min']:7.3f} CPU-s/min, "
              f"{bz['cpu_ms_per_1k_records']:.2f} CPU-ms per 1,000 records (net of idle); "
              f"write→publish p50 {bz['lat_p50_ms']:.0f} ms, p99 {bz['lat_p99_ms']:.0f} ms, "
              f"max {bz['lat_max_ms']:.0f} ms")
        bu = r["bursts"]
        print(f"    a burst every {args.burst_every:g} s: write→publish p50 "
              f"{bu['lat_p50_ms']:.0f} ms, max {bu['lat_max_ms']:.0f} ms")
        if "job" in r:
            j = r["job"]
            print(f"    real job ({args.rings} ranks, {args.job_steps} steps, "
                  f"{j['wall_s']:.1f} s): {j['cpu_s']:.3f} CPU-s, {j['records']:.0f} records, "
                  f"{j['cpu_ms_per_1k_records']:.2f} CPU-ms per 1,000 records")
    if "ratio" in out:
        print("  ratio current / baseline: " + ", ".join(
            f"{k} {v}×" for k, v in out["ratio"].items() if v is not None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
