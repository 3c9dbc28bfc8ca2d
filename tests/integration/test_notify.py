"""`rankwatch notify` against a real Kafka broker, a real Alertmanager (Debian's
prometheus-alertmanager) read back through its API, and local receivers standing in for
PagerDuty, Slack and a webhook endpoint, each checked against the documented payloads."""

from __future__ import annotations

import base64
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Message, Producer
from prometheus_client import CollectorRegistry, generate_latest

from diagnosis.model import Diagnosis
from diagnosis.sinks import config as nc
from diagnosis.sinks.notifier import Notifier
from diagnosis.sinks.webhook import verify
from ingest.topics import Topics
from rankwatch.metrics import NotifyCollector
from tests.conftest import KafkaService
from tests.integration.services import Receiver, alertmanager
from tests.unit.notify_fixtures import life, version

SECRET = "hook-secret"


def message_json(m: Message) -> Any:
    """A consumed message's JSON value (every message these tests read has one)."""
    value = m.value()
    assert value is not None, "a message without a value"
    return orjson.loads(value)


def _config(sinks: dict[str, dict[str, Any]], **top: Any) -> nc.NotifyConfig:
    data = {"group_id": f"notify-{uuid.uuid4().hex[:8]}", "backoff_s": 0.05,
            "backoff_max_s": 0.5, "resend_s": 1.0, "sinks": sinks,
            "routes": [{"jobs": ["prod-*"], "sinks": list(sinks)}], **top}
    return nc.parse(data, {})


@contextmanager
def running(cfg: nc.NotifyConfig, kafka: KafkaService, topics: Topics,
            ledger: Path) -> Iterator[Notifier]:
    n = Notifier(cfg, bootstrap=kafka.bootstrap, topic=topics.diagnoses, dlq_topic=topics.dlq,
                 ledger_path=ledger, start="earliest")
    stop = threading.Event()
    t = threading.Thread(target=n.run, args=(stop,), daemon=True)
    t.start()
    try:
        assert n.assigned.wait(30), "notify got no partition of the diagnoses topic"
        yield n
    finally:
        stop.set()
        t.join(30)
        assert not t.is_alive()


def publish(kafka: KafkaService, topic: str, records: list[Diagnosis | bytes]) -> None:
    p = Producer({"bootstrap.servers": kafka.bootstrap})
    for r in records:
        raw = r if isinstance(r, bytes) else r.to_json()
        p.produce(topic, value=raw, key=b"prod-llm-7")
    assert p.flush(10) == 0


def wait_for(cond: Any, timeout: float = 20.0, what: str = "") -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or cond}")


