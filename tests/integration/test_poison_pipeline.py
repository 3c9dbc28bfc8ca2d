"""The worst records we can think of, on every topic, against the real broker, worker and
ClickHouse: the worker stays up (same process throughout), every good neighbour is stored
exactly, the bad ones are in the dead-letter table with their reason, and the derived windows
stay near now (no window in 1970 or 2262); a valid batch a year old is stored and its job's
windows skip the year to the live batches (streams/windows.py, "Gaps")."""

from __future__ import annotations

import os
import re
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ingest.batch import TIME_COLUMN, BatchError, decode_batch, encode_batch, encode_topology
from ingest.records import COLUMNS, MODELS, Communicator, JobTopology
from ingest.units import SECOND as SEC
from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from streams.raw_sink import TimeBounds
from tests.conftest import KafkaService, SettingsFactory, free_ports
from tests.integration.test_ingest_pipeline import Pipeline
from tests.unit.test_poison_decode import valid_batches, valid_columns

KINDS = sorted(MODELS)
YEAR = 365 * 86400 * SEC


@pytest.fixture
def poison_pipeline(kafka: KafkaService, settings_factory: SettingsFactory
                    ) -> Iterator[Pipeline]:
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"x{uuid.uuid4().hex[:10]}", kafka_partitions=2,
                                metrics_port=free_ports(1)[0])
    p = Pipeline(settings)
    try:
        p.start_worker()
        yield p
    finally:
        stack.down(settings, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [s.name for s in settings.topics.specs(2)])


def extreme_valid(kind: str, n: int, t0: int) -> dict[str, object]:
    """Valid rows at the contract's edges: longest names (multi-byte), largest counters, the
    highest rank; times inside the bounds."""
    cols = valid_columns(kind, n, t0)
    for c in COLUMNS[kind]:
        if c.kind == "str" and not c.choices:
            cols[c.name] = ["é" * (c.max_len or 256)] * n
        elif c.kind == "int" and c.name not in (TIME_COLUMN[kind], "t_enqueue", "t_end", "ts"):
            # counters at their largest; durations as long as the bounds allow (an end ahead of
            # the producer's clock is out of bounds: tests/unit/test_poison_decode.py)
            hi = (c.lt - 1) if c.lt is not None else (1 << 62) if kind not in (
                "stages", "kernels") else 4 * SEC
            cols[c.name] = np.full(n, hi, np.int64)
    return cols


