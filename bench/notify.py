"""Diagnosis on the topic → alert visible in a real Alertmanager, and a receiver outage.

    rankwatch bench notify [--incidents 100] [--interval 0.1] [--outage 0] [--json]

Starts a private broker (the `rankwatch up` code, no worker), a real Alertmanager (Debian's
prometheus-alertmanager) and `rankwatch notify` as its own process, routing every version to
Alertmanager and to a local webhook receiver. Publishes `--incidents` open versions, one every
`--interval` seconds, and polls Alertmanager's API every 10 ms: the latency of one incident is
from the broker's acknowledgement of its version to the first poll that lists its alert. Then
publishes every incident's `resolved` version and times until Alertmanager lists none.

With `--outage S` the webhook receiver is unreachable (its port closed) for the first S seconds
of publishing; the figures then include how many versions it received once back, how many were
lost and how many came twice (counted by Idempotency-Key).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.services import Receiver, alertmanager
from diagnosis.model import Diagnosis, Evidence, TriggerRef
from rankwatch import stack


def _version(job: str, iid: str, v: int, status: str, onset_ns: int) -> Diagnosis:
    now = time.time_ns()
    return Diagnosis(
        id=f"{iid}/{v}", job_id=job, incident_id=iid, version=v, status=status,  # type: ignore[arg-type]
        kind="hang", culprit_ranks=[141], culprit_hosts=["node0017"], stage="bwd mb=2 pp=1",
        stages=["bwd mb=2 pp=1"], component="gpu_compute", onset_ns=onset_ns,
        detected_ns=now, confidence=0.9, confidence_label="high", rules=["mycroft.alg2.min_op"],
        trigger=TriggerRef(kind="hang", ts=now, ranks=[3], rule="venustrace.heartbeat"),
        evidence=[Evidence(rule="mycroft.alg2.min_op", summary="rank 141 never reached op 812")],
        sql=[f"SELECT * FROM ops WHERE job_id = '{job}' AND rank = 141 LIMIT 20"],
        summary="hang — rank 141 on node0017")


def run(incidents: int, interval: float, outage: float, home: Path, say: object
        ) -> dict[str, Any]:
    log = say if callable(say) else print
    settings = stack.private_settings(home, topic_prefix="bnotify")
    from confluent_kafka import Producer

    notify = None
    hook = Receiver(200)
    try:
        stack.up(settings, progress=lambda m: log(f"  {m}"), worker=False)
        with alertmanager(home) as am:
            cfg = home / "notify.toml"
            cfg.write_text(f'[sinks.am]\ntype = "alertmanager"\nurl = "{am.url}"\n'
                           f'[sinks.hook]\ntype = "webhook"\nurl = "{hook.url}"\n'
                           'secret = "bench"\n[[routes]]\nsinks = ["am", "hook"]\n')
            notify = subprocess.Popen(
                [sys.executable, "-m", "rankwatch.cli", "notify", "--config", str(cfg),
                 "--loglevel", "error"], env=stack.child_env(settings), cwd=home,
                stdout=subprocess.DEVNULL, stderr=(home / "notify.log").open("wb"))
            seen: dict[str, float] = {}
            stop = threading.Event()

            def watch() -> None:
                while not stop.is_set():
                    t = time.time()
                    try:
                        for a in am.alerts(active="true"):
                            seen.setdefault(a["labels"]["incident_id"], t)
                    except OSError:
                        pass
                    stop.wait(0.01)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            # a list, emptied before the broker stops (a live producer keeps reconnecting)
            producers = [Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 0})]
            acked: dict[str, float] = {}

            def publish(d: Diagnosis) -> None:
                def ack(err: object, _m: object) -> None:
                    if err is None:
                        acked[d.incident_id] = time.time()

                producers[0].produce(settings.topics.diagnoses, d.to_json(), d.job_id.encode(),
                                     on_delivery=ack)
                producers[0].flush(10)

            job = f"bench-{uuid.uuid4().hex[:6]}"
            warm = _version(job, f"{job}:hang:warmup", 1, "open", time.time_ns())
            publish(warm)
            t0 = time.time()
            while warm.incident_id not in seen:
                if time.time() - t0 > 60 or notify.poll() is not None:
                    raise RuntimeError("notify delivered nothing in 60 s: "
                                       f"{(home / 'notify.log').read_text()[-2000:]}")
                time.sleep(0.05)
            if outage <= 0:
                hook.start()
            log(f"notify is up; publishing {incidents} incidents, one every {interval} s"
                + (f"; the webhook receiver is down for {outage:.0f} s" if outage > 0 else ""))
            versions = [_version(job, f"{job}:hang:{i:05d}", 1, "open", time.time_ns())
                        for i in range(incidents)]
            t_start = time.time()
            for i, v in enumerate(versions):
                publish(v.model_copy(update={"detected_ns": time.time_ns()}))
                if outage > 0 and hook._server is None and time.time() - t_start >= outage:
                    hook.start()
                    log(f"  webhook receiver back after {time.time() - t_start:.0f} s")
                if i % 50 == 49:
                    log(f"  {i + 1} published")
                time.sleep(interval)
            while outage > 0 and hook._server is None:
                if time.time() - t_start >= outage:
                    hook.start()
                    log(f"  webhook receiver back after {time.time() - t_start:.0f} s")
                time.sleep(0.5)
            t_wait = time.time()
            while len([v for v in versions if v.incident_id in seen]) < incidents:
                if time.time() - t_wait > 60:
                    break
                time.sleep(0.05)
            lat = np.array([seen[v.incident_id] - acked[v.incident_id] for v in versions
                            if v.incident_id in seen and v.incident_id in acked])
            resolved_at = time.time()
            for v in [warm, *versions]:
                publish(v.model_copy(update={"id": f"{v.incident_id}/2", "version": 2,
                                             "status": "resolved", "detected_ns": time.time_ns()}))
            while am.alerts(active="true") and time.time() - resolved_at < 120:
                time.sleep(0.05)
            resolve_s = time.time() - resolved_at
            left = len(am.alerts(active="true"))
            expected = 2 * (incidents + 1)
            t_wait = time.time()
            while len(hook.seen) < expected and time.time() - t_wait < 900:
                time.sleep(0.2)
            stop.set()
            watcher.join(5)
            producers.clear()
            keys = Counter(s.headers.get("Idempotency-Key") for s in hook.seen)
            all_ids = {v.id for v in [warm, *versions]} | {f"{v.incident_id}/2"
                                                            for v in [warm, *versions]}
            return {
                "incidents": incidents, "visible": int(lat.size),
                "p50_ms": float(np.percentile(lat, 50) * 1e3) if lat.size else None,
                "p90_ms": float(np.percentile(lat, 90) * 1e3) if lat.size else None,
                "p99_ms": float(np.percentile(lat, 99) * 1e3) if lat.size else None,
                "max_ms": float(lat.max() * 1e3) if lat.size else None,
                "all_resolved_s": round(resolve_s, 2), "still_active": left,
                "outage_s": outage, "webhook_versions": expected,
                "webhook_received_distinct": len(keys),
                "webhook_lost": len(all_ids - set(keys)),
                "webhook_duplicates": sum(n - 1 for n in keys.values() if n > 1),
            }
    finally:
        hook.stop()
        if notify is not None and notify.poll() is None:
            notify.terminate()
            try:
                notify.wait(30)
            except subprocess.TimeoutExpired:
                notify.kill()
        stack.down(settings, progress=lambda m: None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch bench notify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--incidents", type=int, default=100)
    p.add_argument("--interval", type=float, default=0.1, help="seconds between versions")
    p.add_argument("--outage", type=float, default=0.0,
                   help="seconds the webhook receiver is down at the start")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-notify-") as home:
        out = run(args.incidents, args.interval, args.outage, Path(home),
                  lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(out))
    else:
        print(f"diagnosis on topic -> alert visible in Alertmanager ({out['visible']} of "
              f"{out['incidents']} incidents): p50 {out['p50_ms']:.0f} ms, p90 "
              f"{out['p90_ms']:.0f} ms, p99 {out['p99_ms']:.0f} ms, max {out['max_ms']:.0f} ms")
        print(f"all resolved in Alertmanager {out['all_resolved_s']} s after the resolved "
              f"versions were published; still active: {out['still_active']}")
        print(f"webhook receiver (down {out['outage_s']:.0f} s): {out['webhook_received_distinct']}"
              f" of {out['webhook_versions']} versions, lost {out['webhook_lost']}, duplicated "
              f"{out['webhook_duplicates']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
