"""Capture files (`rankwatch agent --capture`): frames round-trip, damage is reported, the size
bound refuses instead of blocking, and the agent writes a capture from a real ring."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ingest import ring
from ingest.agent.agent import Agent, AgentConfig
from ingest.agent.capture import MAGIC, CaptureError, CaptureWriter, Tee, read_capture
from ingest.batch import decode_batch, encode_batch


def test_frames_round_trip_in_order(tmp_path: Path) -> None:
    w = CaptureWriter(tmp_path / "c")
    delivered = []
    for i in range(3):
        data = encode_batch("beats", "j", {"rank": [i], "comm_id": ["dp"], "ts": [i + 1],
                                           "last_op_seq": [i]}, producer="t", seq=i)
        assert w.publish("beats", data, key=f"j:t:{i}",
                         on_delivery=lambda e, m: delivered.append(e))
    w.close()
    frames = list(read_capture(tmp_path / "c"))
    assert [f.key for f in frames] == [b"j:t:0", b"j:t:1", b"j:t:2"]
    assert [decode_batch(f.data).cols["rank"].tolist() for f in frames] == [[0], [1], [2]]
    assert delivered == [None, None, None] and w.stats.batches == 3


def test_a_truncated_last_frame_is_reported_and_the_rest_kept(tmp_path: Path) -> None:
    w = CaptureWriter(tmp_path / "c")
    w.publish("ops", b"x" * 100, key="a")
    w.publish("ops", b"y" * 100, key="b")
    w.close()
    raw = (tmp_path / "c").read_bytes()
    (tmp_path / "c").write_bytes(raw[:-30])
    cut: list[int] = []
    frames = list(read_capture(tmp_path / "c", cut.append))
    assert [f.data for f in frames] == [b"x" * 100] and cut == [len(MAGIC) + 12 + 3 + 1 + 100]


def test_not_a_capture_says_so(tmp_path: Path) -> None:
    (tmp_path / "c").write_bytes(b"PK\x03\x04 something else")
    with pytest.raises(CaptureError, match="not a rankwatch capture"):
        list(read_capture(tmp_path / "c"))


def test_the_size_bound_refuses_and_counts(tmp_path: Path) -> None:
    w = CaptureWriter(tmp_path / "c", max_bytes=len(MAGIC) + 150)
    assert w.publish("ops", b"a" * 100, key="k")
    assert not w.publish("ops", b"b" * 100, key="k")
    w.close()
    assert w.stats.refused == 1 and len(list(read_capture(tmp_path / "c"))) == 1


def test_the_agent_captures_a_ring(tmp_path: Path) -> None:
    prefix = f"/rwcap{np.random.randint(1 << 30)}"
    name = ring.ring_name("cap-job", 3, "py", prefix=prefix)
    try:
        w = ring.RingWriter(name, capacity=1024, rank=3, job_id="cap-job", source="py")
    except ring.RingLibraryMissing as e:  # pragma: no cover - `make build` builds it
        pytest.skip(str(e))
    try:
        st = w.records("stage", 2)
        st["step"] = [0, 1]
        st["t_start"] = [10**18, 10**18 + 10**9]
        st["device_ns"] = -1
        assert w.write(st) == 2
        cap = CaptureWriter(tmp_path / "c")
        agent = Agent(AgentConfig(sidecar_dir=tmp_path, job="cap-job", prefix=prefix,
                                  remove_dead=False), cap)
        ticks = iter(range(3))
        agent.run(lambda: next(ticks, None) is None)
        cap.close()
        frames = [f for f in read_capture(tmp_path / "c") if f.kind == "stages"]
        assert frames and decode_batch(frames[0].data).cols["step"].tolist() == [0, 1]
        assert frames[0].key == b"cap-job"  # keyed by job: its home partition (streams.ownership)
    finally:
        w.unlink()
        w.close()


class _Broker:
    """A publisher that refuses every other batch (a full queue), as the real one can."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.calls = 0

    def publish(self, kind: str, data: bytes, key: bytes | str | None = None,
                topic: str | None = None, on_delivery: object = None) -> bool:
        self.calls += 1
        if self.calls % 2 == 0:
            return False
        self.sent.append(data)
        return True

    def flush(self, timeout: float = 30.0) -> int:
        return 0


def test_tee_writes_what_the_broker_took_once(tmp_path: Path) -> None:
    """`--tee`: the capture holds exactly the batches the broker accepted; a refused batch
    (retried by the outbox) is not written twice."""
    broker = _Broker()
    tee = Tee(broker, CaptureWriter(tmp_path / "t"))
    data = [encode_batch("beats", "j", {"rank": [i], "comm_id": ["dp"], "ts": [i + 1],
                                        "last_op_seq": [i]}, producer="t", seq=i)
            for i in range(3)]
    took = [tee.publish("beats", d, key="j") for d in (data[0], data[1], data[1], data[2])]
    assert took == [True, False, True, False]
    assert tee.flush() == 0
    tee.close()
    frames = [f.data for f in read_capture(tmp_path / "t")]
    assert frames == broker.sent == [data[0], data[1]]
