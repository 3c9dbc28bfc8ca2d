"""From a fault to the people on call, end to end: the simulator (a separate process, real
time) hangs rank 5 for 12 s; the worker diagnoses it and later resolves it; `rankwatch notify`,
started by `rankwatch up` from <home>/notify.toml, raises and then resolves the alert in a real
Alertmanager, triggers and resolves a PagerDuty-style receiver, and the alert's link opens the
worker's incident page."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from tests.conftest import KafkaService, free_ports
from tests.integration.services import Receiver, alertmanager


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = cond()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_transient_hang_raises_and_resolves_the_alert(kafka: KafkaService,
                                                        settings_factory: Any,
                                                        tmp_path: Path) -> None:
    page_port, metrics_port = free_ports(2)
    s = settings_factory(kafka_bootstrap=kafka.bootstrap, kafka_partitions=2,
                         topic_prefix=f"n{uuid.uuid4().hex[:10]}", page_port=page_port,
                         metrics_port=metrics_port)
    job = f"e2e-notify-{uuid.uuid4().hex[:6]}"
    pd = Receiver(202).start()
    sim = None
    try:
        with alertmanager(tmp_path) as am:
            (s.home / "notify.toml").write_text(
                f'resend_s = 2.0\npage_url = "http://127.0.0.1:{page_port}/incidents/'
                '{incident_id}"\n'
                f'[sinks.am]\ntype = "alertmanager"\nurl = "{am.url}"\n'
                f'[sinks.pd]\ntype = "pagerduty"\nurl = "{pd.url}"\nrouting_key = "k"\n'
                f'[[routes]]\njobs = ["e2e-notify-*"]\nsinks = ["am", "pd"]\n')
            stack.up(s, progress=lambda m: None)
            sim = subprocess.Popen(
                [sys.executable, "-m", "rankwatch.cli", "simulate", "--tp", "2", "--pp", "2",
                 "--dp", "2", "--steps", "80", "--job-id", job, "--fault",
                 "hang rank=5 stage=bwd mb=2 at=6s for=12s", "--speed", "realtime", "--out",
                 "kafka", "--quiet"], env=stack.child_env(s))

            def ours() -> list[dict[str, Any]]:
                return [a for a in am.alerts(active="true") if a["labels"]["job_id"] == job]

            (alert,) = wait_for(ours, 90, "the hang's alert in Alertmanager")
            assert alert["labels"]["kind"] == "hang"
            assert alert["labels"]["severity"] == "critical"
            assert alert["annotations"]["culprit_ranks"] == "5"
            with urllib.request.urlopen(alert["annotations"]["incident_page"], timeout=30) as r:
                assert r.status == 200 and "rank 5" in r.read().decode()

            wait_for(lambda: not ours(), 120, "the alert to resolve")
            events = wait_for(lambda: [e for e in pd.bodies()
                                       if e["event_action"] == "resolve"] and pd.bodies(),
                              30, "PagerDuty's resolve")
            assert events[0]["event_action"] == "trigger"
            assert events[-1]["event_action"] == "resolve"
            assert {e["dedup_key"] for e in events} == {alert["labels"]["incident_id"]}
            assert events[0]["payload"]["custom_details"]["culprit_ranks"] == [5]
    finally:
        if sim is not None and sim.poll() is None:
            sim.kill()
        stack.down(s, progress=lambda m: None)
        pd.stop()
        delete_topics(kafka.bootstrap, [t.name for t in s.topics.specs(2)])
