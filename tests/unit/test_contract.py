"""The record contract: round-trips, every rejection path, agreement with the pydantic models."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ingest.batch import (
    FRAME_MAGIC,
    BatchError,
    _bad_strings,
    _check_str,
    _spec,
    decode_batch,
    encode_batch,
    encode_topology,
)
from ingest.records import COLUMNS, DERIVED, MODELS, Communicator, JobTopology

OPS = ["AllReduce", "AllGather", "ReduceScatter", "Send", "Recv"]


#: hypothesis text without lone surrogates (not encodable as UTF-8)
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)

def ops_cols(n: int, seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    t0 = 1_700_000_000_000_000_000 + rng.integers(0, 10**9, n)
    return {
        "rank": rng.integers(0, 4096, n),
        "comm_id": [f"dp{i % 3}" for i in range(n)],
        "op_seq": np.arange(n),
        "op": [OPS[i % len(OPS)] for i in range(n)],
        "bytes": rng.integers(0, 1 << 30, n),
        "t_enqueue": t0,
        "t_start": t0 + 10,
        "t_end": t0 + 1000,
    }


def doc(data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = orjson.loads(data)
    return out


def test_round_trip_ops_defaults_and_dtypes() -> None:
    cols = ops_cols(100)
    rb = decode_batch(encode_batch("ops", "job-a", cols, producer="h1", seq=3))
    assert (rb.kind, rb.job_id, rb.producer, rb.seq, rb.n) == ("ops", "job-a", "h1", 3, 100)
    assert rb.cols["rank"].dtype == np.int32
    assert rb.cols["t_end"].dtype == np.int64
    np.testing.assert_array_equal(rb.cols["op_seq"], cols["op_seq"])
    assert list(rb.cols["comm_id"]) == cols["comm_id"]
    assert (rb.cols["peer"] == -1).all() and (rb.cols["step"] == -1).all()


def test_pre_encoded_strings_and_plain_string_arrays_agree() -> None:
    cols = ops_cols(50)
    codes = np.arange(50) % 2
    a = decode_batch(encode_batch("ops", "j", {**cols, "op": (codes, ["Send", "Recv"])}))
    plain = doc(encode_batch("ops", "j", cols))
    plain["cols"]["op"] = [["Send", "Recv"][c] for c in codes]
    b = decode_batch(orjson.dumps(plain))
    assert list(a.cols["op"]) == list(b.cols["op"])


def test_empty_batch() -> None:
    rb = decode_batch(encode_batch("kernels", "j", {k: [] for k in
                                                    ("rank", "stream", "kernel", "t_start",
                                                     "duration")}))
    assert rb.n == 0 and rb.cols["kernel"].dtype == object


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_kind_round_trips(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(sorted(MODELS)))
    n = data.draw(st.integers(0, 30))
    cols: dict[str, list[Any]] = {}
    for c in COLUMNS[kind]:
        if not c.required and data.draw(st.booleans()):
            continue
        if c.kind == "int":
            lo = c.ge if c.ge is not None else -(1 << 62)
            hi = (c.lt - 1) if c.lt is not None else (1 << 62)
            cols[c.name] = data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
        elif c.choices:
            cols[c.name] = data.draw(st.lists(st.sampled_from(sorted(c.choices)),
                                              min_size=n, max_size=n))
        else:
            alphabet = st.characters(codec="utf-8", exclude_categories=SURROGATES)
            cols[c.name] = data.draw(st.lists(
                st.text(alphabet, min_size=max(c.min_len, 0), max_size=20), min_size=n,
                max_size=n))
    rb = decode_batch(encode_batch(kind, "job", cols))
    assert rb.n == n
    for name, values in cols.items():
        assert list(rb.cols[name]) == list(values)
    # every row the vectorized decoder accepts, the pydantic model accepts too
    for i in range(min(n, 3)):
        MODELS[kind].model_validate({k: v[i].item() if hasattr(v[i], "item") else v[i]
                                     for k, v in rb.cols.items()})


@pytest.mark.parametrize(
    ("mutate", "field", "row", "words"),
    [
        (lambda d: d["cols"].__setitem__("rank", [0, -1, 2]), "rank", 1, "below the minimum"),
        (lambda d: d["cols"].__setitem__("rank", [0, 1, 1 << 31]), "rank", 2, "not below"),
        (lambda d: d["cols"].__setitem__("bytes", [1, 2.5, 3]), "bytes", 1, "integer"),
        (lambda d: d["cols"].__setitem__("bytes", [1, None, 3]), "bytes", 1, "integer"),
        (lambda d: d["cols"].__setitem__("bytes", [1, "2", 3]), "bytes", 1, "integer"),
        (lambda d: d["cols"].__setitem__("bytes", [1, 1 << 63, 3]), "bytes", 1, "int64"),
        (lambda d: d["cols"].__setitem__("bytes", [1, 2]), "bytes", -1, "rows"),
        (lambda d: d["cols"].__setitem__("bytes", "x"), "bytes", -1, "array of integers"),
        (lambda d: d["cols"].pop("t_start"), "t_start", -1, "required"),
        (lambda d: d["cols"].__setitem__("color", [1, 2, 3]), "color", -1, "unknown column"),
        (lambda d: d["cols"].__setitem__("op", {"d": ["AllReduce", "Jump"], "i": [0, 1, 0]}),
         "op", 1, "not one of"),
        (lambda d: d["cols"].__setitem__("op", {"d": ["AllReduce"], "i": [0, 1, 0]}),
         "op", 1, "not below"),
        (lambda d: d["cols"].__setitem__("op", ["AllReduce", 7, "Send"]), "op", 1, "string"),
        (lambda d: d["cols"].__setitem__("comm_id", ["a", "", "b"]), "comm_id", 1, "empty"),
        (lambda d: d["cols"].__setitem__("comm_id", ["a", "b", "x" * 300]), "comm_id", 2,
         "exceeds"),
        (lambda d: d["cols"].__setitem__("op", {"d": ["Send"]}), "op", -1, '{"d"'),
        (lambda d: d.__setitem__("v", 2), "v", -1, "unsupported version"),
        (lambda d: d.__setitem__("kind", "potatoes"), "kind", -1, "unknown kind"),
        (lambda d: d.__setitem__("job_id", ""), "job_id", -1, "job_id"),
        (lambda d: d.__setitem__("n", -1), "n", -1, "n must"),
        (lambda d: d.__setitem__("seq", "1"), "seq", -1, "seq"),
        (lambda d: d.pop("cols"), "cols", -1, "cols"),
    ],
)
def test_rejections_name_field_row_reason(mutate, field, row, words) -> None:
    d = doc(encode_batch("ops", "j", ops_cols(3)))
    mutate(d)
    with pytest.raises(BatchError) as exc:
        decode_batch(orjson.dumps(d))
    assert exc.value.field == field
    assert exc.value.row == row
    assert words in exc.value.reason
    assert exc.value.to_dict() == {"field": field, "row": row, "reason": exc.value.reason}


@pytest.mark.parametrize("packed", [True, False])
def test_packed_and_plain_integer_columns_decode_alike(packed: bool) -> None:
    cols = ops_cols(40, seed=3)
    data = encode_batch("ops", "j", cols, packed=packed)
    assert (b'"le64"' in data) is packed
    rb = decode_batch(data)
    np.testing.assert_array_equal(rb.cols["t_start"], cols["t_start"])
    assert list(rb.cols["op"]) == cols["op"]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"le64": "!!notbase64"}, "not valid base64"),
        ({"le64": base64.b64encode(b"1234567").decode()}, "whole number of int64"),
        ({"le64": base64.b64encode(np.arange(2, dtype="<i8").tobytes()).decode()}, "rows"),
        ({"le64": base64.b64encode(np.array([0, -9, 1], "<i8").tobytes()).decode()},
         "below the minimum"),
        ({"le64": "AAAAAAAAAAA=", "x": 1}, "le64"),
    ],
)
def test_packed_column_rejections(value: dict[str, Any], words: str) -> None:
    d = doc(encode_batch("ops", "j", ops_cols(3)))
    d["cols"]["bytes"] = value
    with pytest.raises(BatchError, match=words) as exc:
        decode_batch(orjson.dumps(d))
    assert exc.value.field == "bytes"


def test_not_json_and_not_object() -> None:
    with pytest.raises(BatchError, match="not valid JSON"):
        decode_batch(b"{nope")
    with pytest.raises(BatchError, match="JSON object"):
        decode_batch(b"[1, 2]")


def test_unused_bad_dictionary_entry_is_harmless() -> None:
    d = doc(encode_batch("ops", "j", ops_cols(3)))
    d["cols"]["op"] = {"d": ["AllReduce", "Jump", 7], "i": [0, 0, 0]}
    assert list(decode_batch(orjson.dumps(d)).cols["op"]) == ["AllReduce"] * 3
    coded = decode_batch(orjson.dumps(d), coded=True).strings["op"]
    assert list(coded.values) == ["AllReduce", "", ""]  # blanked: no writer sees a bad value
    assert list(coded.strings()) == ["AllReduce"] * 3


_ODD = st.one_of(st.text(max_size=300), st.sampled_from(["AllReduce", "Jump", ""]),
                 st.integers(), st.none(), st.builds(lambda t: type("S", (str,), {})(t), st.text()))


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["ops", "flows", "beats"]), values=st.lists(_ODD, max_size=12),
       data=st.data())
def test_vectorized_string_rules_agree_with_the_one_value_check(
        kind: str, values: list[Any], data: st.DataObject) -> None:
    c = data.draw(st.sampled_from([c for c in _spec(kind) if c.kind == "str"]))
    expected = [i for i, v in enumerate(values) if _check_str(c, v) is not None]
    assert _bad_strings(c, values).tolist() == expected


def test_string_rules_name_the_first_bad_row_in_both_column_forms() -> None:
    d = doc(encode_batch("ops", "j", ops_cols(5)))
    d["cols"]["op"] = ["AllReduce", "AllReduce", "Jump", "x" * 3, "Jump"]
    with pytest.raises(BatchError, match="'Jump' is not one of") as exc:
        decode_batch(orjson.dumps(d))
    assert (exc.value.field, exc.value.row) == ("op", 2)
    d["cols"]["comm_id"] = {"d": ["dp0", "x" * 257, ""], "i": [0, 0, 0, 2, 1]}
    d["cols"]["op"] = ["AllReduce"] * 5
    with pytest.raises(BatchError, match="empty string") as exc:  # entry 1 is used later
        decode_batch(orjson.dumps(d))
    assert (exc.value.field, exc.value.row) == ("comm_id", 3)
    d["cols"]["comm_id"] = {"d": ["dp0", "x" * 257], "i": [0, 0, 1, 0, 0]}
    with pytest.raises(BatchError, match="exceeds 256") as exc:
        decode_batch(orjson.dumps(d))
    assert (exc.value.field, exc.value.row) == ("comm_id", 2)


def test_encode_validates_at_the_source() -> None:
    with pytest.raises(BatchError, match="below the minimum"):
        encode_batch("ops", "j", {**ops_cols(3), "bytes": [1, -5, 3]})
    with pytest.raises(BatchError, match="unknown columns"):
        encode_batch("ops", "j", {**ops_cols(3), "colour": [1, 2, 3]})
    with pytest.raises(BatchError, match="unknown kind"):
        encode_batch("nope", "j", {})


def topo(**kw: object) -> JobTopology:
    base: dict[str, object] = dict(job_id="j", ts=1, world_size=4, tp=2, dp=2, hosts=["h0"] * 4,
                                   communicators=[Communicator(comm_id="tp0", kind="tp",
                                                               members=[0, 1])])
    base.update(kw)
    return JobTopology(**base)  # type: ignore[arg-type]


def test_topology_round_trip_and_rules() -> None:
    rb = decode_batch(encode_topology(topo()))
    assert rb.kind == "jobs" and rb.n == 1 and rb.topologies[0] == topo()
    with pytest.raises(ValidationError, match="tp\\*pp\\*dp\\*cp"):
        topo(world_size=8, hosts=["h"] * 8)
    with pytest.raises(ValidationError, match="hosts has 3"):
        topo(hosts=["h"] * 3)
    with pytest.raises(ValidationError, match=">= world_size"):
        topo(communicators=[Communicator(comm_id="x", kind="dp", members=[0, 9])])
    with pytest.raises(ValidationError, match="duplicate"):
        topo(communicators=[Communicator(comm_id="x", kind="dp", members=[1, 1])])


def test_bad_topology_in_jobs_batch_names_field_and_row() -> None:
    d = doc(encode_topology([topo(), topo(job_id="k")]))
    d["recs"][1]["tp"] = 0
    with pytest.raises(BatchError) as exc:
        decode_batch(orjson.dumps(d))
    assert exc.value.field == "tp" and exc.value.row == 1


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_every_derived_kind_round_trips_and_models_agree(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(sorted(DERIVED)))
    assert kind not in MODELS  # raw agents subscribe to MODELS only
    n = data.draw(st.integers(0, 20))
    cols: dict[str, list[Any]] = {}
    for c in COLUMNS[kind]:
        if not c.required and data.draw(st.booleans()):
            continue
        if c.kind == "int":
            lo = c.ge if c.ge is not None else -(1 << 62)
            hi = (c.lt - 1) if c.lt is not None else (1 << 62)
            cols[c.name] = data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
        elif c.choices:
            cols[c.name] = data.draw(st.lists(st.sampled_from(sorted(c.choices)),
                                              min_size=n, max_size=n))
        else:
            cols[c.name] = data.draw(st.lists(st.text(min_size=max(c.min_len, 1), max_size=8,
                                                      alphabet="abc:0123"),
                                              min_size=n, max_size=n))
    rb = decode_batch(encode_batch(kind, "job", cols))
    assert rb.n == n
    for name, values in cols.items():
        assert list(rb.cols[name]) == list(values)
    for i in range(min(n, 3)):
        DERIVED[kind].model_validate({k: v[i].item() if hasattr(v[i], "item") else v[i]
                                      for k, v in rb.cols.items()})


def test_derived_kinds_reject_what_their_models_reject() -> None:
    good = {"window_end": [1], "rank": [0], "comm_id": ["dp0"], "last_op_seq": [-1]}
    assert decode_batch(encode_batch("progress", "j", good)).n == 1
    with pytest.raises(BatchError, match="below the minimum -1"):
        encode_batch("progress", "j", {**good, "last_op_seq": [-2]})
    with pytest.raises(BatchError, match="not one of"):
        encode_batch("iterations", "j", {"rank": [0], "step": [0], "source": ["guess"],
                                         "t_start": [0], "t_end": [1], "step_ns": [1]})
    with pytest.raises(BatchError, match="required"):
        encode_batch("kernel_summaries", "j", {"window_start": [0], "rank": [0]})


# ---------------------------------------------------------------------------------------------
# Framed batches (binary body after the JSON header)


def test_framed_batches_decode_like_json_ones() -> None:
    cols = ops_cols(50, seed=5)
    framed = encode_batch("ops", "j", cols, framing="binary", producer="p", seq=3)
    assert framed.startswith(FRAME_MAGIC) and b"le64" not in framed
    header_end = 8 + int.from_bytes(framed[4:8], "little")
    assert header_end % 8 == 0  # the body starts aligned
    a, b = decode_batch(encode_batch("ops", "j", cols)), decode_batch(framed)
    assert (b.kind, b.job_id, b.producer, b.seq, b.n) == ("ops", "j", "p", 3, 50)
    for name in a.cols:
        assert list(a.cols[name]) == list(b.cols[name]), name
    coded = decode_batch(framed, coded=True)
    assert list(coded.column("op")) == list(a.cols["op"])
    empty = decode_batch(encode_batch("kernels", "j", {k: [] for k in ("rank", "stream", "kernel",
                                                                         "t_start", "duration")},
                                      framing="binary"))
    assert empty.n == 0 and empty.cols["kernel"].dtype == object
    with pytest.raises(ValueError, match="framing"):
        encode_batch("ops", "j", cols, framing="xml")


def framed_header(data: bytes) -> tuple[dict[str, Any], bytes]:
    size = int.from_bytes(data[4:8], "little")
    header: dict[str, Any] = orjson.loads(data[8:8 + size])
    return header, data[8 + size:]


def reframe(header: dict[str, Any], body: bytes) -> bytes:
    h = orjson.dumps(header)
    return FRAME_MAGIC + len(h).to_bytes(4, "little") + h + body


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (lambda h, b: (h, b[:-8]), "t_end", "runs past the body"),
        (lambda h, b: ({**h, "cols": {**h["cols"], "bytes": {"at": -8}}}, b), "bytes", "offset"),
        (lambda h, b: ({**h, "cols": {**h["cols"], "bytes": {"at": "0"}}}, b), "bytes", "offset"),
        (lambda h, b: ({**h, "cols": {**h["cols"], "rank": {"at": 0, "x": 1}}}, b), "rank",
         "offset"),
        (lambda h, b: ({**h, "cols": {**h["cols"], "op": {"d": ["Send"], "i": {"at": 0}}}}, b),
         "op", "not below"),
    ],
)
def test_framed_rejections(mutate, field: str, words: str) -> None:
    header, body = framed_header(encode_batch("ops", "j", ops_cols(3), framing="binary"))
    with pytest.raises(BatchError, match=words) as exc:
        decode_batch(reframe(*mutate(header, body)))
    assert exc.value.field == field


def test_framed_envelope_rejections() -> None:
    with pytest.raises(BatchError, match="shorter"):
        decode_batch(FRAME_MAGIC + b"\x01")
    with pytest.raises(BatchError, match="runs past the message"):
        decode_batch(FRAME_MAGIC + (1000).to_bytes(4, "little") + b"{}")
    with pytest.raises(BatchError, match="not valid JSON"):
        decode_batch(FRAME_MAGIC + (3).to_bytes(4, "little") + b"{no")
    # a JSON batch naming a framed column has no body to point into
    d = doc(encode_batch("ops", "j", ops_cols(3)))
    d["cols"]["bytes"] = {"at": 0}
    with pytest.raises(BatchError, match="le64") as exc:
        decode_batch(orjson.dumps(d))
    assert exc.value.field == "bytes"


def test_beat_stage_names_are_the_tracers_stages() -> None:
    from typing import get_args

    from ingest.records import Beat, StageName
    from ingest.torch.events import STAGES

    assert get_args(StageName) == ("", *STAGES)
    assert Beat(rank=0, ts=1).model_dump() | {} == {
        "rank": 0, "ts": 1, "comm_id": "", "last_op_seq": -1, "dropped": 0, "step": -1,
        "stage": "", "stage_ts": 0, "sched_run_ns": -1,
        "sched_wait_ns": -1, "exited": 0, "exit_status": -1}  # an old producer's beat stays valid
    with pytest.raises(ValueError):
        Beat.model_validate({"rank": 0, "ts": 1, "exited": 2})
    with pytest.raises(ValueError):
        Beat.model_validate({"rank": 0, "ts": 1, "exited": 1, "exit_status": 1 << 16})
    with pytest.raises(ValueError):
        Beat.model_validate({"rank": 0, "ts": 1, "stage": "backward"})
