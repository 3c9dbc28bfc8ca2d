"""Importers on the formats real tools write: MegaTrace's call lines (both versions), NCCL INFO
lines without timestamps, gzipped Kineto traces, Flight Recorder JSON dumps and gloo's states,
ranks from file names, the inferred topology, and imports that store nothing."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from ingest.importers import flight_recorder
from ingest.importers.common import Collected, TraceError, rank_from_name
from ingest.importers.topology import TopologyError, infer
from ingest.units import SECOND as SEC
from rankwatch.commands.import_ import collect
from tests.unit.test_import_formats import BASE, kineto_trace


def megatrace_line(rank: int, t_ns: int, op: str, count: int, stream: str, op_count: int,
                   group_hash: int | None = None, save: int = 1) -> str:
    tail = f" groupHash {group_hash}" if group_hash is not None else ""
    return (f"[save_count {save}] [{t_ns // SEC}.{t_ns % SEC:09d}] [Rank {rank}] Fun {op} "
            f"Data {count} stream {stream} opCount {op_count}{tail}")


def tp2_pp2_logs(tmp_path: Path, new: bool) -> list[Path]:
    """4 ranks, TP groups {0,1} and {2,3} (all-reduces on their own stream; the second stage
    30 ms after the first, as a pipeline runs), a world all-reduce, and Send/Recv between the
    stages; 12 TP calls per rank."""
    paths = []
    for r in range(4):
        lines = []
        tp_hash, world_hash = (111 if r < 2 else 222), 999
        for i in range(12):
            t = BASE + i * 50_000_000 + (r // 2) * 30_000_000 + r * 10_000
            lines.append(megatrace_line(r, t, "AllReduce", 4096, f"0x{r}a", i,
                                        tp_hash if new else None))
            lines.append(megatrace_line(r, t + 1_000_000, "Send" if r < 2 else "Recv", 2048,
                                        f"0x{r}b", i, 500 + r if new else None))
        lines.append(megatrace_line(r, BASE + SEC, "AllReduce", 1, f"0x{r}c", 0,
                                    world_hash if new else None))
        p = tmp_path / f"rank_{r}.log"
        p.write_text("\n".join(lines) + "\n")
        paths.append(p)
    return paths


@pytest.mark.parametrize("new", [False, True], ids=["streams", "groupHash"])
def test_megatrace_lines_both_versions_and_topology(tmp_path: Path, new: bool) -> None:
    c = collect("megatrace", tp2_pp2_logs(tmp_path, new))
    ops = c.cols["ops"]
    assert c.counts() == {"ops": 4 * 25}
    tp = {ops["comm_id"][i] for i in range(len(ops["op"]))
          if ops["op"][i] == "AllReduce" and ops["bytes"][i] == 4096 and ops["rank"][i] < 2}
    assert len(tp) == 1  # ranks 0 and 1 share one job-wide TP communicator
    assert c.members[tp.pop()] == {0, 1}
    topo = infer(c, "j", 0)
    assert (topo.topology.tp, topo.topology.pp, topo.topology.dp) == (2, 2, 1), topo.how
    kinds = sorted((cm.kind, tuple(cm.members)) for cm in topo.topology.communicators)
    assert ("tp", (0, 1)) in kinds and ("tp", (2, 3)) in kinds
    assert "tp 2" in topo.how and "pp 2" in topo.how
    last = [i for i, s in enumerate(ops["op_seq"]) if s == 11 and ops["op"][i] == "AllReduce"]
    assert all(ops["t_end"][i] == 0 for i in last)  # each communicator's last call in flight


def test_megatrace_given_sizes_win(tmp_path: Path) -> None:
    c = collect("megatrace", tp2_pp2_logs(tmp_path, True))
    topo = infer(c, "j", 0, tp=1, pp=1, dp=4)
    assert (topo.topology.tp, topo.topology.dp) == (1, 4) and "(given)" in topo.how
    with pytest.raises(TopologyError, match="--tp"):
        infer(c, "j", 0, tp=3)


def test_megatrace_rank_lines_must_agree_and_truncation_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "mixed.log"
    p.write_text(megatrace_line(0, BASE, "AllReduce", 1, "0x1", 0) + "\n"
                 + megatrace_line(1, BASE, "AllReduce", 1, "0x1", 0) + "\n")
    with pytest.raises(TraceError, match="several ranks"):
        collect("megatrace", [p])
    q = tmp_path / "rank_0.log"
    text = megatrace_line(0, BASE, "AllReduce", 1, "0x1", 0) + "\n"
    q.write_text(text + text[:40])
    with pytest.raises(TraceError) as e:
        collect("megatrace", [q])
    assert e.value.line == 2 and "truncated" in str(e.value)


def test_nccl_info_without_time_says_which_setting_adds_it(tmp_path: Path) -> None:
    p = tmp_path / "rank0.log"
    p.write_text("node1:2817:2817 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7f recvbuff "
                 "0x7f count 8 datatype 7 op 0 root 0 comm 0x55 [nranks=2] stream 0x56\n")
    with pytest.raises(TraceError) as e:
        collect("megatrace", [p])
    assert "NCCL_DEBUG_TIMESTAMP_LEVELS" in str(e.value) and e.value.line == 1


def test_kineto_gzip_and_process_groups(tmp_path: Path) -> None:
    trace = kineto_trace(1)
    info = trace["distributedInfo"]
    assert isinstance(info, dict)
    info["pg_config"] = [{"pg_name": "3", "pg_desc": "default_pg", "ranks": [0, 1]}]
    p = tmp_path / "worker1.pt.trace.json.gz"
    p.write_bytes(gzip.compress(json.dumps(trace).encode()))
    c = collect("kineto", [p])
    assert c.counts() == {"kernels": 3, "ops": 2}
    assert c.members["3"] == {0, 1} and c.world == 2
    topo = infer(c, "j", 0).topology
    assert topo.dp == 2 and [cm.kind for cm in topo.communicators] == ["dp"]


def test_rank_from_file_names() -> None:
    assert rank_from_name(Path("trace_0")) == 0
    assert rank_from_name(Path("nccl_trace_rank_12.json")) == 12
    assert rank_from_name(Path("rank-3.Apr_03.pt.trace.json.gz")) == 3
    assert rank_from_name(Path("dump.pkl")) is None


def fr_json(rank: int, hung: bool) -> dict[str, object]:
    """A gloo dump as torch 2.15's `_dump_fr_trace_json` writes it: every entry `scheduled`,
    completion in `retired` and pg_status; pg_config under an empty key; no rank."""
    entries = []
    last = 4 if rank == 0 or not hung else 3
    for seq in range(1, last + 1):
        done = seq < 4 or not hung
        entries.append({"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"],
                        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
                        "profiling_name": "gloo:all_reduce", "time_created_ns": BASE + seq,
                        "time_discovered_started_ns": 0, "time_discovered_completed_ns": 0,
                        "input_sizes": [[1024]], "input_dtypes": ["Float"], "is_p2p": False,
                        "state": "scheduled", "retired": done, "timeout_ms": 1800000})
    return {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
            "pg_status": {"0": {"last_enqueued_collective": str(last),
                                "last_started_collective": "-1",
                                "last_completed_collective": str(3 if hung else 4)}},
            "entries": entries}


def test_flight_recorder_json_gloo_states_and_dump_time(tmp_path: Path) -> None:
    paths = []
    for r in (0, 1):
        p = tmp_path / f"trace_{r}"
        p.write_text(json.dumps(fr_json(r, hung=True)))
        os.utime(p, ns=(BASE + 5 * SEC, BASE + 5 * SEC))
        paths.append(p)
    c = collect("flight-recorder", paths)
    ops, beats = c.cols["ops"], c.cols["beats"]
    ends = {(r, s): e for r, s, e in zip(ops["rank"], ops["op_seq"], ops["t_end"], strict=True)}
    assert ends[(0, 4)] == 0  # rank 0 waits in its 4th all_reduce
    assert all(e > 0 for k, e in ends.items() if k != (0, 4))  # scheduled, yet completed
    assert beats["ts"] == [BASE + 5 * SEC] * 2 and beats["last_op_seq"] == [3, 3]
    assert c.members == {"0": {0, 1}}
    topo = infer(c, "j", 0).topology
    assert topo.world_size == 2 and topo.communicators[0].kind == "dp"


def test_gloo_without_status_reads_order(tmp_path: Path) -> None:
    """An older gloo dump (no retired, no pg_status): a later call on the group means the
    earlier returned; the last call is in flight."""
    doc = fr_json(0, hung=True)
    doc.pop("pg_status")
    entries = doc["entries"]
    assert isinstance(entries, list)
    for e in entries:
        e.pop("retired")
    p = tmp_path / "rank0.json"
    p.write_text(json.dumps(doc))
    ops = flight_recorder.parse(p).cols["ops"]
    assert [e > 0 for e in ops["t_end"]] == [True, True, True, False]


def test_nothing_stored_exits_nonzero_and_says_why(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from rankwatch.cli import main

    p = tmp_path / "rank0.json"
    p.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                              "ts": 1.0, "dur": 2.0}]}))
    assert main(["--home", str(tmp_path), "--kafka-port", "9", "import", "kineto", str(p),
                 "--job", "j"]) == 1
    err = capsys.readouterr().err
    assert "no records" in err and "GPU kernels" in err


def test_collected_merge_keeps_topology_facts() -> None:
    a, b = Collected(world=2), Collected(world=8)
    a.members["x"] = {0}
    b.members["x"] = {1}
    b.hosts[1] = "n1"
    a.merge(b)
    assert a.world == 8 and a.members["x"] == {0, 1} and a.hosts == {1: "n1"}


def test_a_topology_always_lists_a_communicator() -> None:
    """Files that name no communicator (old Kineto traces) still give a storable topology."""
    c = Collected(world=4)
    c.add("kernels", rank=0, stream=7, kernel="k", t_start=BASE, duration=1)
    t = infer(c, "j", 0).topology
    assert t.dp == 4 and [(x.kind, x.members) for x in t.communicators] == \
        [("world", [0, 1, 2, 3])]
