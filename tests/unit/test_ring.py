"""The Python ring binding (ingest/ring.py) against the real C library: round trips per kind,
drops when full, a concurrent writer process with exact counts, a producer killed mid-write, and
the stale-ring check."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ingest import ring

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def built_library() -> None:
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no make or C compiler: the native ring cannot be built")
    subprocess.run(
        ["make", "-s", "-C", str(ROOT / "native"), "build/librankwatch_ring.so"], check=True
    )


@pytest.fixture
def name(request: pytest.FixtureRequest) -> object:
    n = f"/rwpytest.{os.getpid()}.{request.node.name[:40]}"
    yield n
    with contextlib.suppress(FileNotFoundError):
        os.unlink("/dev/shm" + n)


def test_dtypes_cover_the_contract_fields() -> None:
    dt = ring.record_dtypes()
    assert all(dt[k].itemsize == ring.RECORD_SIZE for k in dt)
    for kind, fields in {
        "op": ("comm_hash", "op_seq", "bytes", "peer", "stream", "t_enqueue", "t_start", "t_end"),
        "flow": ("comm_hash", "op_seq", "channel", "peer", "bytes", "t_start", "t_end"),
        "chunk": ("comm_hash", "op_seq", "channel", "total_chunks", "gpu_ready", "rdma_done"),
        "stage": ("step", "t_start", "data_next_wait", "optim_step", "step_other", "device_ns"),
        "kernel": ("name_hash", "stream", "t_start", "duration", "device"),
        "wr": ("nic_hash", "inflight", "bytes_done"),
        "beat": ("comm_hash", "last_op_seq", "dropped"),
    }.items():
        assert set(fields) <= set(dt[kind].names or ()), kind
    assert dt["op"].fields is not None and dt["op"].fields["t_end"][1] == 80


def test_round_trip_by_kind(name: str) -> None:
    with ring.RingWriter(name, capacity=64, rank=5, job_id="job-a") as w:
        ops = w.records("op", 3)
        ops["comm_hash"] = 0xABCDEF
        ops["op_seq"] = [0, 1, 2]
        ops["func"] = ring.FUNCS.index("AllReduce")
        ops["t_enqueue"] = [10, 20, 30]
        ops["peer"] = -1
        stages = w.records("stage", 2)
        stages["step"] = [7, 8]
        stages["device_ns"] = -1
        assert w.write(ops) == 3
        assert w.write(stages) == 2
        with ring.RingReader(name) as r:
            raw = r.drain()
            st = r.stat()
    assert len(raw) == 5 and st.cons_pos == 5 and st.drops == 0
    assert st.rank == 5 and st.job_id == "job-a" and st.source == "py" and st.producer == "alive"
    by = ring.split_kinds(raw)
    assert by["op"]["op_seq"].tolist() == [0, 1, 2]
    assert by["op"]["t_enqueue"].tolist() == [10, 20, 30]
    assert (by["op"]["peer"] == -1).all() and (by["op"]["comm_hash"] == 0xABCDEF).all()
    assert by["stage"]["step"].tolist() == [7, 8]
    assert len(by["kernel"]) == 0


def test_full_ring_drops_and_wraps(name: str) -> None:
    with ring.RingWriter(name, capacity=8) as w, ring.RingReader(name) as r:
        recs = w.records("beat", 20)
        recs["last_op_seq"] = np.arange(20)
        assert w.write(recs) == 8
        assert r.stat().drops == 12
        got = r.records(r.drain(), "beat")
        assert got["last_op_seq"].tolist() == list(range(8))
        seen: list[int] = []
        for start in range(0, 100, 5):  # many laps of an 8-slot ring
            assert w.write(recs[start % 20 : start % 20 + 5]) == 5
            seen += r.records(r.drain(), "beat")["last_op_seq"].tolist()
        assert len(seen) == 100 and r.stat().drops == 12


def test_names_split_and_joined(name: str) -> None:
    text = "void at::native::elementwise_kernel<128, 4>(int, Func)" * 3  # > 88 bytes: 2 parts
    raw = text.encode()
    with ring.RingWriter(name, capacity=16) as w:
        parts = [raw[i : i + 88] for i in range(0, len(raw), 88)]
        recs = w.records("name", len(parts))
        recs["hash"] = 42
        recs["nparts"] = len(parts)
        recs["part"] = np.arange(len(parts))
        recs["len"] = [len(p) for p in parts]
        recs["text"] = parts
        w.write(recs[::-1].copy())  # order of parts does not matter
        with ring.RingReader(name) as r:
            names = ring.decode_names(r.records(r.drain(), "name"))
    assert names == {42: text}


WRITER = textwrap.dedent(
    """
    import sys
    from ingest import ring
    name, total, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    w = ring.RingWriter(name, capacity=1024, rank=1)
    print("ready", flush=True)
    sys.stdin.readline()
    sent = dropped = 0
    while sent < total:
        k = min(batch, total - sent)
        recs = w.records("beat", k)
        recs["last_op_seq"] = range(sent, sent + k)
        n = w.write(recs)
        sent += n  # retry what did not fit, so every record crosses the ring
        dropped += k - n
    print(dropped, flush=True)
    """
)


def test_concurrent_writer_process_exact_counts(name: str) -> None:
    total, batch = 200_000, 100
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, name, str(total), str(batch)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    with ring.RingReader(name, batch=512) as r:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        seen: list[np.ndarray] = []
        while proc.poll() is None or r.stat().pending:
            seen.append(r.records(r.drain(), "beat")["last_op_seq"])
        seen.append(r.records(r.drain(), "beat")["last_op_seq"])
        dropped = int(proc.stdout.read().split()[-1])
        st = r.stat()
    got = np.concatenate(seen)
    assert proc.returncode == 0
    assert len(got) == total
    # Each write drops what does not fit and the writer sends the next batch from where it
    # stopped, so records arrive in order with no gaps and no repeats.
    assert (got == np.arange(total)).all()
    assert st.drops == dropped
    assert st.producer == "dead"


KILLED = textwrap.dedent(
    """
    import ctypes, os, signal, sys
    from ingest import ring
    w = ring.RingWriter(sys.argv[1], capacity=32, rank=2)
    recs = w.records("beat", 4)
    recs["last_op_seq"] = range(4)
    w.write(recs)
    lib = ring.load_library()
    lib.rw_ring__reserve.restype = ctypes.c_void_p
    lib.rw_ring__reserve.argtypes = [ctypes.c_void_p]
    slot = lib.rw_ring__reserve(w._handle)
    ctypes.memset(slot + 8, 0xAB, 60)  # half a record, never committed
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_producer_killed_mid_write(name: str) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLED, name], cwd=ROOT, check=False)
    assert proc.returncode == -signal.SIGKILL
    with ring.RingReader(name) as r:
        st = r.stat()
        assert st.producer == "dead" and st.prod_pos == 5
        first = r.records(r.drain(), "beat")
        assert first["last_op_seq"].tolist() == [0, 1, 2, 3]
        assert len(r.drain()) == 0  # the torn slot holds the consumer...
        assert len(r.drain(skip_torn=True)) == 0  # ...until it is skipped, never returned
        st = r.stat()
    assert st.torn == 1 and st.cons_pos == 5
    # A new producer may take over the stale name.
    with ring.RingWriter(name, capacity=32) as w:
        assert w.stat().producer == "alive"


