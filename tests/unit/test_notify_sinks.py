"""Pure parts of `rankwatch notify`: configuration and routing, each sink's documented payload,
the offsets that may be committed, backoff, and the delivery worker's retry / dead-letter /
dedup contract (with a scripted `post`, no network)."""

from __future__ import annotations

import random
import threading
import time

import orjson
import pytest

from diagnosis.sinks import config as nc
from diagnosis.sinks.alertmanager import AlertmanagerSink
from diagnosis.sinks.base import Outcome, Request
from diagnosis.sinks.delivery import DeadLetterFn, Item, SinkWorker, backoff
from diagnosis.sinks.offsets import OffsetBook
from diagnosis.sinks.pagerduty import PagerDutySink, dedup_key
from diagnosis.sinks.slack import SlackSink
from diagnosis.sinks.state import Ledger
from diagnosis.sinks.webhook import WebhookSink, verify
from tests.unit.notify_fixtures import life, version

CONFIG = {
    "sinks": {"am": {"type": "alertmanager", "url": "http://127.0.0.1:9093"},
              "pd": {"type": "pagerduty", "routing_key_env": "PD_KEY"},
              "hook": {"type": "webhook", "url": "http://127.0.0.1:1/h", "secret": "s3"}},
    "routes": [{"jobs": ["prod-*"], "kinds": ["hang"], "min_confidence": 0.5,
                "sinks": ["am", "pd"]},
               {"status": ["resolved"], "sinks": ["hook", "am"]}],
}


def test_routes_match_job_glob_kind_status_and_confidence() -> None:
    cfg = nc.parse(CONFIG, {"PD_KEY": "k"})
    assert cfg.sinks["pd"].routing_key == "k"
    assert cfg.sinks["pd"].url == nc.PAGERDUTY_URL
    assert cfg.route(version("i", 1, "open")) == ["am", "pd"]
    assert cfg.route(version("i", 1, "open", job_id="dev-1")) == []
    assert cfg.route(version("i", 1, "open", confidence=0.3)) == []
    assert cfg.route(version("i", 1, "open", kind="slowdown")) == []
    assert cfg.route(version("i", 3, "resolved")) == ["am", "pd", "hook"]
    assert cfg.route(version("i", 3, "resolved", job_id="dev")) == ["hook", "am"]


@pytest.mark.parametrize(("change", "needle"), [
    ({"routes": [{"sinks": ["nope"]}]}, "routes[0].sinks names ['nope']"),
    ({"sinks": {"pd": {"type": "pagerduty", "routing_key_env": "MISSING"}}}, "MISSING is not set"),
    ({"sinks": {"am": {"type": "alertmanager", "url": "file:///etc/passwd"}}}, "not an http"),
    ({"sinks": {"h": {"type": "webhook", "url": "http://x"}}}, "needs secret"),
    ({"max_attempts": 0}, "max_attempts"),
    ({"sinks": {"am": {"type": "email", "url": "http://x"}}}, "sinks.am.type"),
])
def test_bad_configuration_says_which_key_and_why(change: dict[str, object], needle: str) -> None:
    data = {**CONFIG, **change}
    if "routes" not in change:
        data["routes"] = [{"sinks": list(data["sinks"])[:1]}]  # type: ignore[call-overload]
    with pytest.raises(nc.NotifyConfigError) as e:
        nc.parse(data, {"PD_KEY": "k"})
    assert needle in str(e.value)


