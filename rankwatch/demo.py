"""`make demo`: what rankwatch is for, in about two minutes.

1. Start a private local stack (Kafka broker + worker with the diagnosis agents) in a temporary
   home on free loopback ports — it never touches a stack you run yourself.
2. Simulate a 256-rank job (tp8 · pp4 · dp8) in real time from a separate process, with one
   injected fault: rank 141 hangs in the backward pass of microbatch 2 after 12 s.
3. Follow rw.diagnoses and print each diagnosis as it arrives, with the SQL an operator would run
   next (and run the first query through the worker's SQL endpoint).
4. Show where the incident's page is (served by the worker while the stack runs) and write it
   as a self-contained HTML report (`rankwatch report`) in the current directory.
5. Stop everything, also on error or Ctrl-C.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from rankwatch import http, stack
from rankwatch.settings import Settings

FAULT = "hang rank=141 stage=bwd mb=2 at=12s"
REPORT = Path("rankwatch-demo-incident.html")
JOB = ["--tp", "8", "--pp", "4", "--dp", "8", "--steps", "40", "--job-id", "demo-256"]


def _sql(settings: Settings, query: str) -> str:
    return http.post(stack.sql_endpoint(settings) + "/?default_format=PrettyCompact",
                     query.encode(), timeout=30).body.decode()


def _report(settings: Settings, incident_id: str) -> str:
    """Point at the incident's page and write its HTML report; the report's path or ""."""
    from diagnosis.page.data import load
    from diagnosis.page.render import incident_page
    from rankwatch.commands.report import settings_query

    url = (f"http://{settings.bind_host}:{settings.page_port}/incidents/"
           f"{urllib.parse.quote(incident_id, safe='')}")
    print(f"\n== the incident's page (while the stack runs): {url}")
    for _ in range(20):  # the worker stores the version right after publishing it
        data = load(settings_query(settings), incident_id)
        if data is not None:
            REPORT.write_text(incident_page(data))
            print(f"== HTML report written: {REPORT.resolve()} "
                  f"(`rankwatch report {incident_id} --html FILE` writes it for any incident)")
            return str(REPORT)
        time.sleep(0.5)
    print("== the incident is not stored yet; no report written", file=sys.stderr)
    return ""


def main() -> int:
    from confluent_kafka import Consumer

    from diagnosis.model import Diagnosis
    from rankwatch.commands.tail import render

    with tempfile.TemporaryDirectory(prefix="rankwatch-demo-") as home:
        settings = stack.private_settings(Path(home), topic_prefix="demo",
                                          page_port=stack.free_port(),
                                          metrics_port=stack.free_port())
        print("== starting the local stack (broker + worker)")
        sim = None
        consumer: Consumer | None = None
        try:
            stack.up(settings, progress=lambda m: print("   " + m))
            consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": "demo",
                                 "auto.offset.reset": "earliest"})
            consumer.subscribe([settings.topics.diagnoses])
            print(f"== simulating a 256-rank job in real time; injected fault: {FAULT!r}")
            sim = subprocess.Popen(
                [sys.executable, "-m", "rankwatch.cli", "simulate", *JOB, "--fault", FAULT,
                 "--speed", "realtime", "--out", "kafka", "--json"],
                env=stack.child_env(settings), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True)
            t0 = time.time()
            seen = 0
            first_incident = ""
            while time.time() - t0 < 150:
                m = consumer.poll(0.5)
                if m is not None and not m.error():
                    d = Diagnosis.model_validate_json(m.value() or b"{}")
                    seen += 1
                    first_incident = first_incident or d.incident_id
                    print(f"\n== diagnosis after {time.time() - t0:.1f} s of the job")
                    print(render(d))
                    if seen == 1 and d.sql:
                        print("\n== the operator's next query (rankwatch sql):")
                        print("   " + d.sql[0])
                        print(_sql(settings, d.sql[0]))
                if seen and sim.poll() is not None:
                    break
            out, _ = sim.communicate(timeout=120)
            truth = json.loads(out)["truth"] if out.strip() else []
            for t in truth:
                print(f"== ground truth: rank {t['ranks']} stage {t['stage']} "
                      f"component {t['component']}")
            if not seen:
                print("== no diagnosis arrived (see the worker log)", file=sys.stderr)
                return 1
            _report(settings, first_incident)
        finally:
            if sim is not None and sim.poll() is None:
                sim.kill()
            if consumer is not None:
                consumer.close()
            print("== stopping the stack")
            stack.down(settings, progress=lambda m: print("   " + m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
