"""What a pending slowdown trigger's try costs the worker, with each read querying everything and
with the worker's reads (`DiagnosisAgents._read`).

    rankwatch bench tries [--rounds 6] [--tries 5] [--json]
    rankwatch bench tries --report RUN.json --workdir DIR [--cases a,b] [--rounds 6]
    rankwatch bench tries --report RUN.json --workdir DIR --scan [--cases a,b]

A try (`Analyst._slow_try`) reads the job's stage records over 90 s, then its calls (and the
other kinds a sweep reads) from the judged steps on, and runs the slowdown analysis; a
pending trigger is tried as often as its cost allows (its cost over `pending_share`), so a
cheaper try names a slowdown sooner after its evidence is stored. Two read paths, interleaved
round by round in one process over the same stored tables:

- **query**: every read looks the job's topology up and queries every kind it asks for
  (`read_topology` + `read_window`: the worker's reads before the topology was kept for
  `TOPOLOGY_TTL_S` and the stage records served from the stored batches' copy);
- **agents**: `DiagnosisAgents._read` as the worker runs it — one topology look-up a second,
  the stage records from `diagnosis.stage_rows` (anchored by the first try's query).

Each try's cost is what paces the next: the calling thread's CPU time plus the time the
database thread spent on its queries (`Database.busy_s`). The conclusions of the two paths
must be the same, try by try. Without `--report` the tables are a simulated 4-rank job
(tp1·pp2·dp2, 120 steps, one rank's GPU 1.6× slower from 15 s on) stored into a private
embedded ClickHouse; with `--report RUN.json --workdir DIR` (a kept `rankwatch eval --real`
run) they are that run's own store, and the tries start at each slowdown case's onset.

`--scan` asks what the rules say, not what they cost: a try every `TRY_GAP_MS` over the whole
run of every traced case of the kept run (from 2 s into the job; a slowdown fault's from its
onset, for 4 s), on that run's store, with the code as it is now. It prints, per control,
the moments that named a culprit (each one an incident a live worker could have opened, had
a try come then), and per slowdown fault the first moment that named its rank(s) right. A
replay of the run's captures (`rankwatch eval --real --rescore`) tries at the moments its own
timing gives; the scan tries at all of them — the stored tables are what a live try read,
save for records stored after the moment with times before it. Exit status 1 when a control
was named.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ingest.units import MILLISECOND, SECOND

#: the moments tried: one every `TRY_GAP_MS` from the start given
TRY_GAP_MS = 100


def _simulated(d: str, say: Any) -> tuple[Any, list[tuple[str, int]]]:
    from diagnosis.analyst import SWEEP_KINDS
    from ingest.batch import decode_batch
    from ingest.records import MODELS
    from ingest.sim.config import JobConfig
    from ingest.sim.simulation import Simulation
    from streams.db import Database, migrate
    from streams.writer import ClickHouseWriter

    cfg = JobConfig(job_id="bench-tries", tp=1, pp=2, dp=2, steps=120, microbatches=2, seed=3)
    sim = Simulation(cfg, ["gpu_slow rank=3 factor=1.6 at=15s"])
    db = Database(f"chdb://{d}", "bench")
    migrate(db)
    writer = ClickHouseWriter(db)
    raw = frozenset(SWEEP_KINDS) & frozenset(MODELS)

    async def load() -> int:
        n = 0
        await writer.write_topologies([sim.topology()], "tries:topo")
        for i, (_, kind, data) in enumerate(sim.batches(kinds=raw)):
            if kind != "jobs":
                n += await writer.write(kind, [decode_batch(data)], f"tries:{i}")
        return n

    say("simulating a 4-rank job (tp1·pp2·dp2, 120 steps) into a private ClickHouse…")
    say(f"  {asyncio.run(load()):,} records stored")
    # the tries start 8 median steps after the fault's onset (15 s of job time): its
    # evidence complete, as a pending trigger's last tries see it
    first, step_ns = db.query(
        "SELECT toUnixTimestamp64Nano(min(t_start)), median(data_next_wait + model_fwd_loss + "
        "model_backward + callbacks + optim_step + step_other) FROM stages "
        "WHERE job_id = 'bench-tries'").result_rows[0]
    return db, [("bench-tries", int(first) + 15 * SECOND + 8 * int(step_ns))]


def _store(workdir: Path) -> Any:
    """The kept run's embedded ClickHouse (its worker stopped)."""
    from streams.db import Database

    store = workdir / "stack" / "clickhouse"
    if not store.is_dir():
        raise SystemExit(f"{store}: no store there; --workdir must be the run's --workdir")
    return Database(f"chdb://{store}", "rankwatch", create=False)