def test_alertmanager_labels_stay_fixed_while_annotations_follow_the_versions() -> None:
    ledger = Ledger(":memory:")
    am = AlertmanagerSink("am", "http://127.0.0.1:9093/", ledger, resend_s=10,
                          page_url="http://rw/incidents/{incident_id}")
    v1, v2, v3 = life("prod-llm-7:hang:abc")
    v2 = v2.model_copy(update={"confidence": 0.4, "kind": "slowdown"})
    now = time.time_ns()
    bodies = []
    for v in (v1, v2, v3):
        (req,) = am.requests(v, v.to_json(), now)
        assert req.url == "http://127.0.0.1:9093/api/v2/alerts"
        bodies.append(orjson.loads(req.body)[0])
        am.delivered(v, now)
    assert bodies[0]["labels"] == bodies[1]["labels"] == bodies[2]["labels"] == {
        "alertname": "RankwatchHang", "job_id": "prod-llm-7", "kind": "hang",
        "severity": "critical", "incident_id": "prod-llm-7:hang:abc"}
    assert bodies[1]["annotations"]["stage"] == "dp_allreduce"
    assert bodies[1]["annotations"]["current_kind"] == "slowdown"
    assert bodies[0]["annotations"]["incident_page"] == "http://rw/incidents/prod-llm-7%3Ahang%3Aabc"
    assert bodies[0]["startsAt"] == bodies[2]["startsAt"]
    assert bodies[0]["endsAt"] > bodies[0]["startsAt"]  # open: in the future, re-sent
    assert bodies[2]["endsAt"] <= am.alert(v3, now)["endsAt"]
    assert am.refresh(now) is None  # resolved: nothing left to re-send
    assert am.requests(v2, v2.to_json(), now) == []  # a late older version changes nothing


def test_pagerduty_events_trigger_then_resolve_on_one_dedup_key() -> None:
    pd = PagerDutySink("pd", nc.PAGERDUTY_URL, "rk", page_url="http://rw/{id}")
    v1, _v2, v3 = life("prod-llm-7:hang:abc")
    e1 = orjson.loads(pd.requests(v1, b"", 0)[0].body)
    e3 = orjson.loads(pd.requests(v3, b"", 0)[0].body)
    assert e1["event_action"] == "trigger" and e3["event_action"] == "resolve"
    assert e1["dedup_key"] == e3["dedup_key"] == "prod-llm-7:hang:abc"
    assert e1["routing_key"] == "rk"
    p = e1["payload"]
    assert p["severity"] == "critical" and p["source"] == "node0017" and p["class"] == "hang"
    assert p["custom_details"]["culprit_ranks"] == [141]
    assert p["custom_details"]["evidence"][0]["rule"] == "mycroft.alg2.min_op"
    assert e1["links"][0]["href"] == "http://rw/prod-llm-7%3Ahang%3Aabc%2F1"
    long_id = "j" * 300
    assert len(dedup_key(long_id)) <= 255 and dedup_key(long_id) == dedup_key(long_id)
    assert dedup_key(long_id) != dedup_key(long_id + "x")
    assert pd.classify(429, {}, b"").outcome is Outcome.RETRY
    assert pd.classify(502, {}, b"").outcome is Outcome.RETRY
    assert pd.classify(400, {}, b"").outcome is Outcome.REFUSED
    assert pd.classify(202, {}, b"").outcome is Outcome.DELIVERED


def test_slack_message_blocks_escape_the_diagnosis_text() -> None:
    v1 = version("i", 1, "open")
    msg = orjson.loads(SlackSink("s", "http://x").requests(v1, b"", 0)[0].body)
    kinds = [b["type"] for b in msg["blocks"]]
    assert kinds[0] == "header" and kinds[-1] == "context" and "section" in kinds
    text = orjson.dumps(msg).decode()
    assert "&lt;x&gt;" in text and "<x>" not in text  # no link or mention can be formed
    assert "ORDER BY t_enqueue" in text and "node0017" in text
    assert len(msg["blocks"][0]["text"]["text"]) <= 150
    loud = version("i", 1, "open", job_id="<!channel>")
    msg = orjson.loads(SlackSink("s", "http://x").requests(loud, b"", 0)[0].body)
    mrkdwn = [msg["text"]] + [b["text"]["text"] for b in msg["blocks"]
                              if b.get("text", {}).get("type") == "mrkdwn"]
    mrkdwn += [f["text"] for b in msg["blocks"] for f in b.get("fields", [])]
    mrkdwn += [e["text"] for b in msg["blocks"] for e in b.get("elements", [])]
    assert len(mrkdwn) > 5 and not any("<!channel>" in t for t in mrkdwn)  # no mention
    assert msg["blocks"][0]["text"]["type"] == "plain_text"  # the header formats nothing


