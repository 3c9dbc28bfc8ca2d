"""`rankwatch eval`: score diagnoses against the simulator's ground truth.

    rankwatch eval --catalog standard [--scenarios a,b,...] [--json] [--out FILE]
    rankwatch eval --in-process [--scenarios ...]          # fast development mode
    rankwatch eval --in-process --catalog realistic        # the noise of real CPU jobs
    rankwatch eval --real [--quick | --cases a,b*] [--list] [--json]   # real PyTorch training

`--real` trains for real (CPU torch, gloo, torchrun) through tracer, ring, `rankwatch agent`,
broker and worker, and scores rw.diagnoses against the truth the jobs write themselves
(bench.real.harness; docs/real-catalog.md).

Real pipeline (default): starts a private stack (broker + worker with the diagnosis agents, in a
temporary home on free ports), runs each scenario with `rankwatch simulate --speed realtime
--out kafka` in a separate process, reads rw.diagnoses, and scores them (diagnosis.evaluate).
Scenarios run one after another in real time, so the default real-pipeline set is a subset
(`REAL_SUBSET`, ~10 minutes on two cores); `--scenarios all` runs the whole catalog. The
in-process mode runs the same triggers and engine on the simulator's records in simulated time
over the whole catalog; its figures are for development, the real pipeline's are the reported
ones. `--catalog realistic` scores the realistic catalog (ingest/sim/realistic.toml: jobs with
the jitter, OS noise, shared cores and small peer sets of real CPU runs); its default set, in
either mode, is the whole catalog.

Where the seconds go (real pipeline, `latency_stages` in the report): for every detected fault the
time from onset to the published diagnosis splits into
- `detect_wait_s`: onset → the trigger's clock reading (`Diagnosis.trigger.ts`): the event time
  the trigger needed (heartbeat timeout, k slow steps, window granularity); for the root-cause
  sweep, whose clock is the wall clock, the wait for the next sweep;
- `feed_lag_s`: the trigger's clock → the trigger on rw.triggers (broker timestamp): how far the
  trigger clock trails the wall clock (source batching, raw sink, derived window close, feed);
- `rca_s`: the trigger on rw.triggers → the diagnosis (`detected_ns`): window read and engine.
and per scenario the lags read back through the worker's SQL endpoint: raw rows stored
(ingest_ts − event time), progress windows and iteration rows stored (ingest_ts − window_end /
t_end).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from diagnosis.evaluate import ScenarioScore, evaluate_in_process, score_scenario, summarize
from diagnosis.model import Diagnosis
from ingest.units import SECOND
from rankwatch.settings import Settings

REAL_SUBSET = ("control-64", "hang-bwd-64", "death-64", "nic-down-64", "gpu-slow-150-64",
               "nic-bw-20-64", "data-stall-64", "gpu-slow-102-small-64")
SETTLE_S = 12.0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("eval", help="score diagnoses against the scenario catalog's truth")
    p.add_argument("--catalog", default="standard", choices=["standard", "realistic"],
                   help="scenario catalog: standard (clean model) or realistic (noise of real "
                        "CPU jobs, ingest/sim/realism.py)")
    p.add_argument("--scenarios", default="", help="comma-separated names, or 'all'")
    p.add_argument("--in-process", action="store_true", help="fast mode: no broker/worker")
    p.add_argument("--json", action="store_true", help="print the JSON report only")
    p.add_argument("--out", default="eval.json", help="where to write the JSON report")
    p.add_argument("--real", action="store_true",
                   help="the real-workload catalog (real PyTorch training, gloo on CPU)")
    p.add_argument("--cases", default="",
                   help="--real: comma-separated case names, prefix* or a tag (heldout, extended)")
    p.add_argument("--quick", action="store_true", help="--real: the quick subset")
    p.add_argument("--list", action="store_true", help="--real: list the cases and exit")
    p.add_argument("--rescore", metavar="REPORT", default="",
                   help="--real: re-score a kept run (its --out report and --workdir) by "
                        "replaying the captures its agents wrote, in process; no training")
    p.add_argument("--evidence", action="store_true",
                   help="--real --rescore: for each slowdown case, when its evidence was "
                        "complete (records stored as made), beside its live latency")
    p.add_argument("--host-nice", type=int, default=None, metavar="N",
                   help="--real: nice of the training host's processes (ranks, agent, hogs), "
                        "the stack standing for machines of its own; 0: one priority "
                        "(default 10)")
    p.add_argument("--workdir", default="",
                   help="--real: keep the cases' logs, truth and the stack's data here "
                        "(default: a temporary directory, removed)")
    p.set_defaults(func=run)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_real(args: argparse.Namespace) -> int:
    """`rankwatch eval --real` (bench.real.harness)."""
    from bench.real import catalog, harness

    try:
        cases = catalog.select(args.cases, args.quick)
    except ValueError as e:
        print(f"rankwatch eval: {e}", file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            tags = f" [{', '.join(c.tags)}]" if c.tags else ""
            print(f"{c.name:<24} {c.shape:<8} x{c.nproc} {c.steps:>4} steps  "
                  f"{c.describe()}{tags}")
        return 0
    def say(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    t0 = time.time()
    if args.evidence and not args.rescore:
        print("rankwatch eval: --evidence replays a kept run: give it --rescore run.json "
              "--workdir DIR", file=sys.stderr)
        return 2
    if args.rescore:
        return rescore_real(args, say)
    nice = harness.HOST_NICE if args.host_nice is None else args.host_nice
    if not 0 <= nice <= 19:
        print(f"rankwatch eval: --host-nice {nice}: give 0 to 19", file=sys.stderr)
        return 2
    # a SIGTERM (timeout, a scheduler) unwinds like Ctrl-C: the training jobs, agents, CPU hogs
    # and the private stack are stopped by the harness's `finally` blocks, not orphaned
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        workdir = Path(args.workdir) if args.workdir else None
        if workdir is not None:
            workdir.mkdir(parents=True, exist_ok=True)
        results, summary = harness.run_catalog(cases, say, home=workdir, host_nice=nice)
    except RuntimeError as e:
        print(f"rankwatch eval: {e}", file=sys.stderr)
        return 1
    doc = harness.report(results, summary)
    doc["wall_s"] = round(time.time() - t0, 1)
    doc["host_nice"] = nice
    doc["command"] = "rankwatch eval --real" + (" --quick" if args.quick else "") + (
        f" --cases {args.cases}" if args.cases else "") + (
        f" --host-nice {nice}" if nice != harness.HOST_NICE else "")
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str))
    if args.json:
        print(json.dumps(doc, default=str))
    else:
        print(harness.table(results, summary))
        print(f"\n  {len(results)} cases in {doc['wall_s']:.0f} s; report: {args.out}")
    return 1 if summary["errors"] and len(summary["errors"]) == len(results) else 0


def rescore_real(args: argparse.Namespace, say: Any) -> int:
    """`rankwatch eval --real --rescore REPORT --workdir DIR`."""
    from bench.real import harness

    if not args.workdir:
        print("rankwatch eval: --rescore needs the run's --workdir (where its captures are)",
              file=sys.stderr)
        return 2
    try:
        doc = json.loads(Path(args.rescore).read_text())
    except (OSError, ValueError) as e:
        print(f"rankwatch eval: cannot read the report {args.rescore}: {e}", file=sys.stderr)
        return 2
    if args.evidence:
        return evidence_real(doc, Path(args.workdir), args, say)
    results, summary = harness.rescore(doc, Path(args.workdir), say)
    if not any(r.traced for r in results):
        print("rankwatch eval: the report has no traced case to re-score", file=sys.stderr)
        return 1
    out = harness.report(results, summary)
    out["mode"] = "replayed captures of a real run, in process (" + str(args.rescore) + ")"
    if args.out != args.rescore:
        Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    if args.json:
        print(json.dumps(out, default=str))
    else:
        print(harness.table(results, summary))
    return 0


def evidence_real(doc: dict[str, Any], workdir: Path, args: argparse.Namespace,
                  say: Any) -> int:
    """`rankwatch eval --real --rescore REPORT --workdir DIR --evidence` (bench/real/evidence):
    per slowdown case, when its evidence was complete (records stored as made), when the run's
    own store named it (rows as they were inserted: the record path's cost), and its live
    latency."""
    from bench.real import harness
    from bench.real.evidence import evidence_ready, stored_ready
    from streams.db import Database

    rows: list[dict[str, Any]] = []
    cases = [c for c in doc.get("cases") or []
             if (c.get("truth") or {}).get("kind") == "slowdown" and c.get("traced")]
    db: Database | None = None
    store = workdir / "stack" / "clickhouse"
    if cases and store.is_dir():
        try:
            db = Database(f"chdb://{store}", Settings().clickhouse_database, create=False)
        except Exception as e:  # another process holds it, or it is damaged
            say(f"the run's store at {store} cannot be opened ({type(e).__name__}: {e}); "
                "the 'as stored' column is left out")
    elif cases:
        say(f"no store at {store}: the 'as stored' column is left out")
    for i, c in enumerate(cases, 1):
        cap = workdir / "cases" / str(c.get("job")) / harness.CAPTURE
        if not cap.exists():
            say(f"[{i}/{len(cases)}] {c['case']}: no capture at {cap}")
            continue
        say(f"[{i}/{len(cases)}] {c['case']}: replaying its capture…")
        t = c["truth"]
        try:
            ready = evidence_ready(cap, int(t["onset_ns"]), t.get("ranks") or [],
                                   c.get("step_ends_ms") or [])
        except (OSError, ValueError, KeyError) as e:  # a damaged capture or report
            say(f"[{i}/{len(cases)}] {c['case']}: cannot replay {cap}: {e}")
            continue
        stored, read = None, False
        if db is not None and ready is not None:
            try:
                stored = stored_ready(db, str(c.get("job")), int(t["onset_ns"]),
                                      t.get("ranks") or [], c.get("step_ends_ms") or [],
                                      from_s=ready.after_s)
                read = True
            except Exception as e:  # a store without this job's tables, or damaged
                say(f"[{i}/{len(cases)}] {c['case']}: cannot read the run's store: "
                    f"{type(e).__name__}: {e}")
        rows.append({"case": c["case"], "live_s": c.get("latency_s"),
                     "live_steps": c.get("latency_steps"),
                     "evidence_s": ready.after_s if ready else None,
                     "evidence_steps": ready.steps if ready else None,
                     "stored_s": stored.after_s if stored else None,
                     "stored_steps": stored.steps if stored else None,
                     # the store was searched (a None above: it never named the culprit)
                     "stored_read": read,
                     "evidence_named": None if ready is None else
                     f"{list(ready.conclusion.ranks)} {ready.conclusion.stage}",
                     "visible_ms": ready.visible_ms if ready else 0,
                     "bursts": ready.bursts if ready else 0})
    if db is not None:
        db.close()
    if not rows:
        print("rankwatch eval: no slowdown case with a capture to replay", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"evidence": rows}, default=str))
        return 0
    print(f"  {'case':<22} {'live: s (steps)':>18} {'evidence complete: s (steps)':>30} "
          f"{'as stored: s (steps)':>22} {'seen: ms (bursts)':>18}  named")
    for r in rows:
        live = "-" if r["live_s"] is None else f"{r['live_s']} ({r['live_steps']})"
        ev = "never" if r["evidence_s"] is None else \
            f"{r['evidence_s']} ({r['evidence_steps']})"
        st = f"{r['stored_s']} ({r['stored_steps']})" if r["stored_s"] is not None else \
            "never" if r["stored_read"] else "-"
        seen = f"{r['visible_ms']} ({r['bursts']})"
        print(f"  {r['case']:<22} {live:>18} {ev:>30} {st:>22} {seen:>18}  "
              f"{r['evidence_named'] or ''}")
    return 0


def _names(arg: str, real: bool, catalog: str = "standard") -> list[str]:
    from ingest.sim.scenario import load_catalog

    cat = load_catalog(catalog)
    if arg and arg != "all":
        names = [s.strip() for s in arg.split(",") if s.strip()]
        unknown = [n for n in names if n not in cat]
        if unknown:
            raise KeyError(f"unknown scenarios in catalog {catalog!r}: {', '.join(unknown)}; "
                           f"known: {', '.join(cat)}")
        return names
    if real and not arg and catalog == "standard":
        return list(REAL_SUBSET)
    return list(cat)


def incident_brief(diags: list[Diagnosis]) -> list[dict[str, Any]]:
    """Each incident's last version before resolution, in a few words (the report's
    `incident_briefs`: what a false alarm said)."""
    last: dict[str, Diagnosis] = {}
    for d in sorted(diags, key=lambda d: (d.incident_id, d.version)):
        if d.status != "resolved" or d.incident_id not in last:
            last[d.incident_id] = d
    return [{"kind": d.kind, "ranks": d.culprit_ranks[:8], "stage": d.stage,
             "component": d.component, "confidence": round(d.confidence, 2),
             "rules": d.rules[:4], "version": d.version,
             "evidence": (d.evidence[0].summary if d.evidence else d.summary)[:160]}
            for d in sorted(last.values(), key=lambda d: d.detected_ns)]


def table(summary: dict[str, Any], scores: list[ScenarioScore], mode: str,
          incidents: dict[str, list[dict[str, Any]]] | None = None) -> str:
    h, s, lat = summary["hang"], summary["slowdown"], summary["latency_s"]
    rows = [
        ("mode", mode),
        ("scenarios / expected faults", f"{summary['scenarios']} / {summary['faults']}"),
        ("hang precision / recall", f"{h['precision']:.2f} / {h['recall']:.2f} "
                                    f"({h['faults']} hangs)"),
        ("hang exact rank + stage", f"{h['rank_and_stage']}"),
        ("slowdown precision / recall / F1", f"{s['precision']:.2f} / {s['recall']:.2f} / "
                                             f"{s['f1']:.2f} ({s['faults']} faults)"),
        ("stage routing top-1 / top-2", f"{summary['stage_top1']} / {summary['stage_top2']}"),
        ("component accuracy", f"{summary['component']}"),
        ("onset -> diagnosis p50 / p90 (s)", f"{lat['p50']} / {lat['p90']}"),
        ("false alarms: controls / too small", f"{summary['false_alarms_controls']} / "
                                               f"{summary['false_alarms_small']}"),
        ("root-cause analysis p50 (ms)", f"{summary['analysis_ms_p50']}"),
    ]
    cal = ", ".join(f"{r['confidence']}: {r['right']} of {r['versions']}"
                    for r in summary.get("calibration", []) if r["versions"])
    rows.append(("versions right, by confidence", cal or "(none published)"))
    w = max(len(a) for a, _ in rows)
    out = [f"  {a:<{w}}  {b}" for a, b in rows]
    out.append("")
    out.append(f"  {'scenario':<28} {'fault':<44} det rank st1 st2 comp  lat_s")
    for sc in scores:
        if not sc.faults:
            out.append(f"  {sc.scenario:<28} {'(none expected)':<44} incidents={sc.incidents}")
            for i in (incidents or {}).get(sc.scenario, []):
                out.append(f"      {i['kind']} ranks={i['ranks']} stage={i['stage']} "
                           f"comp={i['component']} conf={i['confidence']} "
                           f"rules={','.join(i['rules'])}: {i['evidence'][:90]}")
        for f in sc.faults:
            def b(x: bool) -> str:
                return " y " if x else " . "
            out.append(f"  {sc.scenario:<28} {f.fault[:44]:<44}{b(f.detected)}{b(f.rank_exact)} "
                       f"{b(f.stage_top1)}{b(f.stage_top2)}{b(f.component)}  "
                       f"{'' if f.latency_s is None else round(f.latency_s, 1)}")
    return "\n".join(out)


def stage_table(stages: list[dict[str, Any]]) -> str:
    """The latency breakdown as text (see the module docstring for the columns)."""
    out = ["", f"  {'scenario':<24} {'trigger (rule)':<36} {'wait':>6} {'feed':>6} {'rca':>6}"
               f" {'total':>6}   stored lag p50 s: ops beats progress iterations"]
    def f(x: Any) -> str:
        return "" if x is None else f"{x:.2f}"
    for r in stages:
        lag = r.get("lags_s", {})
        lags = " ".join(f(lag.get(k, {}).get("p50")) or "-" for k in
                        ("ops_stored", "beats_stored", "progress_stored", "iterations_stored"))
        trig = f"{r.get('trigger', '-')} ({r.get('rule', '')})" if "trigger" in r else "-"
        out.append(f"  {r['scenario']:<24} {trig[:36]:<36} {f(r.get('detect_wait_s')):>6} "
                   f"{f(r.get('feed_lag_s')):>6} {f(r.get('rca_s')):>6} "
                   f"{f(r.get('latency_s')):>6}   {lags}")
    return "\n".join(out)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.real:
        return run_real(args)
    if args.list or args.quick or args.cases:
        print("rankwatch eval: --list, --quick and --cases go with --real", file=sys.stderr)
        return 2
    try:
        names = _names(args.scenarios, not args.in_process, args.catalog)
    except KeyError as e:
        print(f"rankwatch eval: {e.args[0]}", file=sys.stderr)
        return 2
    def say(m: str) -> None:
        if not args.json:
            print(m, file=sys.stderr)

    briefs: dict[str, list[dict[str, Any]]] = {}
    if args.in_process:
        def prog(s: ScenarioScore, diags: list[Diagnosis]) -> None:
            briefs[s.scenario] = incident_brief(diags)
            say(f"  {s.scenario}: {s.wall_s:.1f} s, incidents {s.incidents}"
                + "".join(f"; {d.kind} ranks={d.culprit_ranks[:4]} stage={d.stage} "
                          f"comp={d.component} conf={d.confidence:.2f}"
                          for d in diags if d.version == 1))
        scores, summary = evaluate_in_process(names, prog, args.catalog)
        mode = f"in-process (simulated time), catalog {args.catalog}"
    else:
        stages: list[dict[str, Any]] = []
        scores = real_pipeline(names, say, stages, args.catalog, briefs)
        summary = summarize(scores)
        mode = f"real pipeline (broker, Faust worker, ClickHouse; realtime), catalog {args.catalog}"
    report: dict[str, Any] = {"mode": mode, "summary": summary,
                              "scenarios": [{**asdict(s), "analysis_ms": None,
                                             "incident_briefs": briefs.get(s.scenario)}
                                            for s in scores]}
    if not args.in_process:
        report["latency_stages"] = stages
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(table(summary, scores, mode, briefs))
        if not args.in_process:
            print(stage_table(stages))
        print(f"\n  report: {args.out}")
    return 0


LAG_SQL = {
    "ops_stored": "SELECT toUnixTimestamp64Nano(ingest_ts) - toUnixTimestamp64Nano(t_end) AS lag "
                  "FROM ops WHERE job_id = {job} AND toUnixTimestamp64Nano(t_end) > 0",
    "beats_stored": "SELECT toUnixTimestamp64Nano(ingest_ts) - toUnixTimestamp64Nano(ts) AS lag "
                    "FROM beats WHERE job_id = {job}",
    "progress_stored": "SELECT min(toUnixTimestamp64Nano(ingest_ts)) - "
                       "toUnixTimestamp64Nano(window_end) AS lag FROM progress "
                       "WHERE job_id = {job} GROUP BY window_end",
    "iterations_stored": "SELECT min(toUnixTimestamp64Nano(ingest_ts)) - "
                         "max(toUnixTimestamp64Nano(t_end)) AS lag FROM iterations "
                         "WHERE job_id = {job} GROUP BY step",
}


def feed_lags(endpoint: str, job_id: str) -> dict[str, dict[str, float]]:
    """p50/p90 (s) of each stage's storage lag for one job, through the worker's SQL endpoint
    (module docstring); a stage the endpoint cannot answer is left out."""
    from rankwatch import http

    out: dict[str, dict[str, float]] = {}
    job = "'" + job_id.replace("\\", "\\\\").replace("'", "\\'") + "'"
    for name, sql in LAG_SQL.items():
        q = (f"SELECT quantiles(0.5, 0.9)(lag) AS q, count() AS n FROM ({sql.format(job=job)}) "
             "FORMAT JSONEachRow")
        try:
            row = json.loads(http.post(endpoint + "/", q.encode(), timeout=30)
                             .body.decode().splitlines()[0])
        except (OSError, ValueError, IndexError):  # http.HTTPFailure is an OSError
            continue
        if int(row["n"]):
            out[name] = {"p50": round(row["q"][0] / 1e9, 3), "p90": round(row["q"][1] / 1e9, 3)}
    return out


def latency_stages(name: str, truth: list[Any], diags: list[Diagnosis],
                   trigger_wall: dict[tuple[str, str, int], int]) -> list[dict[str, Any]]:
    """Onset → trigger clock → trigger on the broker → diagnosis, per detected fault (module
    docstring). `trigger_wall` maps (job, kind, trigger ts) to the broker timestamp (ns)."""
    out = []
    firsts = [d for d in diags if d.version == 1]
    for t in truth:
        if not t.expect_diagnosis:
            continue
        cands = [d for d in firsts if d.detected_ns >= t.start_ns - 2 * SECOND
                 and set(d.culprit_ranks + [r for s in d.suspects for r in s.ranks])
                 & set(t.ranks)]
        if not cands:
            continue
        d = min(cands, key=lambda d: d.detected_ns)
        tr = d.trigger
        wall = trigger_wall.get((d.job_id, tr.kind, tr.ts))
        row: dict[str, Any] = {
            "scenario": name, "fault": t.spec, "trigger": tr.kind, "rule": tr.rule,
            "latency_s": round((d.detected_ns - t.start_ns) / SECOND, 3),
            "detect_wait_s": round((tr.ts - t.start_ns) / SECOND, 3)}
        if wall is not None:
            row["feed_lag_s"] = round((wall - tr.ts) / SECOND, 3)
            row["rca_s"] = round((d.detected_ns - wall) / SECOND, 3)
        out.append(row)
    return out


def real_pipeline(names: list[str], say: Any, stages: list[dict[str, Any]] | None = None,
                  catalog: str = "standard",
                  briefs: dict[str, list[dict[str, Any]]] | None = None) -> list[ScenarioScore]:
    """Run `names` through a private stack; `stages`, when given, receives the latency
    breakdown of every detected fault and each scenario's storage lags (module docstring)."""
    from confluent_kafka import Consumer

    from diagnosis.model import TriggerRecord
    from ingest.sim.scenario import load_catalog
    from ingest.sim.truth import TruthRecord
    from rankwatch import stack

    cat = load_catalog(catalog)
    scores: list[ScenarioScore] = []
    with tempfile.TemporaryDirectory(prefix="rankwatch-eval-") as home:
        settings = stack.private_settings(Path(home), topic_prefix="eval")
        consumer: Consumer | None = None
        got: list[Diagnosis] = []
        trigger_wall: dict[tuple[str, str, int], int] = {}
        try:
            stack.up(settings, progress=say)
            consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": "eval",
                                 "auto.offset.reset": "earliest"})
            consumer.subscribe([settings.topics.diagnoses, settings.topics.triggers])
            for name in names:
                sc = cat[name]
                say(f"eval: {name} (realtime)…")
                t0 = time.time()
                res = subprocess.run(
                    [sys.executable, "-m", "rankwatch.cli", "simulate", "--catalog", catalog,
                     "--scenario", name, "--speed", "realtime", "--out", "kafka", "--json"],
                    env=stack.child_env(settings), capture_output=True, text=True, timeout=900)
                if res.returncode:
                    raise RuntimeError(f"simulate {name} failed: {res.stderr[-2000:]}")
                truth = [TruthRecord.model_validate(t) for t in json.loads(res.stdout)["truth"]]
                deadline = time.time() + SETTLE_S
                while time.time() < deadline:
                    m = consumer.poll(0.5)
                    if m is None or m.error():
                        continue
                    if m.topic() == settings.topics.triggers:
                        tr = TriggerRecord.model_validate_json(m.value() or b"{}")
                        trigger_wall.setdefault((tr.job_id, tr.kind, tr.ts),
                                                m.timestamp()[1] * 1_000_000)
                    else:
                        got.append(Diagnosis.model_validate_json(m.value() or b"{}"))
                mine = [d for d in got if d.job_id == sc.config.job_id]
                s = score_scenario(name, sc.tags, truth, mine)
                s.wall_s = time.time() - t0
                s.analysis_ms = [d.analysis_ms for d in mine]
                scores.append(s)
                if briefs is not None:
                    briefs[name] = incident_brief(mine)
                if stages is not None:
                    rows = latency_stages(name, truth, mine, trigger_wall)
                    lags = feed_lags(stack.sql_endpoint(settings), sc.config.job_id)
                    stages.extend(rows or [{"scenario": name}])
                    stages[-1]["lags_s"] = lags
                say(f"  {name}: {len(mine)} diagnosis versions, "
                    + ", ".join(f"{d.status} {d.kind} ranks={d.culprit_ranks[:4]} "
                                f"stage={d.stage} comp={d.component}" for d in mine[:4]))
        finally:
            if consumer is not None:
                consumer.close()
            stack.down(settings, progress=say)
    return scores