def with_time(kind: str, n: int, t0: int, name: str, value: int) -> bytes:
    cols = valid_columns(kind, n, t0)
    col = np.array(cols.get(name, np.zeros(n, np.int64)), np.int64)
    col[n // 2] = value
    cols[name] = col
    return encode_batch(kind, "poison", cols)


def test_worst_records_of_every_topic_leave_the_worker_up_and_neighbours_stored(
        poison_pipeline: Pipeline) -> None:
    p = poison_pipeline
    pid = stack.worker_daemon(p.settings).pid()
    assert pid is not None
    pub = p.publisher()
    now = time.time_ns()
    t0 = now - 30 * SEC
    good: dict[str, int] = {}
    bad = 0
    for kind in KINDS:
        main = TIME_COLUMN[kind]
        poison = [
            b"", b"\x00" * 64, b"{", b'{"v":1,"kind":"' + kind.encode() + b'","n":-1}',
            with_time(kind, 6, t0, main, 1),  # 1970
            with_time(kind, 6, t0, main, (1 << 63) - 1),  # 2262
            with_time(kind, 6, t0, main, t0 - 101 * 86400 * SEC),  # spans 101 days
            with_time(kind, 6, t0, main, now + 86400 * SEC),  # a day ahead of the producer
        ]
        if "t_end" in {c.name for c in COLUMNS[kind]}:
            poison.append(with_time(kind, 6, t0, "t_end", (1 << 63) - 1))
        batches = [encode_batch(kind, "good", valid_columns(kind, 5, t0 + i * SEC))
                   for i in range(3)]
        batches.insert(1, encode_batch(kind, "good", extreme_valid(kind, 4, t0)))
        for i, data in enumerate(batches):
            pub.publish(kind, data, key="k")
            if i < len(poison):  # poison between good neighbours on the same partition
                for bad_data in poison[i::len(batches)]:
                    pub.publish(kind, bad_data, key="k")
        good[kind] = 5 * 3 + 4
        bad += len(poison)
    # a message of 13.6 MB that is not a batch: its dead letter must still fit the DLQ topic
    pub.publish("ops", b"[" + b"1," * (6_800_000) + b"1]", key="k")
    bad += 1
    topo = JobTopology(job_id="good", ts=now, world_size=2, dp=2, hosts=["h0", "h1"])
    pub.publish("jobs", encode_topology(topo), key="good")  # communicators: [] (the default)
    pub.publish("jobs", b"not a topology", key="bad")
    bad += 1
    topo2 = JobTopology(job_id="good2", ts=now, world_size=2, dp=2, hosts=["h0", "h1"],
                        communicators=[Communicator(comm_id="dp0", kind="dp", members=[0, 1])])
    pub.publish("jobs", encode_topology(topo2), key="good2")
    # reports (streams/reports.py) that are not, or that would move the job's windows to 2262
    stored = p.settings.topics.stored
    forged = {"v": 1, "job": "good", "extents": [
        {"kind": "ops", "producer": "x", "lo": t0, "hi": (1 << 63) - 1,
         "segments": [[t0, (1 << 63) - 1]], "ranks": [0], "ends": [(1 << 63) - 1]}]}
    for data in (b"", b"{", b'{"v": 1, "job": "good", "extents": [7]}', orjson.dumps(forged)):
        pub.publish("ops", data, key="good", topic=stored)
    assert pub.flush(60) == 0

    for kind, n in good.items():
        assert p.wait_count(kind, n, "job_id = 'good'", timeout=90) == n, kind
    assert p.wait_count("jobs", 2, "job_id LIKE 'good%'") == 2
    assert p.wait_count("dlq", bad, timeout=90) == bad
    for kind in KINDS:
        assert p.count(kind, "job_id = 'poison'") == 0, kind
    assert p.sql("SELECT comm_ids FROM jobs FINAL WHERE job_id = 'good'") == "[]"
    reasons = p.sql("SELECT reason FROM dlq FORMAT TSVRaw")
    assert "outside the plausible window" in reasons and "spans" in reasons
    huge = p.sql("SELECT length(payload), reason FROM dlq WHERE reason LIKE '%truncated%' "
                 "FORMAT TSVRaw")
    assert huge.startswith(f"{8 << 20}\t") and "of 13600003 bytes; sha256" in huge

    # the same process took all of it, and it still answers
    assert stack.worker_daemon(p.settings).pid() == pid
    os.kill(pid, 0)
    deadline = time.monotonic() + 30
    while metric(p, "rankwatch_stored_reports_total", 'what="malformed"') < 4 \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(p, "rankwatch_stored_reports_total", 'what="malformed"') == 4
    # derived windows stay near now: nothing before the good rows, nothing ahead of the clock
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not p.count("progress"):
        time.sleep(0.5)
    lo, hi = (int(x) for x in p.sql(
        "SELECT toUnixTimestamp64Nano(min(window_end)), toUnixTimestamp64Nano(max(window_end)) "
        "FROM progress").split("\t"))
    assert p.count("progress") > 0
    assert t0 - 60 * SEC <= lo and hi <= time.time_ns() + 60 * SEC, (lo, hi)
    ahead = p.count("iterations", "toUnixTimestamp64Nano(t_end) > "
                                  f"{time.time_ns() + 60 * SEC}")
    assert ahead == 0
    check_year_old_batches(p, t0)


def metric(p: Pipeline, name: str, labels: str) -> float:
    """A sample of the worker's /metrics."""
    s = p.settings
    with urllib.request.urlopen(f"http://{s.bind_host}:{s.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    assert m, [ln for ln in text.splitlines() if name in ln]
    return float(m.group(1))


def check_year_old_batches(p: Pipeline, t0: int) -> None:
    """A valid ops batch a year old, then live batches, (a) for the job "good", whose progress
    windows have closed, and (b) as the first batch of a new job "year": the old rows are
    stored, each job's progress reaches the live batches within seconds, and "year" has a few
    windows at the old batch and the live ones, none between (streams/windows.py, "Gaps":
    closed one by one, 16 per tick, the year would be ~31.5 M windows, ~6 days)."""
    started = time.monotonic()
    pub = p.publisher()
    now = time.time_ns()
    # live batches 2 s apart: the window after the first closes before the source falls silent
    old, live = now - YEAR, now - 5 * SEC
    for job, key in (("good", "k"), ("year", "year")):  # in order, on one partition each
        for t in (old, live, live + 2 * SEC, live + 4 * SEC):
            pub.publish("ops", encode_batch("ops", job, valid_columns("ops", 5, t)), key=key)
    assert pub.flush(60) == 0
    for job in ("good", "year"):
        where = f"job_id = '{job}' AND toUnixTimestamp64Nano(t_start) < {old + SEC}"
        assert p.wait_count("ops", 5, where, timeout=60) == 5, job  # stored raw
        where = f"job_id = '{job}' AND toUnixTimestamp64Nano(window_end) > {live + SEC}"
        assert p.wait_count("progress", 1, where, timeout=30) >= 1, (job, p.sql(
            "SELECT count(), max(window_end) FROM progress WHERE job_id = "
            f"'{job}' FORMAT TSVRaw"))
    reached = time.monotonic() - started
    assert p.count("ops", "job_id = 'year'") == 20
    # (a) the old batch is late data for "good": no window of it falls back a year
    assert p.count("progress", "job_id = 'good' AND "
                               f"toUnixTimestamp64Nano(window_end) < {t0 - 60 * SEC}") == 0
    # (b) a handful of windows at the old batch, none in the year, the live ones: not millions
    end = "toUnixTimestamp64Nano(window_end)"
    at_old, between, total = (int(x) for x in p.sql(
        f"SELECT countIf({end} < {old + 60 * SEC}), countIf({end} >= {old + 60 * SEC} AND "
        f"{end} < {live}), count() FROM progress WHERE job_id = 'year'").split("\t"))
    assert 1 <= at_old <= 5 and between == 0 and total <= 60, (at_old, between, total)
    # the worker's /metrics counts the year skipped
    s = p.settings
    with urllib.request.urlopen(f"http://{s.bind_host}:{s.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^rankwatch_derived_windows_skipped_total\{kind="progress"\} (\S+)$', text,
                  re.M)
    assert m and float(m.group(1)) >= (YEAR - 86400 * SEC) // SEC, (
        m, [ln for ln in text.splitlines() if "skipped" in ln])
    print(f"\nyear-old batches: progress reached the live ones in {reached:.1f} s, checked in "
          f"{time.monotonic() - started:.1f} s")


HOWS = ("as is", "cut", "as is", "flip", "as is", "other topic")


@st.composite
def messages(draw: st.DrawFn, now: int, how: str) -> tuple[str, bytes, int | None]:
    """(topic kind, message, rows it should store or None for a dead letter): a fuzzed batch of
    any kind with its times near `now`, as is, cut, bit-flipped or on another kind's topic."""
    kind, raw, n = draw(valid_batches())
    rb = decode_batch(raw)
    for name in {TIME_COLUMN[kind], "t_end", "t_enqueue", "ts"} & set(rb.cols):
        rb.cols[name] = now - draw(st.integers(0, 60 * SEC)) + np.arange(n, dtype=np.int64)
    cols = {c.name: rb.column(c.name) for c in COLUMNS[kind]}
    raw = encode_batch(kind, rb.job_id, cols, framing=draw(st.sampled_from(["json", "binary"])))
    topic = kind
    if how == "cut":
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif how == "flip":
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    elif how == "other topic":
        topic = draw(st.sampled_from([k for k in KINDS if k != kind]))
    try:  # what the worker must do, by the unit-tested rules
        got = decode_batch(raw, coded=True)
        if got.kind != topic:
            return topic, raw, None
        BOUNDS.check(got.kind, got, now)
        return topic, raw, got.n
    except BatchError:
        return topic, raw, None


BOUNDS = TimeBounds(min_ns=946_684_800 * SEC, future_ns=600 * SEC, span_ns=86400 * SEC)


@settings(max_examples=1, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzed_messages_through_the_real_worker(poison_pipeline: Pipeline,
                                                 data: st.DataObject) -> None:
    """Sixty hypothesis-drawn messages of every kind (valid at the contract's edges, cut,
    bit-flipped, on the wrong topic) through the real broker and worker: each valid one is
    stored with exactly its rows, each other one is a dead letter, and the worker stays up."""
    p = poison_pipeline
    pid = stack.worker_daemon(p.settings).pid()
    now = time.time_ns()
    msgs = [data.draw(messages(now, HOWS[i % len(HOWS)])) for i in range(60)]
    pub = p.publisher()
    for i, (topic, raw, _) in enumerate(msgs):
        pub.publish(topic, raw, key=str(i % 5))
    assert pub.flush(60) == 0
    want: Counter[str] = Counter()
    for topic, _, n in msgs:
        if n is not None:
            want[topic] += n
    dead = sum(n is None for _, _, n in msgs)
    print(f"\n{len(msgs) - dead} messages to store ({sum(want.values())} rows), {dead} to "
          "dead-letter")
    assert dead and want  # both paths exercised
    assert p.wait_count("dlq", dead, timeout=90) == dead
    for kind in KINDS:
        assert p.wait_count(kind, want[kind], timeout=60) == want[kind], kind
    time.sleep(2)
    assert p.count("dlq") == dead
    assert all(p.count(kind) == want[kind] for kind in KINDS)
    assert stack.worker_daemon(p.settings).pid() == pid
