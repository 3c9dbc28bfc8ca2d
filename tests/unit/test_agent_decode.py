"""Native ring records to record columns: op start/end join, in-flight publication, names."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ingest import ring
from ingest.agent.decode import (
    Names,
    OpJoin,
    _mixed,
    kernel_columns,
    op_columns,
    op_table,
    stage_columns,
)
from ingest.batch import decode_batch, encode_batch
from ingest.torch.sink import fnv1a64
from ingest.units import SECOND as S

try:
    DT = ring.record_dtypes()
except ring.RingLibraryMissing as e:  # pragma: no cover - `make build` builds it
    pytest.skip(str(e), allow_module_level=True)

WORLD = fnv1a64("world")


def ops(*rows: dict[str, Any]) -> np.ndarray:
    out = np.zeros(len(rows), DT["op"])
    out["kind"] = ring.KINDS["op"]
    out["peer"] = -1
    out["step"] = -1
    for i, r in enumerate(rows):
        for k, v in r.items():
            out[k][i] = v
    return out


def start(seq: int, t: int, func: int = 1, comm: int = WORLD, peer: int = -1) -> dict[str, Any]:
    return {"comm_hash": comm, "op_seq": seq, "t_enqueue": t, "t_start": t, "func": func,
            "bytes": 64, "peer": peer, "step": 3}


def end(seq: int, t: int, comm: int = WORLD, **more: Any) -> dict[str, Any]:
    return {"comm_hash": comm, "op_seq": seq, "t_end": t, "flags": ring.F_END, **more}


def names(**known: str) -> Names:
    n = Names()
    n.known = {fnv1a64(v): v for v in known.values()}
    return n


def test_join_completes_across_drains_and_shows_late_ops_once() -> None:
    j = OpJoin(inflight_ns=2 * S)
    send = fnv1a64("pp")
    assert len(j.feed(ops(start(0, 10 * S), start(0, 10 * S, 7, send, 5)), 10 * S)) == 0
    out = j.feed(ops(end(0, 11 * S)), 11 * S)
    assert out[:, 5].tolist() == [11 * S] and out[:, 1].tolist() == [0]
    assert out[:, 8].tolist() == [-1] and out[:, 7].tolist() == [3]  # peer and step of start
    late = j.feed(ops(), 13 * S)  # the Send is 3 s old: shown in flight once, kept open
    assert late[:, 5].tolist() == [0] and late[:, 9].tolist() == [7]
    assert len(j.feed(ops(), 14 * S)) == 0
    done = j.feed(ops(end(0, 15 * S, send)), 15 * S)
    assert done[:, 5].tolist() == [15 * S] and done[:, 8].tolist() == [5] and not len(j.open)


def test_end_fields_win_when_set() -> None:
    """The NCCL plugin knows t_start only at the end; the end record's value is kept."""
    j = OpJoin()
    j.feed(ops({**start(4, S), "t_start": 0}), S)
    out = j.feed(ops(end(4, 3 * S, t_start=2 * S, func=1)), 3 * S)
    assert out[:, 4].tolist() == [2 * S] and out[:, 3].tolist() == [S]


def test_ops_sharing_a_join_key_are_told_apart() -> None:
    """The join sorts one mixed key per (comm_hash, op_seq); two different ops can share one
    (a hostile or unlucky hash). The end of one must not complete the other."""
    mix, wrap = 0x9E3779B97F4A7C15, 2**64
    a, b = 0x1234_5678_9ABC, 0x0FED_CBA9_8765
    u = ((a * mix) ^ (b * mix)) % wrap  # (b, u) mixes to the key of (a, 0)
    seq_b = u - wrap if u >= 2**63 else u  # as the int64 the record holds
    keys = _mixed(op_table(ops(start(0, S, comm=a), start(seq_b, S, comm=b))))
    assert keys[0] == keys[1]
    j = OpJoin(inflight_ns=2 * S)
    j.feed(ops(start(0, S, comm=a), start(seq_b, S, comm=b)), S)
    out = j.feed(ops(end(seq_b, 2 * S, comm=b)), 2 * S)  # only b's op ended
    assert out[:, 0].view(np.uint64).tolist() == [b] and out[:, 1].tolist() == [seq_b]
    assert out[:, 4].tolist() == [S]  # joined with its own start
    assert j.open[:, 0].view(np.uint64).tolist() == [a]  # a's op is still open
    out = j.feed(ops(end(0, 3 * S, comm=a)), 3 * S)
    assert out[:, 0].view(np.uint64).tolist() == [a] and not len(j.open)


