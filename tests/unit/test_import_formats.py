"""Importers against files written here in the shapes of real Kineto traces, Flight Recorder
dumps and NCCL API logs; malformed files name file and line and publish nothing."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from ingest.batch import decode_batch
from ingest.importers.common import TraceError, encode_all
from rankwatch.commands.import_ import collect

BASE = 1_740_000_000_000_000_000


def kineto_trace(rank: int) -> dict[str, object]:
    ev = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
         "ts": 9.5, "dur": 3.0, "args": {"correlation": 101}},
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "pid": 0, "tid": 7,
         "ts": 10.0, "dur": 250.5, "args": {"device": 0, "stream": 7, "correlation": 100}},
        {"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce_RING_LL_Sum_float",
         "pid": 0, "tid": 20, "ts": 300.0, "dur": 1200.0,
         "args": {"device": 0, "stream": 20, "correlation": 101}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0,
         "tid": 20, "ts": 2000.0, "dur": 800.0,
         "args": {"device": 0, "stream": 20, "correlation": 102, "Collective name":
                  "_allgather_base", "Process Group Name": "3", "Seq": 41,
                  "In msg nelems": 1024, "dtype": "BFloat16"}},
        {"ph": "i", "cat": "cpu_instant_event", "name": "marker", "ts": 1.0},
    ]
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank,
            "world_size": 2}, "baseTimeNanoseconds": BASE, "traceEvents": ev}


def test_kineto_kernels_and_both_nccl_name_styles(tmp_path: Path) -> None:
    p = tmp_path / "trace.json"
    p.write_text(json.dumps(kineto_trace(1), indent=1))
    c = collect("kineto", [p])
    assert c.counts() == {"kernels": 3, "ops": 2}
    ops = c.cols["ops"]
    assert ops["op"] == ["AllReduce", "AllGather"]
    assert ops["comm_id"] == ["nccl", "3"] and ops["op_seq"] == [0, 41]
    assert ops["bytes"][1] == 2048 and ops["t_enqueue"][0] == BASE + 9500
    assert ops["t_end"][0] == BASE + 1_500_000 and set(ops["rank"]) == {1}
    batches = encode_all(c, "j", "test")
    assert sum(decode_batch(d).n for _, d in batches) == 5


def test_kineto_truncated_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "rank0.json"
    text = json.dumps(kineto_trace(0), indent=1)
    p.write_text(text[: len(text) // 2])
    with pytest.raises(TraceError) as e:
        collect("kineto", [p])
    assert str(p) in str(e.value) and e.value.line > 1


def test_kineto_bad_event_names_its_line(tmp_path: Path) -> None:
    trace = kineto_trace(0)
    events = trace["traceEvents"]
    assert isinstance(events, list)
    events[2]["dur"] = "soon"  # the old-style NCCL kernel
    p = tmp_path / "rank0.json"
    text = json.dumps(trace, indent=1)
    p.write_text(text)
    with pytest.raises(TraceError) as e:
        collect("kineto", [p])
    line = text.splitlines()[e.value.line - 1]
    assert e.value.line > 1 and line.strip() == "{", (e.value, line)
    assert '"ncclKernel_AllReduce' in "".join(text.splitlines()[e.value.line: e.value.line + 8])
    assert "traceEvents[2]" in str(e.value) and str(p) in str(e.value)


def fr_dump(rank: int, hung: bool) -> dict[str, object]:
    def entry(i: int, name: str, state: str) -> dict[str, object]:
        t = BASE + i * 1_000_000
        return {"record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"),
                "collective_seq_id": i, "p2p_seq_id": 0, "op_id": i,
                "profiling_name": name, "time_created_ns": t,
                "time_discovered_started_ns": t + 10 if state != "scheduled" else None,
                "time_discovered_completed_ns": t + 500 if state == "completed" else None,
                "input_sizes": [[256, 4]], "input_dtypes": ["Float"], "output_sizes": [[256, 4]],
                "state": state, "retired": state == "completed", "is_p2p": False,
                "timeout_ms": 600000, "duration_ms": 0.5, "frames": []}
    last = "started" if hung else "completed"
    return {"version": "2.4", "rank": rank, "host_name": "node1", "pg_config": {
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "pg_status": {}, "entries": [entry(0, "nccl:all_reduce", "completed"),
                                         entry(1, "nccl:broadcast", "completed"),
                                         entry(2, "nccl:all_reduce", last),
                                         entry(3, "nccl:all_gather", "scheduled")]}


def test_flight_recorder_states(tmp_path: Path) -> None:
    p = tmp_path / "nccl_trace_rank_1"
    p.write_bytes(pickle.dumps(fr_dump(1, hung=True)))
    ops = collect("flight-recorder", [p]).cols["ops"]
    assert ops["op"] == ["AllReduce", "Broadcast", "AllReduce", "AllGather"]
    assert ops["t_end"][:2] == [BASE + 500, BASE + 1_000_500]
    assert ops["t_end"][2:] == [0, 0]  # started and scheduled: never finished
    assert ops["bytes"][0] == 4096 and ops["op_seq"] == [0, 1, 2, 3]
    assert ops["t_start"][3] == ops["t_enqueue"][3]


def test_flight_recorder_truncated_and_unsafe(tmp_path: Path) -> None:
    p = tmp_path / "rank0.pkl"
    p.write_bytes(pickle.dumps(fr_dump(0, hung=False))[:100])
    with pytest.raises(TraceError, match=r"rank0\.pkl"):
        collect("flight-recorder", [p])
    evil = tmp_path / "rank1.pkl"
    evil.write_bytes(pickle.dumps(Path("/etc")))  # any class is refused
    with pytest.raises(TraceError, match="refusing"):
        collect("flight-recorder", [evil])


_CALL = ("NCCL INFO {op}: opCount {n} sendbuff 0x7f00 recvbuff 0x7f00 count {count} "
         "datatype {dt} op 0 root 0 comm {comm} [nranks=2] stream 0x55e2")
NCCL_LOG = "\n".join([
    "node1:2817:2817 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>",
    "[2025-03-01 10:00:00.000100] node1:2817:2817 [0] NCCL INFO comm 0x55d1 rank 1 nranks 2 "
    "cudaDev 1 nvmlDev 1 busId 1b000 commId 0x8d1f8b2d1b4d7a5 - Init COMPLETE",
    "[2025-03-01 10:00:01.000000] node1:2817:2817 [0] "
    + _CALL.format(op="AllReduce", n=0, count=1024, dt=7, comm="0x55d1"),
    "[2025-03-01 10:00:01.500000] node1:2817:2817 [0] "
    + _CALL.format(op="AllReduce", n=1, count=1024, dt=9, comm="0x55d1"),
    "1740823202.250000 node1:2817:2817 [0] "
    + _CALL.format(op="Send", n=2, count=10, dt=0, comm="0x9999"),
    "",
])


def test_megatrace_nccl_log(tmp_path: Path) -> None:
    p = tmp_path / "rank1.log"
    p.write_text(NCCL_LOG)
    ops = collect("megatrace", [p]).cols["ops"]
    assert ops["comm_id"] == ["0x8d1f8b2d1b4d7a5"] * 2 + ["0x9999"]
    assert ops["bytes"] == [4096, 2048, 10] and ops["peer"] == [-1, -1, 0]
    t0 = ops["t_start"][0]
    assert ops["t_end"] == [t0 + 500_000_000, 0, 0] and ops["op"][2] == "Send"


def test_megatrace_bad_line_publishes_nothing(tmp_path: Path) -> None:
    good, bad = tmp_path / "rank0.log", tmp_path / "rank1.log"
    good.write_text(NCCL_LOG)
    bad.write_text(NCCL_LOG.rsplit("count", 1)[0])  # truncated mid-line
    with pytest.raises(TraceError) as e:
        collect("megatrace", [good, bad])
    assert e.value.path == str(bad) and e.value.line == 5


def test_cli_reports_file_and_line_and_publishes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rankwatch.cli import main

    good, bad = tmp_path / "rank0.log", tmp_path / "rank1.log"
    good.write_text(NCCL_LOG)
    bad.write_text(NCCL_LOG.rsplit("count", 1)[0])
    # the broker address is unreachable on purpose: a publish attempt would fail loudly
    assert main(["--kafka-port", "9", "import", "megatrace", str(good), str(bad),
                 "--job", "j"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:5:" in err and "nothing was published" in err
    assert main(["import", "megatrace", str(good), "--job", "j", "--dry-run"]) == 0
    assert "would publish 3 ops" in capsys.readouterr().out
