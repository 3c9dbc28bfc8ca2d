"""`rankwatch notify`: deliver rw.diagnoses to Alertmanager, PagerDuty, Slack and webhooks.

The configuration file (TOML; diagnosis/sinks/config.py documents every key, and
examples/notify.toml is a commented example) comes from `--config`, else the
`RANKWATCH_NOTIFY_CONFIG` setting, else `<home>/notify.toml`. `--check` validates it and prints
the routes without connecting to anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from rankwatch.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("notify", help="deliver diagnoses to Alertmanager, PagerDuty, Slack, "
                                      "webhooks (routes in a config file)")
    p.add_argument("--config", help="the notify configuration file (TOML)")
    p.add_argument("--check", action="store_true",
                   help="validate the configuration, print sinks and routes, and exit")
    p.add_argument("--metrics-port", type=int, default=8127,
                   help="serve Prometheus metrics at http://BIND_HOST:PORT/metrics (per sink: "
                        "delivered, retries, dead letters, backlog; 0: off; default 8127)")
    p.add_argument("--json", action="store_true", help="--check prints JSON")
    p.add_argument("--loglevel", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def config_path(args_config: str | None, settings: Settings) -> Path | None:
    if args_config:
        return Path(args_config)
    if settings.notify_config:
        return Path(settings.notify_config)
    default = settings.home / "notify.toml"
    return default if default.exists() else None


def shown_url(url: str) -> str:
    """Scheme and host only: a Slack webhook's path is its secret."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}/…" if u.path.strip("/") else url


def run(args: argparse.Namespace, settings: Settings) -> int:
    from diagnosis.sinks import config as notify_config

    path = config_path(args.config, settings)
    if path is None:
        print("rankwatch notify: no configuration: pass --config FILE, set "
              f"RANKWATCH_NOTIFY_CONFIG, or write {settings.home / 'notify.toml'} "
              "(examples/notify.toml is an example)", file=sys.stderr)
        return 2
    try:
        cfg = notify_config.load(path, os.environ)
    except notify_config.NotifyConfigError as e:
        print(f"rankwatch notify: {e}", file=sys.stderr)
        return 2
    if args.check:
        view = {"config": str(path), "group_id": cfg.group_id,
                "sinks": {n: {"type": s.type, "url": shown_url(s.url)}
                          for n, s in cfg.sinks.items()},
                "routes": [r.model_dump(mode="json") for r in cfg.routes]}
        if args.json:
            print(json.dumps(view, indent=2))
        else:
            print(f"{path}: {len(cfg.sinks)} sinks, {len(cfg.routes)} routes, consumer group "
                  f"{cfg.group_id!r}")
            for n, s in cfg.sinks.items():
                print(f"  sink {n:<12} {s.type:<13} {shown_url(s.url)}")
            for i, r in enumerate(cfg.routes):
                print(f"  route {i}: jobs {r.jobs} kinds {r.kinds or 'all'} status "
                      f"{r.status or 'all'} confidence ≥ {r.min_confidence} → {r.sinks}")
        return 0

    from diagnosis.sinks.notifier import Notifier

    logging.basicConfig(level=args.loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ledger = Path(cfg.state_file) if cfg.state_file else settings.home / "notify" / "ledger.sqlite"
    notifier = Notifier(cfg, bootstrap=settings.bootstrap, topic=settings.topics.diagnoses,
                        dlq_topic=settings.topics.dlq, ledger_path=ledger)
    if args.metrics_port:
        from prometheus_client import CollectorRegistry

        from rankwatch import metrics

        registry = CollectorRegistry()
        registry.register(metrics.NotifyCollector(notifier))
        metrics.serve(registry, settings.bind_host, args.metrics_port)
    stop = threading.Event()

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger("rankwatch.notify").info(
        "following %s as consumer group %r; sinks %s; ledger %s", settings.topics.diagnoses,
        cfg.group_id, sorted(cfg.sinks), ledger)
    notifier.run(stop)
    return 0