def test_close_publishes_open_ops_in_flight() -> None:
    j = OpJoin()
    j.feed(ops(start(4, S)), S)
    assert j.close()[:, 5].tolist() == [0] and len(j.close()) == 0


def test_columns_encode_to_valid_batches() -> None:
    j = OpJoin()
    rows = j.feed(ops(start(0, S), start(0, S, 8, fnv1a64("pg1"), 1), end(0, 2 * S),
                      end(0, 3 * S, fnv1a64("pg1"))), 3 * S)
    cols = op_columns(rows, 3, names(a="world", b="pg1"))
    batch = decode_batch(encode_batch("ops", "j", cols))
    assert sorted(batch.cols["op"].tolist()) == ["AllReduce", "Recv"]
    assert set(batch.cols["comm_id"].tolist()) == {"world", "pg1"}
    st = np.zeros(1, DT["stage"])
    st["step"], st["t_start"], st["step_other"], st["device_ns"] = 5, S, 6, -1
    b = decode_batch(encode_batch("stages", "j", stage_columns(st, 3)))
    assert b.cols["step"].tolist() == [5] and b.cols["device_ns"].tolist() == [-1]
    k = np.zeros(2, DT["kernel"])
    k["name_hash"] = [fnv1a64("sgemm"), 12345]
    kc = kernel_columns(k, 0, names(a="sgemm"))
    assert kc["kernel"].tolist() == ["sgemm", "0x3039"]  # unknown hash shown as hex


def test_an_nccl_start_is_not_in_flight_before_its_time() -> None:
    """The plugin's start records carry t_enqueue and t_start 0 (the kernel has not started):
    an op 40 ms old whose end is in the next drain must not be published in flight (seen on a
    real NCCL 2.28 job: every op went out once in flight, then again complete)."""
    j = OpJoin(inflight_ns=2 * S)
    assert len(j.feed(ops({**start(7, 100 * S), "t_start": 0}), 100 * S + 40_000_000)) == 0
    done = j.feed(ops(end(7, 100 * S + 60_000_000, t_start=100 * S + 1)), 100 * S + 70_000_000)
    assert done[:, 5].tolist() == [100 * S + 60_000_000]
    j.feed(ops({**start(8, 200 * S), "t_start": 0}), 200 * S)
    assert len(j.feed(ops(), 201 * S)) == 0
    shown = j.feed(ops(), 203 * S)
    assert shown[:, 1].tolist() == [8]  # past 2 s: shown in flight once
    # at its enqueue time: a row at t_start 0 (1970) would be in no reader's time window
    assert shown[:, 4].tolist() == [200 * S] and shown[:, 5].tolist() == [0]
    j.feed(ops({**start(9, 300 * S), "t_start": 0}), 300 * S)
    assert j.close()[:, 4].tolist() == [300 * S]  # the producer ended with it open


def test_named_op_columns_match_the_record_fields() -> None:
    """Each named position of an op_table row holds the ring record field of that name."""
    from ingest.agent import decode

    rec = ops({**start(7, 11 * S, func=2, comm=WORLD + 1), "t_end": 13 * S, "stream": 5})
    row = decode.op_table(rec)[0]
    for name, pos in (("comm_hash", decode.COMM_HASH), ("op_seq", decode.OP_SEQ),
                      ("t_enqueue", decode.T_ENQUEUE), ("t_start", decode.T_START),
                      ("t_end", decode.T_END), ("func", decode.FUNC)):
        assert decode.OP_KEEP[pos] == name
        assert row[pos] == decode._i64(np.asarray(rec[name]))[0], name
    assert decode.OP_KEEP[decode.JOIN_KEY[0]] == "comm_hash"
    assert decode.OP_KEEP[decode.JOIN_KEY[1]] == "op_seq"