def test_webhook_body_is_the_published_json_signed() -> None:
    v1 = version("i", 1, "open")
    raw = v1.to_json()
    (req,) = WebhookSink("h", "http://x", "secret").requests(v1, raw, 1_700_000_000 * 10**9)
    assert req.body == raw and req.headers["Idempotency-Key"] == "i/1"
    assert verify("secret", req.headers, raw, now_s=1_700_000_010)
    assert not verify("other", req.headers, raw, now_s=1_700_000_010)
    assert not verify("secret", req.headers, raw + b" ", now_s=1_700_000_010)
    assert not verify("secret", req.headers, raw, now_s=1_700_009_999)  # replayed later


def test_offsets_commit_the_done_prefix_only() -> None:
    book = OffsetBook()
    tp = ("t", 0)
    d0 = book.add(tp, 10, 2)
    d1 = book.add(tp, 11, 1)
    book.add(tp, 12, 0)
    d1("delivered")
    assert book.take_commits() == {}  # 10 still waits for a sink
    d0("delivered")
    assert book.take_commits() == {}
    d0("dead")
    assert book.take_commits() == {tp: 13} and book.pending() == 0


def test_a_revoked_partition_neither_commits_nor_miscounts() -> None:
    book = OffsetBook()
    late = book.add(("t", 0), 5, 1)
    book.add(("t", 1), 9, 1)
    book.forget([("t", 0)])
    late("delivered")  # a sink finishes a message of the revoked partition
    assert book.take_commits() == {} and book.pending() == 1


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    rng = random.Random(1)
    xs = [backoff(a, 0.5, 8.0, rng) for a in range(1, 12)]
    assert 0.25 <= xs[0] <= 0.5 and all(4.0 <= x <= 8.0 for x in xs[5:])
    assert len({round(x, 6) for x in xs[5:]}) > 1


class Script:
    """A receiver's answers in order (the last repeats); records what was posted."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)
        self.posted: list[Request] = []

    def __call__(self, req: Request, timeout: float) -> tuple[int, dict[str, str], bytes]:
        self.posted.append(req)
        s = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return s, {}, b""


def _run(worker: SinkWorker, items: list[Item], n_done: int) -> list[str]:
    outcomes: list[str] = []
    ev = threading.Event()

    def done(o: str) -> None:
        outcomes.append(o)
        if len(outcomes) >= n_done:
            ev.set()

    worker.start()
    for it in items:
        it.done = done
        worker.submit(it)
    assert ev.wait(10), outcomes
    worker.stop()
    worker.join(5)
    return outcomes


def recorder(out: list[tuple[str, int]]) -> DeadLetterFn:
    """A dead-letter callback that records (why, attempts)."""
    def dead_letter(_sink: str, _item: Item, why: str, attempts: int) -> bool:
        out.append((why, attempts))
        return True
    return dead_letter


def test_worker_retries_then_delivers_once_and_skips_a_redelivered_id() -> None:
    ledger = Ledger(":memory:")
    post = Script(0, 503, 202)
    dead: list[tuple[str, int]] = []
    w = SinkWorker(PagerDutySink("pd", "http://x", "k"), ledger,
                   recorder(dead), max_attempts=5, backoff_s=0.01,
                   backoff_max_s=0.02, post=post)
    v1 = version("i", 1, "open")
    out = _run(w, [Item(v1, v1.to_json()), Item(v1, v1.to_json())], 2)
    assert out == ["delivered", "duplicate"]
    assert len(post.posted) == 3 and w.stats.retries == 2 and not dead
    assert ledger.done("pd", "i/1")


def test_worker_dead_letters_after_max_attempts_and_at_once_when_refused() -> None:
    ledger = Ledger(":memory:")
    dead: list[tuple[str, int]] = []
    w = SinkWorker(WebhookSink("h", "http://x", "s"), ledger,
                   recorder(dead), max_attempts=3,
                   backoff_s=0.01, backoff_max_s=0.02, post=Script(500))
    v1 = version("i", 1, "open")
    assert _run(w, [Item(v1, v1.to_json())], 1) == ["dead"]
    assert dead[0][1] == 3 and "3 attempts failed" in dead[0][0] and "HTTP 500" in dead[0][0]
    w2 = SinkWorker(WebhookSink("h2", "http://x", "s"), ledger,
                    recorder(dead), max_attempts=3,
                    backoff_s=0.01, backoff_max_s=0.02, post=Script(400))
    assert _run(w2, [Item(v1, v1.to_json())], 1) == ["dead"]
    assert dead[1] == ("refused: HTTP 400", 1)
