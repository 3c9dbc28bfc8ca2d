"""The worker's Prometheus metrics, scraped by a real Prometheus (Debian's `prometheus`) with
the example alert rules loaded: records stored per kind, consumer lag, insert latency."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from ingest.batch import encode_batch
from ingest.publish import BatchPublisher
from ingest.synthetic import ops_columns
from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from tests.conftest import KafkaService, free_ports
from tests.integration.services import prometheus

ROOT = Path(__file__).resolve().parents[2]


def query(prom: str, q: str) -> list[dict[str, Any]]:
    url = f"{prom}/api/v1/query?query={urllib.parse.quote(q)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        out: list[dict[str, Any]] = json.loads(r.read())["data"]["result"]
        return out


def wait_value(prom: str, q: str, want: float, timeout: float = 60,
               at_least: bool = False) -> float:
    got = float("nan")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        res = query(prom, q)
        if res:
            got = float(res[0]["value"][1])
            if got == want or (at_least and got >= want):
                return got
        time.sleep(0.5)
    raise AssertionError(f"{q}: {got}, expected {want}")


def test_prometheus_scrapes_the_worker(kafka: KafkaService, settings_factory: Any,
                                       tmp_path: Path) -> None:
    (port,) = free_ports(1)
    s = settings_factory(kafka_bootstrap=kafka.bootstrap, kafka_partitions=2,
                         topic_prefix=f"m{uuid.uuid4().hex[:10]}", metrics_port=port)
    try:
        stack.up(s, progress=lambda m: None)
        with prometheus(tmp_path, [f"127.0.0.1:{port}"], interval_s=1.0,
                        rules=ROOT / "examples" / "prometheus-rules.yml") as prom:
            pub = BatchPublisher(s.bootstrap, s.topics)
            t0 = time.time_ns() - 60 * 10**9
            for i in range(3):
                pub.publish("ops", encode_batch("ops", "job-m", ops_columns(8, i * 400, 400, t0),
                                                producer="t", seq=i), key="job-m")
            pub.publish("ops", b"not a batch", key="job-m")
            assert pub.flush(10) == 0
            try:
                wait_value(prom, 'rankwatch_records_stored_total{kind="ops"}', 1200)
            except AssertionError:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                    raise AssertionError(r.read().decode()[-3000:] + "\n" + (
                        s.home / "logs" / "worker.log").read_text()[-3000:]) from None
            wait_value(prom, 'rankwatch_dead_letters_total{kind="ops"}', 1)
            # one insert or more (the writer may batch the three messages together)
            inserts = wait_value(prom, 'rankwatch_insert_duration_seconds_count{kind="ops"}', 1,
                                 at_least=True)
            total = query(prom, 'rankwatch_insert_duration_seconds_sum{kind="ops"}')
            assert inserts <= 3 and 0 < float(total[0]["value"][1]) < 60
            # every message committed: the ops topic's lag comes back to 0
            wait_value(prom, f'rankwatch_consumer_lag_messages{{topic="{s.topics.ops}"}}', 0)
            assert query(prom, 'rankwatch_open_incidents{class="hang"}')
            # the CPU spent diagnosing is exported before any analysis ran (0 or more)
            assert query(prom, 'rankwatch_analysis_cpu_seconds_total{work="evidence"}')
            # job-m never stored a topology: its feed batches wait for it, none dropped
            wait_value(prom, 'rankwatch_trigger_batches_dropped_total{reason="topology_wait"}', 0)
            assert query(prom, 'up{job="rankwatch"}')[0]["value"][1] == "1"
            with urllib.request.urlopen(f"{prom}/api/v1/rules", timeout=5) as r:
                groups = json.loads(r.read())["data"]["groups"]
            rules = [rule for g in groups for rule in g["rules"]]
            assert len(rules) == 10 and all(rule["health"] == "ok" for rule in rules), rules
    finally:
        stack.down(s, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [t.name for t in s.topics.specs(2)])