def _kept(report: Path, workdir: Path, cases: set[str] | None) -> tuple[Any, list[tuple[str, int]]]:
    r = json.loads(report.read_text())
    jobs = [(c["job"], int(c["truth"]["onset_ns"])) for c in r.get("cases", [])
            if not c.get("control") and (c.get("truth") or {}).get("kind") == "slowdown"
            and (cases is None or c["case"] in cases)]
    if not jobs:
        raise SystemExit(f"{report}: no slowdown case{' of --cases' if cases else ''} in it")
    return _store(workdir), jobs


def run(db: Any, jobs: list[tuple[str, int]], rounds: int, tries: int, say: Any
        ) -> dict[str, Any]:
    from diagnosis.agents import DiagnosisAgents, read_topology, read_window
    from diagnosis.analyst import Analyst, Reader
    from diagnosis.stage_rows import StageRows
    from diagnosis.window import Window

    def query_read(job_id: str, start_ns: int, now_ns: int,
                   kinds: Collection[str] | None = None) -> Window | None:
        topo = read_topology(db, job_id)
        return None if topo is None else read_window(db, topo, start_ns, now_ns, kinds)

    def agents_read() -> Reader:
        a = DiagnosisAgents.__new__(DiagnosisAgents)  # its read path alone
        a.db, a.topos, a.topo_read, a.stage_rows = db, {}, {}, StageRows()
        return a._read

    def spent() -> float:
        return time.thread_time() + float(db.busy_s())

    cost: dict[str, list[float]] = {"query": [], "agents": []}
    said: dict[str, dict[tuple[str, int], Any]] = {"query": {}, "agents": {}}
    for rnd in range(rounds):
        order = ("query", "agents") if rnd % 2 == 0 else ("agents", "query")
        for name in order:
            for job, start in jobs:
                analyst = Analyst(query_read if name == "query" else agents_read())
                for i in range(tries):
                    at = start + i * TRY_GAP_MS * MILLISECOND
                    c0 = spent()
                    got = analyst._slow_try(job, at)
                    cost[name].append((spent() - c0) * 1e3)
                    c = None if got is None else got[0]
                    said[name][(job, i)] = None if c is None else (
                        c.kind, tuple(c.ranks), c.stage, c.component, round(c.confidence, 6))
        say(f"  round {rnd + 1}/{rounds}: query {statistics.median(cost['query']):.1f} ms, "
            f"agents {statistics.median(cost['agents']):.1f} ms a try (medians so far)")
    q, a = statistics.median(cost["query"]), statistics.median(cost["agents"])
    return {"jobs": len(jobs), "tries": len(cost["query"]),
            "query_ms": {"median": round(q, 2), "mean": round(statistics.mean(cost["query"]), 2)},
            "agents_ms": {"median": round(a, 2),
                          "mean": round(statistics.mean(cost["agents"]), 2)},
            "ratio": round(a / q, 3) if q else None,
            "named": sum(v is not None for v in said["agents"].values()),
            "identical": said["query"] == said["agents"]}


