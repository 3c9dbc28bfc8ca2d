"""One delivery worker (a thread) per sink: a sink that is down delays only itself.

Contract of `SinkWorker`:
- `submit(item)` never blocks; items are delivered in the order submitted (per sink), so a
  `resolved` version never overtakes its `open`.
- An item whose id the ledger has for this sink is skipped (a redelivered message).
- Each attempt asks the sink for fresh requests (a new signature timestamp, a new Alertmanager
  endsAt) and sends them; a `RETRY` answer waits an exponential backoff with jitter — the
  "equal jitter" of AWS's "Exponential Backoff And Jitter" (half the capped delay plus a uniform
  draw over the other half), and at least the receiver's Retry-After — then tries again.
- After `max_attempts` failures, or at once when the receiver refuses the payload for good, the
  item goes to the dead-letter callback with the reason; only once that is durable does the item
  count as done.
- `item.done(outcome)` is called exactly once per item (delivered, duplicate, stale, dead); the
  notifier commits a Kafka offset only when every sink it routed the message to called it.
- `stop()` ends the thread after the current request; an unfinished item stays not done (its
  offset uncommitted), so the next run delivers it.
- A sink with `refresh` (Alertmanager) gets it called every `resend_s` while its queue is idle.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from diagnosis.model import Diagnosis
from diagnosis.sinks.base import Outcome, Request, Sink, Verdict
from diagnosis.sinks.state import Ledger

log = logging.getLogger("rankwatch.notify")

#: (status, headers, body) of an answer; status 0 when none came (refused, timed out, reset)
Answer = tuple[int, Mapping[str, str], bytes]
Post = Callable[[Request, float], Answer]
#: (sink name, item, reason, attempts) -> whether the dead letter is durable
DeadLetterFn = Callable[[str, "Item", str, int], bool]
MAX_ANSWER_BYTES = 64 << 10


@dataclass
class Item:
    d: Diagnosis
    raw: bytes
    done: Callable[[str], None] = field(default=lambda _outcome: None)
    #: (topic, partition, offset) it came from, for the dead letter
    source: tuple[str, int, int] = ("", -1, -1)
    received: float = field(default_factory=time.monotonic)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a new destination: following one would send the payload
    (and a signature) somewhere the configuration never named."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def http_post(req: Request, timeout: float) -> Answer:
    r = urllib.request.Request(req.url, data=req.body, headers=dict(req.headers), method="POST")
    try:
        with _OPENER.open(r, timeout=timeout) as resp:
            return int(resp.status), dict(resp.headers.items()), resp.read(MAX_ANSWER_BYTES)
    except urllib.error.HTTPError as e:
        body = b""
        with contextlib.suppress(OSError):
            body = e.read(MAX_ANSWER_BYTES)
        return int(e.code), dict(e.headers.items()) if e.headers else {}, body
    except (urllib.error.URLError, OSError, ValueError) as e:
        log.debug("%s: %s", req.url, e)
        return 0, {}, str(getattr(e, "reason", e)).encode()


def backoff(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Delay before retry number `attempt` (1-based): equal jitter on a capped exponential."""
    d = min(cap_s, base_s * 2.0 ** min(attempt - 1, 60))
    return d / 2 + rng.uniform(0, d / 2)


@dataclass
class SinkStats:
    delivered: int = 0
    duplicates: int = 0
    retries: int = 0
    dead: int = 0
    refreshes: int = 0
    #: seconds from receipt to delivery of the last delivered item
    last_latency_s: float = 0.0
    up: bool = True