def test_errors_name_the_problem(name: str) -> None:
    with pytest.raises(OSError, match="capacity 6"):
        ring.RingWriter(name, capacity=6)
    with pytest.raises(FileNotFoundError):
        ring.RingReader(name)
    with ring.RingWriter(name, capacity=8) as w:
        other = subprocess.run(
            [sys.executable, "-c", f"from ingest import ring; ring.RingWriter({name!r})"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert "Device or resource busy" in other.stderr  # another live producer owns it
        with pytest.raises(ValueError, match="128-byte"):
            w.write(np.zeros(4, dtype=np.int64))
    assert ring.ring_name("job-1", 3, "py") == "/rankwatch.job-1.3.py"
    with pytest.raises(OSError):
        ring.ring_name("bad/job", 3, "py")
    assert ctypes.sizeof(ring._Stat) == 160


def test_packer_writes_records_one_by_one(name: str) -> None:
    with ring.RingWriter(name, capacity=8) as w, ring.RingReader(name) as r:
        with pytest.raises(ValueError, match="layout order"):
            w.packer("op", ["op_seq", "comm_hash"])
        with pytest.raises(ValueError, match="cannot be packed"):
            w.packer("name", ["text"])
        p = w.packer("op", ["ts", "comm_hash", "op_seq", "t_enqueue", "peer"], batch=4)
        for i in range(10):
            p.add(100 + i, 0xC0FFEE, i, 1000 + i, -1)
        assert p.written == 8 and p.dropped == 0  # two batches of 4 went in
        assert p.flush() == 0 and p.dropped == 2  # the ring (8 slots) was full
        ops = r.records(r.drain(), "op")
        assert r.stat().drops == 2
    assert ops["op_seq"].tolist() == list(range(8))
    assert ops["ts"].tolist() == [100 + i for i in range(8)]
    assert (ops["peer"] == -1).all() and (ops["comm_hash"] == 0xC0FFEE).all()
    assert (ops["kind"] == ring.KINDS["op"]).all() and (ops["src"] == ring.SOURCES["py"]).all()


def test_every_func_of_the_c_enum_is_an_op_name_of_the_contract() -> None:
    from typing import get_args

    from ingest.records import OpName
    from ingest.ring import FUNCS

    assert FUNCS[0] == "" and set(FUNCS[1:]) <= set(get_args(OpName))


def test_position_words_round_trip(name: str) -> None:
    """The producer's position words: plain stores into the header, read back by another
    mapping through rw_ring__stat as (step, stage, realtime ns); a new ring starts unknown."""
    with ring.RingWriter(name, capacity=64, rank=1, job_id="job-p") as w, \
            ring.RingReader(name) as r:
        assert r.stat().position == (-1, 0, 0)
        pos = w.position()
        off = 1_700_000_000_000_000_000
        pos[ring.POS_OFFSET] = off
        pos[ring.POS_STEP] = 42
        pos[ring.POS_LEFT] = 1000  # the step began
        assert r.stat().position == (42, 0, off + 1000)
        pos[ring.POS_ENTER + 0] = 1100  # stage 1 entered
        assert r.stat().position == (42, 1, off + 1100)
        pos[ring.POS_LEFT] = 1200
        pos[ring.POS_ENTER + 2] = 1300  # stage 3 entered; stage 1's entry is older
        assert r.stat().position == (42, 3, off + 1300)
        pos[ring.POS_LEFT] = 1400
        assert r.stat().position == (42, 0, off + 1400)
        pos[ring.POS_STEP] = -7  # damaged: read as unknown, never below -1
        assert r.stat().position[0] == -1
        del pos


POSITION_WRITER = textwrap.dedent(
    """
    import sys
    from ingest import ring
    w = ring.RingWriter(sys.argv[1], capacity=64, rank=0)
    pos = w.position()
    print("ready", flush=True)
    sys.stdin.readline()
    pos[ring.POS_OFFSET] = 7
    for k in range(1, int(sys.argv[2]) + 1):  # the stores stages.py makes, times encode k
        pos[ring.POS_STEP] = k
        pos[ring.POS_LEFT] = k * 1000
        for i in range(ring.POS_STAGES):
            pos[ring.POS_ENTER + i] = k * 1000 + 100 * (i + 1)
            pos[ring.POS_LEFT] = k * 1000 + 100 * (i + 1) + 50
    del pos
    w.close()
    """
)


def test_position_read_while_written_is_a_state_the_producer_was_in(name: str) -> None:
    """A producer process runs through steps as fast as Python stores; every stat taken
    meanwhile must be a state it was in: the time belongs to the step read, and the stage is
    the one whose entry time it is — or, between a step's two start stores, the new step with
    the time the previous step's last stage was left (true: it is between stages since)."""
    proc = subprocess.Popen([sys.executable, "-c", POSITION_WRITER, name, "20000"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    reads, seen = 0, set()
    with ring.RingReader(name) as r:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while proc.poll() is None:
            step, stage, ts = r.stat().position
            if step < 1:
                continue
            t = ts - 7
            k, rest = divmod(t, 1000)
            if k == step - 1 and stage == 0 and rest == 100 * ring.POS_STAGES + 50:
                continue  # between a step's `step` and `left` stores: a true state, not checked
            assert k == step, (step, stage, ts)
            if stage:
                assert rest == 100 * stage, (step, stage, ts)
            else:
                assert rest == 0 or rest % 100 == 50, (step, stage, ts)
            reads += 1
            seen.add((step, stage, ts))
    assert proc.wait() == 0
    # How often a read lands between the two start stores depends on the scheduler (a preempted
    # producer is read there many times over), so only strictly checked reads are counted: many
    # of them, of more than one state, so the check above ran on a moving producer.
    assert reads > 100 and len(seen) > 1, (reads, len(seen))
