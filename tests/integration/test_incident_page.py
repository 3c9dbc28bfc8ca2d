"""The incident page, served by a real worker and written by `rankwatch report --html`, rendered
by a real headless Chromium (Debian's `chromium`) whose screenshots the test reads back: not
blank, the culprit's red row present, the peers' blue band present."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from diagnosis.agents import diagnosis_row
from ingest.batch import encode_batch, encode_topology
from ingest.publish import BatchPublisher
from ingest.records import Communicator, JobTopology
from ingest.synthetic import ops_columns
from ingest.units import SECOND as S
from rankwatch import stack
from rankwatch.commands import export, report
from rankwatch.commands.sql import execute
from rankwatch.kafka.admin import delete_topics
from tests.conftest import KafkaService, free_ports
from tests.unit.notify_fixtures import version

WORLD, CULPRIT = 16, 5


def screenshot(target: str, out: Path, tmp: Path) -> np.ndarray:
    """`target` (a URL) rendered by headless Chromium, as an RGB array."""
    binary = shutil.which("chromium")
    if binary is None:
        pytest.fail("chromium is missing: install the Debian package chromium "
                    "(`make test-deps` does, as root)")
    subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--no-first-run", f"--user-data-dir={tmp / 'chromium-profile'}",
                    "--window-size=1100,1600", f"--screenshot={out}", target],
                   check=True, capture_output=True, timeout=120)
    return np.asarray(Image.open(out).convert("RGB")).astype(np.int64)


def near(img: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> np.ndarray:
    return np.asarray(np.abs(img - np.array(rgb)).max(axis=2) <= tol)


def check_rendered(img: np.ndarray) -> None:
    white = (img > 245).all(axis=2)
    assert white.mean() < 0.97, "the page rendered (nearly) blank"
    # the culprit's row: a long horizontal run of its red (badges and borders are short)
    red_per_row = near(img, (214, 39, 40)).sum(axis=1)
    assert red_per_row.max() > 250, f"no culprit row drawn (widest red: {red_per_row.max()} px)"
    blue = (img[..., 2] - img[..., 0] > 60) & (img[..., 2] > 120)
    assert blue.sum() > 2000, "no peer progress (blue) on the page"


def publish_job(s: Any, job: str, onset: int) -> int:
    pub = BatchPublisher(s.bootstrap, s.topics)
    topo = JobTopology(job_id=job, ts=1, world_size=WORLD, dp=WORLD,
                       hosts=[f"node{r // 4:04d}" for r in range(WORLD)],
                       communicators=[Communicator(comm_id="dp:world", kind="dp",
                                                   members=list(range(WORLD)))])
    pub.publish("jobs", encode_topology(topo), key=job)
    t0 = onset - 30 * S
    cols: dict[str, Any] = ops_columns(WORLD, 0, WORLD * 120, t0)
    keep = ~((cols["rank"] == CULPRIT) & (cols["t_end"] > onset))  # the culprit stops
    cols = {k: ((v[0][keep], v[1]) if isinstance(v, tuple) else v[keep]) for k, v in cols.items()}
    pub.publish("ops", encode_batch("ops", job, cols, producer="t", seq=0), key=job)
    ranks = np.repeat(np.arange(WORLD), 20)
    steps = np.tile(np.arange(20), WORLD)
    backward = np.where(ranks == CULPRIT, 900_000_000, 200_000_000)
    stages = {"rank": ranks, "step": steps, "t_start": t0 + steps * S,
              "data_next_wait": np.full(ranks.size, 20_000_000),
              "model_fwd_loss": np.full(ranks.size, 100_000_000), "model_backward": backward,
              "callbacks": np.full(ranks.size, 5_000_000),
              "optim_step": np.full(ranks.size, 50_000_000),
              "step_other": np.full(ranks.size, 25_000_000)}
    pub.publish("stages", encode_batch("stages", job, stages, producer="t", seq=0), key=job)
    kr = np.repeat(np.arange(WORLD), 10)
    kernels = {"rank": kr, "stream": np.full(kr.size, 7),
               "kernel": (np.zeros(kr.size, np.int64), ["ampere_sgemm_128x64_nn"]),
               "t_start": onset - 5 * S + np.tile(np.arange(10), WORLD) * 100_000_000,
               "duration": np.full(kr.size, 40_000_000)}
    pub.publish("kernels", encode_batch("kernels", job, kernels, producer="t", seq=0), key=job)
    assert pub.flush(10) == 0
    return int(keep.sum())


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@dataclass
class Incident:
    settings: Any
    job: str
    incident_id: str
    onset: int


@pytest.fixture(scope="module")
def incident(kafka: KafkaService, settings_factory: Any) -> Iterator[Incident]:
    """A real worker holding one job (16 ranks; rank 5 stops at the onset and spends 4.5x its
    peers' time in backward) and one stored hang incident naming rank 5."""
    sql_port, page_port = free_ports(2)
    s = settings_factory(kafka_bootstrap=kafka.bootstrap, kafka_partitions=1,
                         topic_prefix=f"pg{uuid.uuid4().hex[:10]}", sql_port=sql_port,
                         page_port=page_port, metrics_port=0, sql_writable=True)
    job = f"page-{uuid.uuid4().hex[:6]}"
    onset = time.time_ns() - 60 * S
    iid = f"{job}:hang:{uuid.uuid4().hex[:12]}"
    d = version(iid, 1, "open", job_id=job, ranks=(CULPRIT,), onset_ns=onset,
                detected_ns=onset + 5 * S)
    try:
        stack.up(s, progress=lambda m: None)
        n_ops = publish_job(s, job, onset)
        execute(s, "INSERT INTO diagnoses FORMAT JSONEachRow\n" + diagnosis_row(d).decode(),
                "TSV")
        want = {"ops": n_ops, "stages": WORLD * 20, "kernels": WORLD * 10}
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            if all(int(execute(s, f"SELECT count() FROM {t} WHERE job_id = '{job}'", "TSV"))
                   >= n for t, n in want.items()):
                break
            time.sleep(0.3)
        yield Incident(s, job, iid, onset)
    finally:
        stack.down(s, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [t.name for t in s.topics.specs(1)])


def test_the_worker_serves_the_page_and_report_writes_it_both_render_in_chromium(
        incident: Incident, tmp_path: Path) -> None:
    s, iid = incident.settings, incident.incident_id
    out = tmp_path / "incident.html"
    args = argparse.Namespace(incident_id=iid, html=str(out), json=False)
    assert report.run(args, s) == 0
    html = out.read_text()
    bare = html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for needle in ("http://", "https://", "<script", "<link", " src="):
        assert needle not in bare  # self-contained: nothing fetched, nothing run
    assert f"rank {CULPRIT}" in html and "ORDER BY t_enqueue" in html
    assert "&lt;x&gt;" in html  # evidence text escaped

    base = f"http://127.0.0.1:{s.page_port}"
    status, served = get(f"{base}/incidents/{urllib.parse.quote(iid, safe='')}")
    assert status == 200 and served == html
    status, index = get(f"{base}/")
    assert status == 200 and iid in index
    status, missing = get(f"{base}/incidents/nope")
    assert status == 404 and "no incident" in missing
    hostile = "x' OR 1=1 --\\'; SELECT 1"  # reaches SQL only as a quoted literal
    status, missing = get(f"{base}/incidents/{urllib.parse.quote(hostile, safe='')}")
    assert status == 404 and "no incident" in missing
    args = argparse.Namespace(incident_id="nope", html=str(tmp_path / "x.html"), json=False)
    assert report.run(args, s) == 1 and not (tmp_path / "x.html").exists()

    check_rendered(screenshot(out.as_uri(), tmp_path / "file.png", tmp_path))
    check_rendered(screenshot(f"{base}/incidents/{urllib.parse.quote(iid, safe='')}",
                              tmp_path / "served.png", tmp_path))


def test_export_perfetto_reads_back_with_perfettos_own_protobuf_classes(
        incident: Incident, tmp_path: Path) -> None:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    out = tmp_path / "job.perfetto-trace"
    args = argparse.Namespace(format="perfetto", job=incident.job, around=incident.incident_id,
                              seconds=30.0, limit=1_000_000, out=str(out), json=True)
    assert export.run(args, incident.settings) == 0
    trace = pb.Trace()
    trace.ParseFromString(out.read_bytes())
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in trace.packet
              if p.HasField("track_descriptor")}
    top = {t.uuid: t.name for t in tracks.values() if not t.parent_uuid}
    assert sorted(top.values()) == sorted(f"rank {r} · node{r // 4:04d}" for r in range(WORLD))
    children: dict[str, set[str]] = {}
    for t in tracks.values():
        if t.parent_uuid:
            children.setdefault(top[t.parent_uuid], set()).add(t.name)
    assert all(c == {"ops dp:world", "stages", "kernels stream 7"} for c in children.values())

    open_: dict[int, list[tuple[int, str]]] = {}
    slices: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    last_ts = 0
    for p in trace.packet:
        if not p.HasField("track_event"):
            continue
        assert p.timestamp >= last_ts  # one sequence, in time order
        last_ts = p.timestamp
        e = p.track_event
        if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            open_.setdefault(e.track_uuid, []).append((p.timestamp, e.name))
        else:
            assert e.type == pb.TrackEvent.TYPE_SLICE_END
            begin, name = open_[e.track_uuid].pop()
            track = tracks[e.track_uuid]
            slices.setdefault((top[track.parent_uuid], track.name), []).append(
                (begin, p.timestamp, name))
    assert not any(open_.values())  # every slice closed

    culprit = f"rank {CULPRIT} · node0001"
    stage_names = {n for _b, _e, n in slices[(culprit, "stages")]}
    assert stage_names == {"data.next_wait", "model.fwd_loss", "model.backward", "callbacks",
                           "optim.step", "step.other"}
    backward = [e - b for b, e, n in slices[(culprit, "stages")] if n == "model.backward"]
    assert backward and all(d == 900_000_000 for d in backward)
    # the culprit's ops stop at the onset; a peer's go on
    assert max(b for b, _e, _n in slices[(culprit, "ops dp:world")]) <= incident.onset
    assert max(b for b, _e, _n in slices[("rank 0 · node0000", "ops dp:world")]) > incident.onset
    kernels = slices[(culprit, "kernels stream 7")]
    assert len(kernels) == 10 and {n for _b, _e, n in kernels} == {"ampere_sgemm_128x64_nn"}

    missing = argparse.Namespace(format="perfetto", job="no-such-job", around=None,
                                 seconds=30.0, limit=10, out=str(tmp_path / "x"), json=False)
    assert export.run(missing, incident.settings) == 1 and not (tmp_path / "x").exists()