class SinkWorker(threading.Thread):
    def __init__(self, sink: Sink, ledger: Ledger, dead_letter: DeadLetterFn, *,
                 max_attempts: int, backoff_s: float, backoff_max_s: float,
                 min_interval_s: float = 0.0, timeout_s: float = 10.0, resend_s: float = 60.0,
                 post: Post = http_post, rng: random.Random | None = None,
                 on_delivered: Callable[[str, Item, float], None] | None = None) -> None:
        super().__init__(name=f"notify-{sink.name}", daemon=True)
        self.sink = sink
        self.ledger = ledger
        self.dead_letter = dead_letter
        self.max_attempts = max_attempts
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.resend_s = resend_s
        self.post = post
        self.rng = rng or random.Random()
        self.on_delivered = on_delivered
        self.stats = SinkStats()
        self._queue: deque[Item] = deque()
        self._cv = threading.Condition()
        self._halt = threading.Event()
        self._last_post = 0.0
        self._last_refresh = time.monotonic()

    # -- the caller's side ---------------------------------------------------------------

    def submit(self, item: Item) -> None:
        with self._cv:
            self._queue.append(item)
            self._cv.notify()

    def backlog(self) -> int:
        with self._cv:
            return len(self._queue)

    def stop(self) -> None:
        self._halt.set()
        with self._cv:
            self._cv.notify_all()

    # -- the thread ----------------------------------------------------------------------

    def run(self) -> None:
        while not self._halt.is_set():
            item = self._next()
            if item is None:
                self._maybe_refresh()
                continue
            try:
                self._deliver(item)
            except Exception:  # a bug must not end the thread silently: log, keep the item
                log.exception("%s: delivering %s failed unexpectedly", self.sink.name, item.d.id)
                self._halt.wait(self.backoff_max_s)
                continue
            if self._halt.is_set():
                break
            with self._cv:
                if self._queue and self._queue[0] is item:
                    self._queue.popleft()

    def _next(self) -> Item | None:
        with self._cv:
            if not self._queue:
                self._cv.wait(timeout=min(1.0, self.resend_s))
            return self._queue[0] if self._queue and not self._halt.is_set() else None

    def _send(self, item: Item) -> Verdict:
        reqs = self.sink.requests(item.d, item.raw, time.time_ns())
        verdict = Verdict(Outcome.DELIVERED)
        for req in reqs:
            wait = self._last_post + self.min_interval_s - time.monotonic()
            if wait > 0 and self._halt.wait(wait):
                return Verdict(Outcome.RETRY, "stopping")
            self._last_post = time.monotonic()
            status, headers, body = self.post(req, self.timeout_s)
            verdict = self.sink.classify(status, headers, body)
            if verdict.outcome is not Outcome.DELIVERED:
                return verdict
        return verdict if reqs else Verdict(Outcome.DELIVERED, "stale")

    def _deliver(self, item: Item) -> None:
        name, d = self.sink.name, item.d
        if self.ledger.done(name, d.id):
            self.stats.duplicates += 1
            item.done("duplicate")
            return
        attempts = 0
        while not self._halt.is_set():
            v = self._send(item)
            if v.outcome is Outcome.DELIVERED:
                delivered = getattr(self.sink, "delivered", None)
                if delivered is not None:
                    delivered(d, time.time_ns())
                self.ledger.mark(name, d.id, v.reason or "delivered")
                latency = time.monotonic() - item.received
                self.stats.delivered += 1
                self.stats.last_latency_s = latency
                self.stats.up = True
                if self.on_delivered is not None:
                    self.on_delivered(name, item, latency)
                item.done("delivered")
                return
            if self._halt.is_set():
                return
            attempts += 1
            self.stats.up = False
            if v.outcome is Outcome.REFUSED or attempts >= self.max_attempts:
                why = (f"refused: {v.reason}" if v.outcome is Outcome.REFUSED
                       else f"{attempts} attempts failed, the last: {v.reason}")
                self._dead(item, why, attempts)
                return
            self.stats.retries += 1
            delay = max(backoff(attempts, self.backoff_s, self.backoff_max_s, self.rng),
                        v.retry_after_s)
            log.warning("%s: %s not delivered (%s); retry %d of %d in %.1f s", name, d.id,
                        v.reason, attempts, self.max_attempts - 1, delay)
            self._halt.wait(delay)

    def _dead(self, item: Item, reason: str, attempts: int) -> None:
        log.error("%s: %s dead-lettered: %s", self.sink.name, item.d.id, reason)
        n = 0
        while not self.dead_letter(self.sink.name, item, reason, attempts):
            n += 1
            if self._halt.wait(backoff(n, self.backoff_s, self.backoff_max_s, self.rng)):
                return
        self.ledger.mark(self.sink.name, item.d.id, "dead")
        self.stats.dead += 1
        item.done("dead")

    def _maybe_refresh(self) -> None:
        refresh = getattr(self.sink, "refresh", None)
        if refresh is None or time.monotonic() - self._last_refresh < self.resend_s:
            return
        self._last_refresh = time.monotonic()
        req = refresh(time.time_ns())
        if req is None:
            return
        status, headers, body = self.post(req, self.timeout_s)
        v = self.sink.classify(status, headers, body)
        self.stats.refreshes += 1
        if v.outcome is not Outcome.DELIVERED:
            log.warning("%s: re-sending the open alerts failed (%s); next try in %.0f s",
                        self.sink.name, v.reason, self.resend_s)
