"""`rankwatch tail diagnoses [--json]`: follow rw.diagnoses (or rw.triggers) and print each record.

Human output is one line per diagnosis version (status, kind, culprit, stage, component,
confidence) followed by its evidence summaries and the first SQL an operator would run; `--json`
prints the records as they are on the topic (schema v1, docs/diagnoses.md), one per line.
"""

from __future__ import annotations

import argparse
import time
import uuid

from diagnosis.model import Diagnosis, TriggerRecord
from rankwatch.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("tail", help="follow rw.diagnoses (or rw.triggers) and print records")
    p.add_argument("what", choices=["diagnoses", "triggers"])
    p.add_argument("--json", action="store_true", help="raw JSON, one record per line")
    p.add_argument("--from-beginning", action="store_true", help="replay the topic first")
    p.add_argument("--timeout", type=float, default=0.0, help="stop after N seconds (0: never)")
    p.set_defaults(func=run)


def render(d: Diagnosis) -> str:
    ts = time.strftime("%H:%M:%S", time.localtime(d.detected_ns / 1e9))
    head = (f"{ts} [{d.status} v{d.version}] {d.job_id}: {d.kind} — ranks "
            f"{d.culprit_ranks[:8]}{'…' if len(d.culprit_ranks) > 8 else ''} on "
            f"{', '.join(d.culprit_hosts[:3])}, stage {d.stage}, component {d.component}, "
            f"confidence {d.confidence:.2f} ({d.confidence_label})")
    lines = [head]
    lines += [f"    {e.rule}: {e.summary}" for e in d.evidence[:3]]
    if d.stages[1:]:
        lines.append(f"    also possible: {', '.join(d.stages[1:])}")
    if d.sql:
        lines.append(f"    next: rankwatch sql \"{d.sql[0]}\"")
    return "\n".join(lines)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from confluent_kafka import Consumer

    topic = settings.topics.diagnoses if args.what == "diagnoses" else settings.topics.triggers
    c = Consumer({"bootstrap.servers": settings.bootstrap,
                  "group.id": f"rankwatch-tail-{uuid.uuid4().hex[:8]}",
                  "auto.offset.reset": "earliest" if args.from_beginning else "latest"})
    c.subscribe([topic])
    deadline = time.monotonic() + args.timeout if args.timeout else None
    try:
        while deadline is None or time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            raw = m.value() or b""
            if args.json:
                print(raw.decode(), flush=True)
            elif args.what == "diagnoses":
                print(render(Diagnosis.model_validate_json(raw)), flush=True)
            else:
                t = TriggerRecord.model_validate_json(raw)
                print(f"{t.job_id}: {t.kind} on ranks {t.ranks[:8]} ({t.evidence.get('rule')})",
                      flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        c.close()
    return 0
