"""streams.native (ClickHouse's Native format from numpy columns) and coded string columns:
byte layouts and the vectorized paths against a per-row reference. The same bodies stored and
read back by real ClickHouse: tests/integration/test_clickhouse.py."""

from __future__ import annotations

import numpy as np
import pytest

from ingest.batch import Coded, decode_batch, encode_batch
from streams import native
from streams.writer import raw_block, raw_columns


def plain(cols: dict[str, np.ndarray | Coded]) -> dict[str, np.ndarray]:
    """Columns read without `coded`: every one is an array."""
    assert all(isinstance(c, np.ndarray) for c in cols.values())
    return {k: c for k, c in cols.items() if isinstance(c, np.ndarray)}

def per_row_string(s: str) -> bytes:
    b = s.encode()
    return native.varint(len(b)) + b


@pytest.mark.parametrize(("n", "encoded"), [(0, b"\x00"), (1, b"\x01"), (127, b"\x7f"),
                                            (128, b"\x80\x01"), (300, b"\xac\x02"),
                                            (1 << 21, b"\x80\x80\x80\x01")])
def test_varint(n: int, encoded: bytes) -> None:
    assert native.varint(n) == encoded


def test_string_column_gathered_from_codes_equals_per_row_encoding() -> None:
    rng = np.random.default_rng(1)
    values = np.array(["", "a", "dp:pp0:tp0", "ü" * 70, "x" * 200], dtype=object)
    coded = Coded(rng.integers(0, len(values), 1000), values)
    block = native.native_block([("s", "String", coded)])
    reference = native.native_block([("s", "String", coded.strings())])
    assert block == reference
    assert block.endswith(b"".join(per_row_string(str(s)) for s in coded.strings()))


@pytest.mark.parametrize(("keys", "width", "dtype"), [(3, 0, "<u1"), (256, 0, "<u1"),
                                                      (257, 1, "<u2"), (70_000, 2, "<u4")])
def test_low_cardinality_layout_and_index_width(keys: int, width: int, dtype: str) -> None:
    values = np.array([f"k{i}" for i in range(keys)], dtype=object)
    codes = np.arange(keys)[::-1].copy()
    body = native.native_block([("c", "LowCardinality(String)", Coded(codes, values))])
    head = native.varint(1) + native.varint(keys) + per_row_string("c") + \
        per_row_string("LowCardinality(String)")
    assert body.startswith(head)
    data = body[len(head):]
    version, flags, n_keys = np.frombuffer(data[:24], "<u8")
    assert (version, flags, n_keys) == (1, width | 1 << 9, keys)
    dictionary = b"".join(per_row_string(str(v)) for v in values)
    assert data[24:24 + len(dictionary)] == dictionary
    rest = data[24 + len(dictionary):]
    assert int(np.frombuffer(rest[:8], "<u8")[0]) == keys
    np.testing.assert_array_equal(np.frombuffer(rest[8:], dtype), codes)


def test_fixed_width_and_datetime_columns_are_little_endian_values() -> None:
    ts = np.array([1, 2, 3], np.int64)
    body = native.native_block([("r", "Int32", np.array([7, 8, 9])),
                                ("t", "DateTime64(9, 'UTC')", ts),
                                ("d", "DateTime64(9, 'UTC')", ts.view("datetime64[ns]"))])
    assert np.array([7, 8, 9], "<i4").tobytes() in body
    assert body.count(ts.astype("<i8").tobytes()) == 2


def test_arrays_are_offsets_then_elements_with_the_element_prefix_first() -> None:
    col = np.empty(2, object)
    col[:] = [["h0", "h1"], ["h1"]]
    body = native.native_block([("a", "Array(LowCardinality(String))", col)])
    data = body.split(b"Array(LowCardinality(String))", 1)[1]
    lc_version, end1, end2, flags, keys = np.frombuffer(data[:40], "<u8")
    assert (lc_version, end1, end2, flags, keys) == (1, 2, 3, 1 << 9, 2)
    nested = np.empty(2, object)
    nested[:] = [[[0, 1], [2]], []]
    body = native.native_block([("m", "Array(Array(UInt32))", nested)])
    data = body.split(b"Array(Array(UInt32))", 1)[1]
    assert np.frombuffer(data[:16], "<u8").tolist() == [2, 2]  # rows' ends in arrays
    assert np.frombuffer(data[16:32], "<u8").tolist() == [2, 3]  # arrays' ends in numbers
    assert np.frombuffer(data[32:], "<u4").tolist() == [0, 1, 2]


def test_refusals() -> None:
    assert not native.supports("Nullable(Int64)") and native.supports("DateTime64(3)")
    assert native.supports("Array(Array(UInt32))") and not native.supports("Array(UUID)")
    with pytest.raises(TypeError, match="Nullable"):
        native.native_block([("a", "Nullable(Int64)", np.empty(1, object))])
    with pytest.raises(ValueError, match="unequal"):
        native.native_block([("a", "Int64", np.arange(2)), ("b", "Int64", np.arange(3))])
    with pytest.raises(TypeError, match="codes"):
        native.native_block([("a", "Int64", Coded(np.zeros(1, np.int64),
                                                   np.array(["x"], object)))])