def test_an_incident_opens_updates_and_resolves_in_alertmanager_and_every_receiver(
        kafka: KafkaService, topics: Topics, tmp_path: Path) -> None:
    pd, slack, hook = Receiver(202).start(), Receiver(200).start(), Receiver(200).start()
    iid = f"prod-llm-7:hang:{uuid.uuid4().hex[:12]}"
    v1, v2, v3 = life(iid)
    with alertmanager(tmp_path) as am:
        cfg = _config({
            "am": {"type": "alertmanager", "url": am.url},
            "pd": {"type": "pagerduty", "url": pd.url, "routing_key": "R0UT1NG"},
            "chat": {"type": "slack", "url": slack.url, "min_interval_s": 0.2},
            "hook": {"type": "webhook", "url": hook.url, "secret": SECRET}},
            page_url="http://127.0.0.1:8124/incidents/{incident_id}")
        with running(cfg, kafka, topics, tmp_path / "ledger.sqlite"):
            publish(kafka, topics.diagnoses, [v1])
            wait_for(lambda: am.alerts(active="true"), what="the alert in Alertmanager")
            (a,) = am.alerts(active="true")
            assert a["labels"] == {"alertname": "RankwatchHang", "job_id": "prod-llm-7",
                                   "kind": "hang", "severity": "critical", "incident_id": iid}
            assert a["annotations"]["stage"] == "bwd mb=2 pp=1"
            assert a["annotations"]["culprit_ranks"] == "141"
            assert a["annotations"]["sql"].startswith("SELECT rank, op_seq FROM ops")
            assert a["status"]["state"] == "active"
            starts = a["startsAt"]

            publish(kafka, topics.diagnoses, [v2])
            wait_for(lambda: am.alerts()[0]["annotations"]["version"] == "2",
                     what="the updated annotations")
            (a,) = am.alerts()
            assert a["annotations"]["stage"] == "dp_allreduce" and a["startsAt"] == starts
            # re-sent while open: Alertmanager's updatedAt moves without a new version
            first_update = a["updatedAt"]
            wait_for(lambda: am.alerts()[0]["updatedAt"] != first_update, timeout=10,
                     what="a re-send of the open alert")

            publish(kafka, topics.diagnoses, [v3])
            wait_for(lambda: not am.alerts(), what="the alert to resolve")
            for r in (pd, slack, hook):
                r.wait(3)

    events = pd.bodies()
    assert [e["event_action"] for e in events] == ["trigger", "trigger", "resolve"]
    assert {e["dedup_key"] for e in events} == {iid}
    assert all(e["routing_key"] == "R0UT1NG" for e in events)
    assert events[0]["payload"]["severity"] == "critical"
    assert events[0]["payload"]["custom_details"]["culprit_ranks"] == [141]
    assert events[1]["payload"]["custom_details"]["stage"] == "dp_allreduce"

    msgs = slack.bodies()
    assert [m["blocks"][0]["type"] for m in msgs] == ["header"] * 3
    assert ["open v1" in m["text"] for m in msgs] == [True, False, False]
    assert "resolved v3" in msgs[2]["text"]

    for seen, v in zip(hook.seen, (v1, v2, v3), strict=True):
        assert seen.body == v.to_json()  # the record as published
        assert seen.headers["Idempotency-Key"] == v.id
        assert verify(SECRET, seen.headers, seen.body, now_s=time.time())
    for r in (pd, slack, hook):
        r.stop()


def test_a_sink_down_then_back_loses_nothing_duplicates_nothing_and_blocks_no_other(
        kafka: KafkaService, topics: Topics, tmp_path: Path) -> None:
    pd, hook = Receiver(202).start(), Receiver(200)  # the webhook endpoint starts down
    versions = [v for i in range(8) for v in life(f"prod-llm-7:hang:{i:04d}{uuid.uuid4().hex[:6]}")]
    cfg = _config({"pd": {"type": "pagerduty", "url": pd.url, "routing_key": "k"},
                   "hook": {"type": "webhook", "url": hook.url, "secret": SECRET}},
                  max_attempts=1000)
    ledger = tmp_path / "ledger.sqlite"
    with running(cfg, kafka, topics, ledger) as n:
        publish(kafka, topics.diagnoses, [*versions[:12]])
        pd.wait(12)  # PagerDuty got everything while the webhook endpoint is unreachable
        assert n.workers["hook"].stats.retries > 0 and not hook.seen
        time.sleep(2.0)  # the outage goes on
        publish(kafka, topics.diagnoses, [*versions[12:]])
        pd.wait(len(versions))
        hook.start()
        hook.wait(len(versions), timeout=30)
        wait_for(lambda: n.workers["hook"].stats.delivered == len(versions), what="the stats")
        reg = CollectorRegistry()
        reg.register(NotifyCollector(n))
        text = generate_latest(reg).decode()
        assert f'rankwatch_notify_delivered_total{{sink="hook"}} {len(versions)}.0' in text
        assert 'rankwatch_notify_sink_up{sink="hook"} 1.0' in text
        assert 'rankwatch_notify_dead_total{sink="pd"} 0.0' in text
    # a restart reads from the committed offsets; a redelivered copy is recognised by id
    publish(kafka, topics.diagnoses, [versions[0], versions[5]])
    with running(cfg, kafka, topics, ledger) as n:
        wait_for(lambda: n.workers["hook"].stats.duplicates == 2, what="the two duplicates")
    keys = Counter(s.headers["Idempotency-Key"] for s in hook.seen)
    assert keys == Counter(v.id for v in versions)  # every version exactly once
    # ...and per incident in version order
    order = [s.headers["Idempotency-Key"] for s in hook.seen]
    assert order == [v.id for v in versions]
    assert len(pd.seen) == len(versions)
    pd.stop()
    hook.stop()