def scan(db: Any, report: Path, cases: set[str] | None, say: Any) -> dict[str, Any]:
    """`--scan` (module docstring): {"controls": {case: [[s into the job, ranks, stage,
    confidence], …]}, "faults": {case: [s after the onset, stage, confidence] or None}}."""
    from diagnosis.agents import read_topology, read_window
    from diagnosis.analyst import Analyst
    from diagnosis.window import Window

    def read(job_id: str, start_ns: int, now_ns: int,
             kinds: Collection[str] | None = None) -> Window | None:
        topo = read_topology(db, job_id)
        return None if topo is None else read_window(db, topo, start_ns, now_ns, kinds)

    gap = TRY_GAP_MS * MILLISECOND
    out: dict[str, Any] = {"controls": {}, "faults": {}, "tries": 0}
    for c in json.loads(report.read_text()).get("cases", []):
        truth, run_ = c.get("truth") or {}, c.get("run") or {}
        if not c.get("traced") or not run_ or (cases is not None and c["case"] not in cases):
            continue
        analyst = Analyst(read)
        if c.get("control"):
            at, end, named = int(run_["start_ns"]) + 2 * SECOND, int(run_["end_ns"]), []
            while at <= end:
                got = analyst._slow_try(c["job"], at)
                out["tries"] += 1
                k = None if got is None else got[0]
                if k is not None:
                    named.append([round((at - int(run_["start_ns"])) / SECOND, 1),
                                  list(k.ranks), k.stage, round(k.confidence, 2)])
                at += gap
            out["controls"][c["case"]] = named
            say(f"  {c['case']}: {len(named)} moment(s) named a culprit")
        elif truth.get("kind") == "slowdown":
            onset = int(truth["onset_ns"])
            at, first = onset, None
            while at <= onset + 4 * SECOND and first is None:
                got = analyst._slow_try(c["job"], at)
                out["tries"] += 1
                k = None if got is None else got[0]
                if k is not None and sorted(k.ranks) == sorted(truth["ranks"]):
                    first = [round((at - onset) / SECOND, 1), k.stage, round(k.confidence, 2)]
                at += gap
            out["faults"][c["case"]] = first
            say(f"  {c['case']}: first named right {'never' if first is None else first}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench tries", description=__doc__.split("\n")[0])
    p.add_argument("--report", type=Path, help="a kept `rankwatch eval --real` run's --out")
    p.add_argument("--workdir", type=Path, help="… and its --workdir")
    p.add_argument("--cases", help="with --report: comma-separated slowdown cases")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tries", type=int, default=5, help=f"per job and round, {TRY_GAP_MS} ms apart")
    p.add_argument("--scan", action="store_true",
                   help="with --report: what the rules say at every moment of every case")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.rounds, args.tries) < 1:
        p.error("--rounds and --tries must be at least 1")
    if (args.report is None) != (args.workdir is None):
        p.error("--report and --workdir go together")

    def say(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    if args.scan:
        if args.report is None:
            p.error("--scan needs --report and --workdir (a kept `rankwatch eval --real` run)")
        cases = set(args.cases.split(",")) if args.cases else None
        db = _store(args.workdir)
        try:
            got = scan(db, args.report, cases, say)
        finally:
            db.close()
        if args.json:
            print(json.dumps(got))
        else:
            named = {k: v for k, v in got["controls"].items() if v}
            print(f"{got['tries']:,} tries; controls named at some moment: {len(named)} of "
                  f"{len(got['controls'])}" + "".join(f"\n  {k}: {v}" for k, v in named.items()))
            print("slowdown faults, first moment named right (s after the onset, stage, "
                  "confidence):" + "".join(f"\n  {k}: {v}" for k, v in got["faults"].items()))
        if not got["controls"] and not got["faults"]:
            print("no traced case of the report matched", file=sys.stderr)
            return 1
        return 1 if any(got["controls"].values()) else 0

    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-tries-") as d:
        if args.report is None:
            db, jobs = _simulated(d, say)
        else:
            cases = set(args.cases.split(",")) if args.cases else None
            db, jobs = _kept(args.report, args.workdir, cases)
        try:
            r = run(db, jobs, args.rounds, args.tries, say)
        finally:
            db.close()
    if args.json:
        print(json.dumps(r))
    else:
        print(f"a slowdown try's cost, {r['tries']} tries a path over {r['jobs']} job(s), "
              f"interleaved: each read querying {r['query_ms']['median']} ms median "
              f"({r['query_ms']['mean']} mean), the worker's reads "
              f"{r['agents_ms']['median']} ms ({r['agents_ms']['mean']}): {r['ratio']}×")
        print(f"  conclusions identical: {'yes' if r['identical'] else 'NO'} "
              f"({r['named']} tries named a culprit)")
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
