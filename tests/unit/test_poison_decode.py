"""Hostile messages against the decoders and the raw sink's checks, fuzzed with hypothesis.

Whatever bytes arrive on a topic, decoding either returns a batch or raises BatchError (which
the raw sink dead-letters); nothing else may escape, or one message would stop its topic. The
event-time bounds accept a batch exactly when every nonzero time is inside them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.batch import (
    TIME_COLUMN,
    BatchError,
    RecordBatch,
    decode_batch,
    encode_batch,
    encode_topology,
)
from ingest.records import COLUMNS, MODELS, Column, JobTopology
from ingest.units import SECOND as SEC
from streams.raw_sink import DLQ_PAYLOAD_MAX, DeadLetter, Message, RawSink, TimeBounds
from tests.unit.test_raw_sink import FakeStore

KINDS = sorted(MODELS)
NOW = 1_800_000_000 * SEC
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_columns(kind: str, n: int, t0: int) -> dict[str, object]:
    """`n` rows of `kind` that satisfy the contract, times from `t0` on."""
    cols: dict[str, object] = {}
    for c in COLUMNS[kind]:
        if c.kind == "str":
            value = sorted(c.choices)[0] if c.choices else "x" * max(c.min_len, 1)
            cols[c.name] = [value] * n
        elif c.name in (TIME_COLUMN[kind], "t_enqueue", "t_end", "ts"):
            cols[c.name] = t0 + np.arange(n, dtype=np.int64)
        else:
            cols[c.name] = np.full(n, max(c.ge or 0, 0), np.int64)
    return cols


def column_values(c: Column, n: int) -> st.SearchStrategy[object]:
    """Any values of column `c` the contract allows, extremes included."""
    if c.kind == "str":
        if c.choices:
            return st.lists(st.sampled_from(sorted(c.choices)), min_size=n, max_size=n)
        text = st.text(min_size=max(c.min_len, 1), max_size=c.max_len or 64)
        return st.lists(text, min_size=n, max_size=n)
    lo = c.ge if c.ge is not None else -(1 << 63)
    hi = (c.lt - 1) if c.lt is not None else (1 << 63) - 1
    ints = st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi]))
    return st.lists(ints, min_size=n, max_size=n).map(lambda v: np.array(v, np.int64))


@st.composite
def valid_batches(draw: st.DrawFn) -> tuple[str, bytes, int]:
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.integers(1, 6))
    cols = {c.name: draw(column_values(c, n)) for c in COLUMNS[kind]}
    framing = draw(st.sampled_from(["json", "binary"]))
    packed = draw(st.booleans())
    job = draw(st.text(min_size=1, max_size=256))
    return kind, encode_batch(kind, job, cols, framing=framing, packed=packed), n


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_decode_or_raise_batch_error(data: bytes) -> None:
    for coded in (False, True):
        with contextlib.suppress(BatchError):
            decode_batch(data, coded=coded)


@FUZZ
@given(valid_batches(), st.data())
def test_valid_batches_decode_and_their_mutations_only_raise_batch_error(
        batch: tuple[str, bytes, int], data: st.DataObject) -> None:
    kind, raw, n = batch
    rb = decode_batch(raw, coded=True)
    assert rb.kind == kind and rb.n == n
    # flip, cut or splice bytes: a batch or a BatchError, never another exception
    i = data.draw(st.integers(0, len(raw) - 1))
    mutated = data.draw(st.sampled_from([
        raw[:i],
        raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1:],
        raw[:i] + data.draw(st.binary(max_size=32)) + raw[i:],
    ]))
    with contextlib.suppress(BatchError):
        decode_batch(mutated, coded=True)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)


@FUZZ
@given(st.sampled_from([*KINDS, "jobs"]), st.dictionaries(
    st.sampled_from(["v", "kind", "job_id", "producer", "seq", "n", "cols", "topologies",
                     "rank", "t_start"]), json_values, max_size=8))
def test_json_documents_of_any_shape_only_raise_batch_error(kind: str, doc: dict[str, Any]
                                                            ) -> None:
    doc.setdefault("kind", kind)
    with contextlib.suppress(BatchError):
        decode_batch(json.dumps(doc).encode())


@FUZZ
@given(st.lists(st.one_of(st.just(0), st.integers(1, (1 << 63) - 1)), min_size=1, max_size=20),
       st.integers(0, 3600 * SEC), st.integers(1, 86400 * SEC))
def test_time_bounds_accept_exactly_the_batches_inside_them(times: list[int], future: int,
                                                            span: int) -> None:
    bounds = TimeBounds(min_ns=946_684_800 * SEC, future_ns=future, span_ns=span)
    cols = valid_columns("ops", len(times), NOW)
    cols["t_start"] = np.array(times, np.int64)
    cols["t_end"] = np.zeros(len(times), np.int64)
    rb = decode_batch(encode_batch("ops", "j", cols), coded=True)
    t = np.array(times, np.int64)
    known = t[t != 0]
    inside = bool(((known >= bounds.min_ns) & (known <= NOW + future)).all()) and (
        not len(known) or int(known.max()) - int(known.min()) <= span)
    try:
        bounds.check("ops", rb, NOW)
        accepted = True
    except BatchError as e:
        accepted = False
        assert e.field == "t_start" and 0 <= e.row < len(times)
    assert accepted == inside


def test_out_of_range_times_are_dead_lettered_and_never_reach_the_store() -> None:
    store = FakeStore()
    dead: list[DeadLetter] = []

    async def dl(batch: Sequence[DeadLetter]) -> None:
        dead.extend(batch)

    bounds = TimeBounds(min_ns=946_684_800 * SEC, future_ns=600 * SEC, span_ns=86400 * SEC)
    sink = RawSink("ops", "ops", store, dl, retry_initial_s=0.001, bounds=bounds,
                   clock=lambda: NOW)

    def batch(**times: int) -> bytes:
        cols = valid_columns("ops", 3, NOW - 5 * SEC)
        for name, value in times.items():
            cols[name] = np.array([NOW - 4 * SEC, value, NOW - 3 * SEC], np.int64)
        return encode_batch("ops", "j", cols)

    msgs = [Message("rw.ops", 0, 0, batch(), NOW),
            Message("rw.ops", 0, 1, batch(t_start=1), NOW),  # 1970
            Message("rw.ops", 0, 2, batch(t_end=(1 << 63) - 1), NOW),  # 2262
            Message("rw.ops", 0, 3, batch(t_start=NOW - 101 * 86400 * SEC), NOW),  # 101 days
            Message("rw.ops", 0, 4, batch(t_start=NOW + 3600 * SEC), 0),  # ahead of our clock
            Message("rw.ops", 0, 5, batch(t_start=NOW + 3600 * SEC), NOW + 3600 * SEC),
            Message("rw.ops", 0, 6, batch(), NOW)]
    assert asyncio.run(sink.process(msgs)) == 9
    assert sorted(store.rows[0]["src_offset"].tolist()) == [0, 0, 0, 5, 5, 5, 6, 6, 6]
    assert [(d.offset, d.error.field, d.error.row) for d in dead] == [
        (1, "t_start", 1), (2, "t_end", 1), (3, "t_start", 2), (4, "t_start", 1)]
    assert "outside the plausible window" in dead[0].error.reason
    assert "spans 8726397 s, more than 86400 s" in dead[2].error.reason


class RefusingStore(FakeStore):
    """Refuses (like ClickHouse refusing the rows) any insert holding a batch of job 'bad'."""

    async def write(self, kind: str, batches: Sequence[RecordBatch], token: str, *,
                    sources: Sequence[tuple[int, int]]) -> int:
        if any(b.job_id == "bad" for b in batches):
            err = RuntimeError("Code: 252. DB::Exception: Too many partitions for single "
                               "INSERT block (more than 100)")
            err.code = 252  # type: ignore[attr-defined]
            raise err
        return await super().write(kind, batches, token, sources=sources)


def test_a_stage_ending_far_ahead_of_its_producer_is_out_of_bounds() -> None:
    bounds = TimeBounds(min_ns=946_684_800 * SEC, future_ns=600 * SEC, span_ns=86400 * SEC)
    cols = valid_columns("stages", 3, NOW - 100 * SEC)
    cols["model_backward"] = np.array([SEC, (1 << 63) - 1, SEC], np.int64)  # valid, absurd
    with pytest.raises(BatchError) as e:
        bounds.check("stages", decode_batch(encode_batch("stages", "j", cols)), NOW)
    assert e.value.row == 1 and e.value.field.startswith("t_start + data_next_wait")
    cols["model_backward"] = np.array([SEC, 2 * SEC, SEC], np.int64)
    bounds.check("stages", decode_batch(encode_batch("stages", "j", cols)), NOW)


def test_rows_the_store_refuses_are_dead_lettered_and_their_neighbours_stored() -> None:
    store = RefusingStore()
    dead: list[DeadLetter] = []

    async def dl(batch: Sequence[DeadLetter]) -> None:
        dead.extend(batch)

    sink = RawSink("ops", "ops", store, dl, retry_initial_s=0.001)
    msgs = [Message("rw.ops", 0, o, encode_batch("ops", job, valid_columns("ops", 2, NOW)))
            for o, job in enumerate(["a", "bad", "b"])]
    assert asyncio.run(sink.process(msgs)) == 4
    assert [d.offset for d in dead] == [1]
    assert "Too many partitions" in dead[0].error.reason
    assert sorted(o for c in store.rows for o in c["src_offset"].tolist()) == [0, 0, 2, 2]
    assert sink.stats.refused_inserts == 2 and sink.stats.dead_letters == 1


def test_outages_are_retried_not_dead_lettered() -> None:
    store = FakeStore(fail_times=3)  # ConnectionError three times
    dead: list[DeadLetter] = []

    async def dl(batch: Sequence[DeadLetter]) -> None:
        dead.extend(batch)

    sink = RawSink("ops", "ops", store, dl, retry_initial_s=0.001)
    msg = Message("rw.ops", 0, 0, encode_batch("ops", "a", valid_columns("ops", 2, NOW)))
    assert asyncio.run(sink.process([msg])) == 2
    assert not dead and sink.stats.insert_retries == 3


def test_a_dead_letter_of_a_huge_message_is_bounded_with_size_and_digest() -> None:
    value = b"\x00garbage" * (2 * DLQ_PAYLOAD_MAX // 8)
    d = DeadLetter("rw.ops", 0, 9, BatchError("not valid JSON"), value)
    doc = d.to_json()
    assert len(base64.b64decode(doc["payload_b64"])) == DLQ_PAYLOAD_MAX  # type: ignore[arg-type]
    assert doc["payload_bytes"] == len(value) and doc["payload_truncated"] is True
    assert len(orjson.dumps(doc)) < 16 << 20  # fits the broker's message.max.bytes
    assert d.digest() in d.reason() and str(len(value)) in d.reason()
    small = DeadLetter("rw.ops", 0, 9, BatchError("x"), b"abc")
    assert small.to_json()["payload_truncated"] is False and small.reason() == "x"


def test_a_topology_without_communicators_encodes_for_the_jobs_table() -> None:
    from streams import native

    topo = JobTopology(job_id="j", ts=NOW, world_size=1, hosts=["h"])
    assert topo.communicators == []
    rb = decode_batch(encode_topology(topo))
    assert rb.topologies == [topo]
    empty = np.empty(1, object)
    empty[0] = []
    block = native.native_block([("a", "Array(LowCardinality(String))", empty),
                                 ("b", "Array(Array(UInt32))", empty)])
    # no LowCardinality dictionary is written for no elements: ClickHouse reads none
    assert block.endswith(b"\x00" * 8 + b"\x01b\x14Array(Array(UInt32))" + b"\x00" * 8)
