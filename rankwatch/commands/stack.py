"""`rankwatch up | down | status | fetch-jars | topics`: the local stack (broker + worker) without
Docker, and the topics every deployment needs (docker-compose.yml runs `topics create`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rankwatch import stack
from rankwatch.kafka import BrokerError
from rankwatch.kafka.admin import ensure_topics, list_topics
from rankwatch.kafka.jars import ensure_jars
from rankwatch.settings import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="start the local Kafka broker and worker (idempotent)")
    p.add_argument("--no-worker", action="store_true", help="start only the broker and topics")
    p.add_argument("--brokers", type=int, metavar="N",
                   help="run N local Kafka nodes as one KRaft cluster (3: topics with three "
                        "copies, two in sync; one broker may be lost); default "
                        "RANKWATCH_KAFKA_BROKERS, 1")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds to wait for each part (a worker rejoining its consumer group "
                        "after an unclean stop can take a minute)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="worker processes sharing the jobs (each job owned by one); with N > 1 "
                        "a store process owns the embedded ClickHouse and serves it to them")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="stop the local worker, then the broker")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("status", help="show each part of the local stack (exit 1 if unhealthy)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("fetch-jars", help="fetch the Kafka broker's jars (cached; first use only)")
    p.set_defaults(func=cmd_fetch_jars)

    p = sub.add_parser("topics", help="create or list rankwatch's Kafka topics")
    p.add_argument("action", choices=("create", "list"),
                   help="create: add the missing topics (idempotent); list: show them")
    p.set_defaults(func=cmd_topics)


def _fail(e: Exception) -> int:
    print(f"rankwatch: {e}", file=sys.stderr)
    return 1


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    if args.brokers is not None:
        if not 1 <= args.brokers <= 9:
            return _fail(ValueError(f"--brokers {args.brokers}: expected 1 to 9 local nodes "
                                    "(3 makes a cluster that may lose one)"))
        settings = Settings.load(env=stack.settings_env(settings), kafka_brokers=args.brokers)
    if not 1 <= args.workers <= 64:
        return _fail(ValueError(f"--workers {args.workers}: expected 1 to 64"))
    try:
        st = stack.up(settings, worker=not args.no_worker, timeout=args.timeout,
                      workers=args.workers)
    except (BrokerError, stack.StackError) as e:
        return _fail(e)
    print()
    print(format_status(st))
    return 0


def cmd_down(args: argparse.Namespace, settings: Settings) -> int:
    stack.down(settings)
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    st = stack.status(settings)
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0 if st["healthy"] else 1


def cmd_fetch_jars(args: argparse.Namespace, settings: Settings) -> int:
    try:
        lib = ensure_jars(settings)
    except BrokerError as e:
        return _fail(e)
    print(f"Kafka {settings.kafka_version} jars: {lib}")
    return 0


def cmd_topics(args: argparse.Namespace, settings: Settings) -> int:
    bootstrap = stack.bootstrap(settings)
    specs = settings.topics.specs(settings.kafka_partitions)
    try:
        if args.action == "create":
            created = ensure_topics(bootstrap, specs)
            print(f"{bootstrap}: created {len(created)} topics, {len(specs) - len(created)} "
                  "were present")
            return 0
        present = list_topics(bootstrap)
    except BrokerError as e:
        return _fail(e)
    for s in specs:
        n = present.get(s.name)
        shape = "compacted" if s.compacted else f"retention {s.retention_ms} ms"
        print(f"{s.name:<28}{'missing' if n is None else f'{n} partitions':<16}{shape}")
    return 0 if all(s.name in present for s in specs) else 1


def _state(part: dict[str, Any]) -> str:
    if part["healthy"]:
        return "up"
    return "starting" if part["running"] else "down"


def format_status(st: dict[str, Any]) -> str:
    """A few aligned lines for a terminal."""
    k, w = st["kafka"], st["worker"]
    kafka_where = k["bootstrap"] + ("" if k["managed"] else " (external)")
    rows = [("kafka", _state(k), k["pid"], kafka_where, k.get("log", ""))]
    if k.get("brokers"):  # a local cluster: one line per node
        rows = [(f"kafka-{b['node']}", _state(b), b["pid"], b["bootstrap"], "")
                for b in k["brokers"]]
    rows.append(("worker", _state(w), w["pid"], f"SQL {w['sql_endpoint']}", w["log"]))
    parts = [("kafka", k), ("worker", w)]
    if "store" in st:  # up --workers N: the store and the other workers
        more = [("store", st["store"], "ClickHouse for the workers")]
        more += [(x["name"], x, "") for x in st["workers"][1:]]
        for name, part, where in more:
            rows.append((name, _state(part), part["pid"], where, part["log"]))
            parts.append((name, part))
    n = st.get("notify") or {}
    if n.get("configured"):
        rows.append(("notify", "up" if n["running"] else "down", n["pid"],
                     "routes " + n["config"], n["log"]))
    # the name column fits the longest name ("worker-12", "storage") and a space
    nw = max(8, *(len(r[0]) + 1 for r in rows), len("storage") + 1)
    lines = []
    for name, state, pid, where, log in rows:
        pid_text = f"pid {pid}" if pid else ""
        lines.append(f"{name:<{nw}}{state:<10}{pid_text:<12}{where:<36}{log}".rstrip())
    for name, part in parts:
        if part["running"] and not part["healthy"]:
            lines.append(f"  {name}: {part['detail']}")
    lines.append(f"{'storage':<{nw}}{st['clickhouse']['url']}  (database "
                 f"{st['clickhouse']['database']})")
    return "\n".join(lines)
