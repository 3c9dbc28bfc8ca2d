"""Ring slots to record columns: op start/end join, in-flight publication, stages."""

from __future__ import annotations

import numpy as np

from ingest.agent.decode import OpJoin, op_columns, stage_columns
from ingest.batch import decode_batch, encode_batch
from ingest.torch.events import OP_CODE, OP_END, OP_START, SLOT_WORDS, STAGE

S = 1_000_000_000


def slots(*rows: tuple[int, ...]) -> np.ndarray:
    out = np.zeros((len(rows), SLOT_WORDS), np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def start(comm: int, seq: int, t: int, op: str = "AllReduce", peer: int = -1) -> tuple[int, ...]:
    return (OP_START, 3, comm, seq, OP_CODE[op], 1024, peer, t, t, 7)


def test_join_completes_across_reads_and_shows_late_ops_once() -> None:
    j = OpJoin(rank=3, inflight_ns=2 * S)
    out = j.feed(slots(start(0, 0, 10 * S), start(1, 0, 10 * S, "Send", 5)), now_ns=10 * S)
    assert len(out) == 0 and j.last_seq == {0: 0, 1: 0}
    out = j.feed(slots((OP_END, 3, 0, 0, 11 * S)), now_ns=11 * S)
    assert out[:, 8].tolist() == [11 * S] and out[:, 1].tolist() == [0]
    late = j.feed(slots(), now_ns=13 * S)  # the Send is 3 s old: shown in flight, kept open
    assert late[:, 8].tolist() == [0] and late[:, 0].tolist() == [1]
    assert len(j.feed(slots(), now_ns=14 * S)) == 0  # shown once
    done = j.feed(slots((OP_END, 3, 1, 0, 15 * S)), now_ns=15 * S)
    assert done[:, 8].tolist() == [15 * S] and len(j.open) == 0


def test_close_publishes_open_ops_in_flight() -> None:
    j = OpJoin(rank=0)
    j.feed(slots(start(0, 4, S)), now_ns=S)
    rows = j.close()
    assert rows[:, 1].tolist() == [4] and rows[:, 8].tolist() == [0]
    assert len(j.close()) == 0


def test_columns_encode_to_valid_batches() -> None:
    j = OpJoin(rank=3)
    rows = j.feed(slots(start(0, 0, S), start(1, 0, S, "Recv", 1), (OP_END, 3, 0, 0, 2 * S),
                        (OP_END, 3, 1, 0, 3 * S)), now_ns=3 * S)
    cols = op_columns(rows, 3, np.array(["world", "pg1"], object))
    batch = decode_batch(encode_batch("ops", "j", cols))
    assert sorted(batch.cols["op"].tolist()) == ["AllReduce", "Recv"]
    assert set(batch.cols["comm_id"].tolist()) == {"world", "pg1"}
    st = stage_columns(slots((STAGE, 3, 5, S, 1, 2, 3, 4, 5, 6, -1)), 3)
    b = decode_batch(encode_batch("stages", "j", st))
    assert b.cols["step"].tolist() == [5] and b.cols["step_other"].tolist() == [6]
    assert b.cols["device_ns"].tolist() == [-1]
