"""`rankwatch eval`: score diagnoses against the simulator's ground truth.

    rankwatch eval --catalog standard [--scenarios a,b,...] [--json] [--out FILE]
    rankwatch eval --in-process [--scenarios ...]          # fast development mode

Real pipeline (default): starts a private stack (broker + worker with the diagnosis agents, in a
temporary home on free ports), runs each scenario with `rankwatch simulate --speed realtime
--out kafka` in a separate process, reads rw.diagnoses, and scores them (diagnosis.evaluate).
Scenarios run one after another in real time, so the default real-pipeline set is a subset
(`REAL_SUBSET`, ~10 minutes on two cores); `--scenarios all` runs the whole catalog. The
in-process mode runs the same triggers and engine on the simulator's records in simulated time
over the whole catalog; its figures are for development, the real pipeline's are the reported
ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from diagnosis.evaluate import ScenarioScore, evaluate_in_process, score_scenario, summarize
from diagnosis.model import Diagnosis
from rankwatch.settings import Settings

REAL_SUBSET = ("control-64", "hang-bwd-64", "death-64", "nic-down-64", "gpu-slow-150-64",
               "nic-bw-20-64", "data-stall-64", "gpu-slow-102-small-64")
SETTLE_S = 12.0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("eval", help="score diagnoses against the scenario catalog's truth")
    p.add_argument("--catalog", default="standard", choices=["standard"])
    p.add_argument("--scenarios", default="", help="comma-separated names, or 'all'")
    p.add_argument("--in-process", action="store_true", help="fast mode: no broker/worker")
    p.add_argument("--json", action="store_true", help="print the JSON report only")
    p.add_argument("--out", default="eval.json", help="where to write the JSON report")
    p.set_defaults(func=run)


def _names(arg: str, real: bool) -> list[str] | None:
    from ingest.sim.scenario import load_catalog

    if arg == "all":
        return list(load_catalog())
    if arg:
        return [s.strip() for s in arg.split(",") if s.strip()]
    return list(REAL_SUBSET) if real else None


def table(summary: dict[str, Any], scores: list[ScenarioScore], mode: str) -> str:
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
    w = max(len(a) for a, _ in rows)
    out = [f"  {a:<{w}}  {b}" for a, b in rows]
    out.append("")
    out.append(f"  {'scenario':<28} {'fault':<44} det rank st1 st2 comp  lat_s")
    for sc in scores:
        if not sc.faults:
            out.append(f"  {sc.scenario:<28} {'(none expected)':<44} incidents={sc.incidents}")
        for f in sc.faults:
            def b(x: bool) -> str:
                return " y " if x else " . "
            out.append(f"  {sc.scenario:<28} {f.fault[:44]:<44}{b(f.detected)}{b(f.rank_exact)} "
                       f"{b(f.stage_top1)}{b(f.stage_top2)}{b(f.component)}  "
                       f"{'' if f.latency_s is None else round(f.latency_s, 1)}")
    return "\n".join(out)


def run(args: argparse.Namespace, settings: Settings) -> int:
    names = _names(args.scenarios, not args.in_process)
    def say(m: str) -> None:
        if not args.json:
            print(m, file=sys.stderr)

    if args.in_process:
        def prog(s: ScenarioScore, _: Any) -> None:
            say(f"  {s.scenario}: {s.wall_s:.1f} s, incidents {s.incidents}")
        scores, summary = evaluate_in_process(names, prog)
        mode = "in-process (simulated time)"
    else:
        scores = real_pipeline(names or list(REAL_SUBSET), say)
        summary = summarize(scores)
        mode = "real pipeline (broker, Faust worker, ClickHouse; realtime)"
    report = {"mode": mode, "summary": summary,
              "scenarios": [{**asdict(s), "analysis_ms": None} for s in scores]}
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(table(summary, scores, mode))
        print(f"\n  report: {args.out}")
    return 0


def real_pipeline(names: list[str], say: Any) -> list[ScenarioScore]:
    from confluent_kafka import Consumer

    from ingest.sim.scenario import load_catalog
    from ingest.sim.truth import TruthRecord
    from rankwatch import stack

    cat = load_catalog()
    scores: list[ScenarioScore] = []
    with tempfile.TemporaryDirectory(prefix="rankwatch-eval-") as home:
        settings = stack.private_settings(Path(home), topic_prefix="eval")
        stack.up(settings, progress=say)
        consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": "eval",
                             "auto.offset.reset": "earliest"})
        consumer.subscribe([settings.topics.diagnoses])
        got: list[Diagnosis] = []
        try:
            for name in names:
                sc = cat[name]
                say(f"eval: {name} (realtime)…")
                t0 = time.time()
                res = subprocess.run(
                    [sys.executable, "-m", "rankwatch.cli", "simulate", "--scenario", name,
                     "--speed", "realtime", "--out", "kafka", "--json"],
                    env=stack.child_env(settings), capture_output=True, text=True, timeout=900)
                if res.returncode:
                    raise RuntimeError(f"simulate {name} failed: {res.stderr[-2000:]}")
                truth = [TruthRecord.model_validate(t) for t in json.loads(res.stdout)["truth"]]
                deadline = time.time() + SETTLE_S
                while time.time() < deadline:
                    m = consumer.poll(0.5)
                    if m is not None and not m.error():
                        got.append(Diagnosis.model_validate_json(m.value() or b"{}"))
                mine = [d for d in got if d.job_id == sc.config.job_id]
                s = score_scenario(name, sc.tags, truth, mine)
                s.wall_s = time.time() - t0
                s.analysis_ms = [d.analysis_ms for d in mine]
                scores.append(s)
                say(f"  {name}: {len(mine)} diagnosis versions, "
                    + ", ".join(f"{d.status} {d.kind} ranks={d.culprit_ranks[:4]} "
                                f"stage={d.stage} comp={d.component}" for d in mine[:4]))
        finally:
            consumer.close()
            stack.down(settings, progress=say)
    return scores
