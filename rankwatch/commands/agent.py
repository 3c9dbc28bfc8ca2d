"""`rankwatch agent`: drain this host's tracer rings and publish their records to Kafka.

With `--capture FILE` the batches go to a file instead (a host without a broker; replay it with
`rankwatch replay FILE`)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ingest.agent.agent import Agent, AgentConfig
from ingest.agent.capture import CaptureWriter, Tee
from ingest.agent.outbox import Publisher
from ingest.ring import DEFAULT_PREFIX
from ingest.torch.session import DEFAULT_RING_DIR
from rankwatch.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("agent", help="per-host agent: tracer rings -> Kafka record batches",
                       description=__doc__)
    p.add_argument("--sidecar-dir", default=DEFAULT_RING_DIR,
                   help="where the tracers write their rank sidecars (RANKWATCH_RING_DIR of "
                        f"the training job; default {DEFAULT_RING_DIR})")
    p.add_argument("--prefix", default=DEFAULT_PREFIX,
                   help=f"shared-memory name prefix of the rings (default {DEFAULT_PREFIX})")
    p.add_argument("--job", help="only this job's rings (default: every job)")
    p.add_argument("--linger", type=float, default=0.25, help="seconds a batch may wait")
    p.add_argument("--latency-linger", type=float, default=0.05,
                   help="seconds a batch of stage records or beats may wait (the step and "
                        "hang triggers wait on them; default 0.05)")
    p.add_argument("--beat", type=float, default=1.0, help="heartbeat interval, seconds")
    p.add_argument("--inflight", type=float, default=2.0,
                   help="publish an op still running after this many seconds as in flight")
    p.add_argument("--spill-mb", type=int, default=64, help="bounded spill during outages")
    p.add_argument("--keep-dead", action="store_true",
                   help="keep rings of exited processes (default: unlink once drained)")
    p.add_argument("--duration", type=float, default=0, help="stop after N seconds (0: never)")
    p.add_argument("--exit-when-idle", type=float, default=0,
                   help="stop once rings existed and none is left for N seconds")
    p.add_argument("--capture", metavar="FILE",
                   help="write the batches to FILE instead of Kafka (replay: rankwatch replay)")
    p.add_argument("--tee", metavar="FILE",
                   help="publish to Kafka and also write the published batches to FILE "
                        "(replay the same job in process later: diagnosis.evaluate)")
    p.add_argument("--capture-mb", type=int, default=1024,
                   help="largest capture file; later batches are dropped and counted")
    p.add_argument("--metrics-port", type=int, default=8126,
                   help="serve Prometheus metrics at http://BIND_HOST:PORT/metrics "
                        "(ring drops per rank, backlog, outbox; 0: off; default 8126)")
    p.add_argument("--json", action="store_true", help="print final stats as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    for name in ("linger", "latency_linger", "beat", "inflight"):
        if getattr(args, name) <= 0:
            print(f"rankwatch agent: --{name.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    cfg = AgentConfig(sidecar_dir=Path(args.sidecar_dir), job=args.job, prefix=args.prefix,
                      linger_s=args.linger, latency_linger_s=args.latency_linger,
                      beat_s=args.beat, inflight_s=args.inflight,
                      spill_bytes=args.spill_mb << 20, remove_dead=not args.keep_dead)
    pub: Publisher
    if args.capture and args.tee:
        print("rankwatch agent: --capture and --tee exclude each other (--capture writes "
              "instead of publishing, --tee besides)", file=sys.stderr)
        return 2
    capture: CaptureWriter | None = None
    if args.capture or args.tee:
        try:
            capture = CaptureWriter(args.capture or args.tee, max_bytes=args.capture_mb << 20)
        except OSError as e:
            print(f"rankwatch agent: cannot write {args.capture or args.tee}: {e}",
                  file=sys.stderr)
            return 2
    if args.capture and capture is not None:
        pub, target = capture, args.capture
    else:
        from ingest.publish import BatchPublisher  # confluent-kafka: not needed to capture

        pub = BatchPublisher(settings.bootstrap, settings.topics, block_s=0.0, config={
            "message.timeout.ms": 15000, "queue.buffering.max.kbytes": 32 * 1024})
        target = f"{settings.bootstrap} ({settings.topics.ops}, …)"
        if capture is not None:  # --tee: publish, and write what the broker took
            pub, target = Tee(pub, capture), f"{target} and {args.tee}"
    agent = Agent(cfg, pub)
    if args.metrics_port:
        from prometheus_client import CollectorRegistry

        from rankwatch import metrics

        registry = CollectorRegistry()
        registry.register(metrics.AgentCollector(agent))
        metrics.serve(registry, settings.bind_host, args.metrics_port)
    stopping = False

    def on_signal(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t_end = time.monotonic() + args.duration if args.duration else float("inf")
    seen = 0.0
    idle_since = [0.0]

    def stop() -> bool:
        nonlocal seen
        now = time.monotonic()
        if args.exit_when_idle:
            if agent.rings:
                seen, idle_since[0] = 1.0, 0.0
            elif seen and not idle_since[0]:
                idle_since[0] = now
            elif seen and now - idle_since[0] >= args.exit_when_idle:
                return True
        return stopping or now >= t_end

    print(f"rankwatch agent: {cfg.prefix}.* rings -> {target}", file=sys.stderr, flush=True)
    agent.run(stop)
    stats = agent.stats()
    if capture is not None:
        capture.close()
        stats["capture"] = {"file": args.capture or args.tee, "batches": capture.stats.batches,
                            "bytes": capture.stats.bytes, "refused": capture.stats.refused}
    if args.json:
        print(json.dumps(stats))
    else:
        print("rankwatch agent: " + ", ".join(f"{k}={v}" for k, v in stats.items()),
              file=sys.stderr)
    return 0