def test_refused_and_exhausted_versions_and_invalid_records_are_dead_lettered(
        kafka: KafkaService, topics: Topics, tmp_path: Path) -> None:
    refuses, down = Receiver(400).start(), Receiver(503).start()
    v1 = version(f"prod-llm-7:hang:{uuid.uuid4().hex[:8]}", 1, "open")
    cfg = _config({"bad": {"type": "slack", "url": refuses.url, "min_interval_s": 0.01},
                   "flaky": {"type": "webhook", "url": down.url, "secret": SECRET}},
                  max_attempts=3)
    with running(cfg, kafka, topics, tmp_path / "ledger.sqlite") as n:
        publish(kafka, topics.diagnoses, [v1, b'{"v": 1, "id": 42}', b"\xff not json"])
        wait_for(lambda: n.workers["flaky"].stats.dead == 1 and n.stats.invalid == 2,
                 what="the dead letters")
    c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest"})
    c.subscribe([topics.dlq])
    dead: list[dict[str, Any]] = []
    t0 = time.monotonic()
    while len(dead) < 4 and time.monotonic() - t0 < 20:
        m = c.poll(0.5)
        if m is not None and not m.error():
            dead.append(message_json(m))
    c.close()
    by_field = {d["field"]: d for d in dead}
    assert set(by_field) == {"notify.bad", "notify.flaky", "id", "(record)"}
    assert by_field["notify.bad"]["reason"] == "refused: HTTP 400 ok"
    assert by_field["notify.flaky"]["attempts"] == 3
    assert "HTTP 503" in by_field["notify.flaky"]["reason"]
    assert base64.b64decode(by_field["notify.flaky"]["payload_b64"]) == v1.to_json()
    assert len(refuses.seen) == 1 and len(down.seen) == 3
    refuses.stop()
    down.stop()


def test_rankwatch_up_starts_notify_when_configured_and_down_stops_it(
        kafka: KafkaService, topics: Topics, settings_factory: Any, tmp_path: Path,
        monkeypatch: Any) -> None:
    from rankwatch import stack
    from tests.integration.test_broker import FAKE_WORKER

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(stack, "worker_command",
                        lambda s: [sys.executable, str(script), "--as", "rankwatch.cli"])
    prefix = topics.diagnoses.rsplit(".", 1)[0]
    s = settings_factory(kafka_bootstrap=kafka.bootstrap, topic_prefix=prefix)
    hook = Receiver(200).start()
    (s.home / "notify.toml").write_text(
        f'[sinks.hook]\ntype = "webhook"\nurl = "{hook.url}"\nsecret = "{SECRET}"\n'
        '[[routes]]\nsinks = ["hook"]\n')
    notes: list[str] = []
    try:
        st = stack.up(s, progress=notes.append)
        assert st["notify"]["running"] and st["notify"]["configured"], notes
        v1 = version(f"prod-llm-7:hang:{uuid.uuid4().hex[:8]}", 1, "open")
        publish(kafka, topics.diagnoses, [v1])
        hook.wait(1, timeout=60)
        assert hook.seen[0].headers["Idempotency-Key"] == v1.id
    finally:
        stack.down(s, progress=notes.append)
        hook.stop()
    assert not stack.status(s)["notify"]["running"]
    assert any(n.startswith("notify: stopping") for n in notes)