def ops(job: str, comm: list[str]) -> bytes:
    n = len(comm)
    return encode_batch("ops", job, {
        "rank": np.arange(n), "comm_id": comm, "op_seq": np.arange(n), "op": ["Send"] * n,
        "bytes": np.ones(n), "t_enqueue": np.ones(n), "t_start": np.ones(n)})


def test_coded_decoding_matches_object_decoding() -> None:
    data = ops("j", ["b", "a", "b", "c"])
    objects, coded = decode_batch(data), decode_batch(data, coded=True)
    assert set(coded.strings) == {"comm_id", "op"} and "comm_id" not in coded.cols
    for name in ("comm_id", "op"):
        assert list(coded.column(name)) == list(objects.cols[name])
    assert coded.n == objects.n == 4
    # a plain (not dictionary-encoded) string column, as simple producers write, is factorized
    doc = b'{"v":1,"kind":"beats","job_id":"j","n":3,"cols":{"rank":[0,1,2],' \
          b'"ts":[1,2,3],"comm_id":["x","","x"]}}'
    b = decode_batch(doc, coded=True)
    assert list(b.strings["comm_id"].values) == ["x", ""]
    assert list(b.strings["comm_id"].codes) == [0, 1, 0]


def test_merge_and_raw_block_keep_codes_and_match_raw_columns() -> None:
    batches = [decode_batch(ops("j1", ["x", "y", "x"]), coded=True),
               decode_batch(ops("j2", ["y", "z"]), coded=True),
               decode_batch(ops("j1", ["z"]))]  # object columns mix in too
    block = raw_block("ops", batches, 5, [(0, 1), (1, 4), (1, 5)])
    job = block["job_id"]
    assert isinstance(job, Coded) and list(job.values) == ["j1", "j2"]
    assert list(job.codes) == [0, 0, 0, 1, 1, 0]
    comm = block["comm_id"]
    assert isinstance(comm, Coded) and sorted(comm.values) == ["x", "y", "z"]
    plain = raw_columns("ops", batches, 5, [(0, 1), (1, 4), (1, 5)])
    assert list(plain["comm_id"]) == ["x", "y", "x", "y", "z", "z"]
    assert list(plain["src_offset"]) == [1, 1, 1, 4, 4, 5]
    merged = Coded.concat([Coded(np.array([0, 0]), np.array(["a", "a"], object))])
    assert list(merged.values) == ["a"] and list(merged.strings()) == ["a", "a"]


def test_read_columns_reads_what_native_block_writes_over_several_blocks() -> None:
    values = np.array(["dp0", "tp1", "ö"], dtype=object)
    first = native.native_block([
        ("rank", "Int32", np.array([1, 2, 3])),
        ("comm", "LowCardinality(String)", Coded(np.array([2, 0, 2]), values)),
        ("s", "String", np.array(["a", "", "bc"], dtype=object)),
        ("t", "DateTime64(9, 'UTC')", np.array([5, 6, 7]))])
    second = native.native_block([
        ("rank", "Int32", np.array([4])),
        ("comm", "LowCardinality(String)", np.array(["tp1"], dtype=object)),
        ("s", "String", np.array(["z"], dtype=object)),
        ("t", "DateTime64(9, 'UTC')", np.array([8]))])
    read, types = native.read_columns(first + second)
    cols = plain(read)
    assert types["comm"] == "LowCardinality(String)"
    assert cols["rank"].dtype == np.int32 and cols["rank"].tolist() == [1, 2, 3, 4]
    assert cols["comm"].tolist() == ["ö", "dp0", "ö", "tp1"]
    assert cols["s"].tolist() == ["a", "", "bc", "z"]
    assert cols["t"].dtype == np.dtype("datetime64[ns]")
    assert cols["t"].view(np.int64).tolist() == [5, 6, 7, 8]
    cols["rank"][0] = 9  # writable, like clickhouse-connect's arrays
    assert native.read_columns(b"") == ({}, {})


def test_read_columns_can_keep_low_cardinality_coded() -> None:
    blocks = b"".join(native.native_block([
        ("comm", "LowCardinality(String)", Coded(np.array(codes), np.array(values, object))),
        ("rank", "Int32", np.arange(len(codes)))])
        for codes, values in (([1, 0, 1], ["dp0", "tp1"]), ([0, 0], ["pp2"])))
    cols, _ = native.read_columns(blocks, coded=True)
    comm = cols["comm"]
    assert isinstance(comm, Coded) and sorted(comm.values) == ["dp0", "pp2", "tp1"]
    assert comm.codes.dtype == np.int64
    assert comm.strings().tolist() == ["tp1", "dp0", "tp1", "pp2", "pp2"]
    assert plain(native.read_columns(blocks)[0])["comm"].tolist() == comm.strings().tolist()


def test_read_columns_refuses_what_it_does_not_read() -> None:
    head = native.varint(1) + native.varint(1) + per_row_string("x")
    with pytest.raises(native.Unsupported):
        native.read_columns(head + per_row_string("Nullable(Int64)") + b"\x00" * 9)
    with pytest.raises(ValueError, match="ends at byte"):
        native.read_columns(head + per_row_string("Int64") + b"\x00" * 3)
