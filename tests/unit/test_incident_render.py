"""The incident page's pure parts: escaping of producer-controlled text, the heatmap keeping
every culprit on its own row when peers are banded, stage shares, SQL literals, and the Perfetto
encoder read back with the perfetto package's protobuf classes."""

from __future__ import annotations

import re

import numpy as np

from diagnosis.export import perfetto
from diagnosis.page import svg
from diagnosis.page.data import IncidentData, literal
from diagnosis.page.render import incident_page, index_page
from ingest.units import SECOND as S
from tests.unit.notify_fixtures import version


def data(world: int = 8, culprit: int = 3, job: str = "j") -> IncidentData:
    d = version(f"{job}:hang:1", 1, "open", job_id=job, ranks=(culprit,), onset_ns=30 * S,
                detected_ns=35 * S)
    progress = np.full((world, 60), 4, dtype=np.int64)
    progress[culprit, 30:] = 0
    stages = {r: np.array([1.0, 2, 9 if r == culprit else 3, 0, 1, 1]) for r in range(world)}
    return IncidentData([d], world, [], 0, S, progress, stages)


def test_producer_text_is_escaped_everywhere() -> None:
    evil = "<script>alert(1)</script>"
    d = data(job=evil)
    html = incident_page(d)
    assert "<script" not in html and "&lt;script&gt;" in html
    index = index_page([{"job_id": evil, "incident_id": evil, "status": "open",
                         "kind": "hang", "summary": evil}])
    assert "<script" not in index and "%3Cscript%3E" in index  # the link is URL-quoted


def test_banded_heatmap_keeps_each_culprit_on_its_own_row() -> None:
    p = np.ones((1000, 60), dtype=np.int64)
    p[999, 30:] = 0
    out = svg.progress_heatmap(p, [7, 999], 0, S, 30 * S)
    assert len(re.findall(r'class="culprit-row"', out)) == 2
    labels = re.findall(r">(rank[s]? [0-9-]+)</text>", out)
    assert "rank 7" in labels and "rank 999" in labels
    assert any(x.startswith("ranks ") for x in labels)  # peers banded
    assert out.count("<rect") < 1000 * 60 // 2  # not one rect per rank and bin


def test_stage_shares_compare_the_culprit_with_the_median_peer() -> None:
    d = data()
    shares = svg.stage_shares(d.stages, [3])
    assert shares is not None
    culprit, peers = shares
    assert abs(culprit.sum() - 1) < 1e-9 and abs(peers.sum() - 1) < 1e-9
    assert culprit[2] == 9 / 14 and peers[2] == 3 / 8
    assert svg.stage_shares({3: d.stages[3]}, [3]) is None  # no peer: no comparison


def test_sql_literal_escapes_quotes_and_backslashes() -> None:
    assert literal("a'b\\c") == "'a\\'b\\\\c'"


def test_perfetto_trace_reads_back_with_perfettos_classes() -> None:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    b = perfetto.TraceBuilder()
    b.rank_names[0] = "rank 0 · h0"
    perfetto.add_ops(b, {"rank": np.array([0, 0]), "comm_id": np.array(["tp", "tp"], object),
                         "op_seq": np.array([1, 2]), "op": np.array(["AllReduce"] * 2, object),
                         "bytes": np.array([8, 8]), "t_start": np.array([10, 50]),
                         "t_end": np.array([40, 0])}, span_end=100)
    perfetto.add_kernels(b, {"rank": np.array([0]), "stream": np.array([7]),
                             "kernel": np.array(["gemm"], object), "t_start": np.array([12]),
                             "duration": np.array([-5])})  # a bad duration: an empty slice
    t = pb.Trace()
    t.ParseFromString(b.to_bytes())
    names = {p.track_descriptor.name for p in t.packet if p.HasField("track_descriptor")}
    assert names == {"rank 0 · h0", "ops tp", "kernels stream 7"}
    events = [(p.timestamp, p.track_event.type, p.track_event.name) for p in t.packet
              if p.HasField("track_event")]
    begins = [(ts, n) for ts, ty, n in events if ty == pb.TrackEvent.TYPE_SLICE_BEGIN]
    assert begins == [(10, "AllReduce"), (12, "gemm"), (50, "AllReduce (in flight)")]
    ends = sorted(ts for ts, ty, _n in events if ty == pb.TrackEvent.TYPE_SLICE_END)
    assert ends == [12, 40, 100]
    ann = next(p.track_event.debug_annotations for p in t.packet
               if p.HasField("track_event") and p.track_event.name == "AllReduce")
    assert {a.name: (a.string_value or a.int_value) for a in ann} == {
        "comm_id": "tp", "op_seq": 1, "bytes": 8}
