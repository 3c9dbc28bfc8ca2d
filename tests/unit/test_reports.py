"""Stored reports (streams/reports.py): what a batch's extent is, the wire format both ways,
and a decoder that refuses anything that is not a report, whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.batch import decode_batch, encode_batch
from ingest.keys import SPREAD_KINDS, batch_key
from streams.reports import Extent, ReportError, check_times, decode_report, encode_report, extent

S = 1_000_000_000
T0 = 1_700_000_000 * S


def calls() -> bytes:
    """Ranks 0..2; rank 2's last call is in flight (t_end 0, enqueued at T0 + 9 s)."""
    return encode_batch("ops", "j", {
        "rank": np.array([0, 1, 0, 2, 1, 2]), "comm_id": ["dp"] * 6,
        "op_seq": np.arange(6), "op": ["AllReduce"] * 6, "bytes": np.full(6, 64),
        "t_enqueue": T0 + np.array([0, 0, 1, 1, 5, 9]) * S,
        "t_start": T0 + np.array([0, 0, 1, 1, 5, 9]) * S,
        "t_end": T0 + np.array([1, 1, 2, 2, 6, 0]) * S}, producer="host-3")


def test_an_extent_is_what_the_owner_would_observe() -> None:
    e = extent("ops", decode_batch(calls(), coded=True), gap_ns=2 * S)
    assert e is not None
    assert (e.job, e.kind, e.producer) == ("j", "ops", "host-3")
    assert (e.lo, e.hi) == (T0, T0 + 9 * S)
    # [0, 2] s, then a gap of 3 s, then [5, 6] s, and 9 s (in flight: its start): three
    assert e.segments == ((T0, T0 + 2 * S), (T0 + 5 * S, T0 + 6 * S), (T0 + 9 * S, T0 + 9 * S))
    assert e.ranks.tolist() == [0, 1, 2]
    assert e.ends.tolist() == [T0 + 2 * S, T0 + 6 * S, T0 + 9 * S]


def test_a_report_round_trips() -> None:
    e = extent("ops", decode_batch(calls(), coded=True), gap_ns=2 * S)
    assert e is not None
    back, = decode_report(encode_report("j", [e]))
    assert (back.job, back.kind, back.producer, back.lo, back.hi, back.segments) == \
        (e.job, e.kind, e.producer, e.lo, e.hi, e.segments)
    assert back.ranks.tolist() == e.ranks.tolist() and back.ends.tolist() == e.ends.tolist()


def good() -> dict[str, Any]:
    return {"v": 1, "job": "j", "extents": [
        {"kind": "flows", "producer": "h", "lo": 10, "hi": 20, "segments": [[10, 20]],
         "ranks": [], "ends": []}]}


@pytest.mark.parametrize("change, why", [
    (lambda d: d.update(v=2), "version"),
    (lambda d: d.update(job=""), "no job"),
    (lambda d: d.update(extents={}), "extents"),
    (lambda d: d["extents"][0].update(kind="nope"), "unknown kind"),
    (lambda d: d["extents"][0].update(lo=0), "positive int64"),
    (lambda d: d["extents"][0].update(hi=1 << 63), "positive int64"),
    (lambda d: d["extents"][0].update(lo=True), "positive int64"),
    (lambda d: d["extents"][0].update(lo=30), "after hi"),
    (lambda d: d["extents"][0].update(segments=[]), "segments expected"),
    (lambda d: d["extents"][0].update(segments=[[5, 20]]), "outside"),
    (lambda d: d["extents"][0].update(segments=[[10]]), "not \\[start, end\\]"),
    (lambda d: d["extents"][0].update(ranks=[1]), "one length"),
    (lambda d: d["extents"][0].update(ranks=["a"], ends=[1]), "integers"),
    (lambda d: d["extents"][0].update(ranks=[-1], ends=[1]), "non-negative"),
    (lambda d: d["extents"].append(3), "not an object"),
])
def test_a_malformed_report_is_refused_whole(change, why) -> None:
    d = good()
    assert decode_report(orjson.dumps(d))
    change(d)
    with pytest.raises(ReportError, match=why):
        decode_report(orjson.dumps(d))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["v", "job", "extents", "kind", "producer", "lo", "hi", "segments",
                         "ranks", "ends"]), inner, max_size=6), max_leaves=20).map(
    orjson.dumps)))
def test_any_bytes_are_a_report_or_a_report_error(data: bytes) -> None:
    try:
        out = decode_report(data)
    except ReportError:
        return
    assert all(isinstance(e, Extent) for e in out)


def test_spread_kinds_are_keyed_by_job_and_producer() -> None:
    assert batch_key("ops", "j", "host-1") == "j/host-1"
    assert {batch_key(k, "j", "h") for k in SPREAD_KINDS} == {"j/h"}
    for kind in ("stages", "beats", "kernels", "jobs"):
        assert batch_key(kind, "j", "h") == "j"
    assert batch_key("ops", "j", "") == "j"


def test_times_no_stored_batch_could_have_are_refused() -> None:
    exts = decode_report(orjson.dumps(good()))
    check_times(exts, 10, 20)
    with pytest.raises(ReportError, match="outside the plausible times"):
        check_times(exts, 11, 20)
    with pytest.raises(ReportError, match="outside the plausible times"):
        check_times(exts, 10, 19)
