"""The combined diagnosis: engine on simulator records, incident state, the pure-wait property
at the combined level (adding waiting to a victim never moves blame to it), schema v1."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from diagnosis import engine
from diagnosis.incidents import IncidentBook
from diagnosis.model import Diagnosis, Suspect, confidence_label, json_schemas
from diagnosis.triggers.base import Trigger
from diagnosis.triggers.watch import JobWatch, steps_from_stages
from diagnosis.window import Window
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect


@functools.cache
def window(fault: str, steps: int = 12) -> tuple[Window, int]:
    cfg = JobConfig(job_id="t", tp=2, pp=4, dp=2, steps=steps, hang_tail_s=6.0)
    d = collect(Simulation(cfg, [fault]).batches())
    topo = d.pop("jobs")["topology"][0]
    now = int(max(d["beats"]["ts"].max(), d["ops"]["t_enqueue"].max()))
    return Window(topo, d, 0, now), now


def diagnose(w: Window, now: int, kind: str = "hang") -> Diagnosis | None:
    t = Trigger(w.topo.job_id, now, kind, ())  # type: ignore[arg-type]
    c = engine.diagnose(w, t, now)
    if c is None:
        return None
    return engine.to_diagnosis(c, w, t, incident_id="t:hang:x", version=1, status="open",
                               detected_ns=now)


@pytest.mark.parametrize(("fault", "ranks", "stage", "component"), [
    ("hang rank=13 stage=bwd mb=3 at=3s", [13], "bwd mb=3 pp=3", "gpu_compute"),
    ("hang rank=4 stage=optim at=3s", [4], "optim", "gpu_compute"),
    ("death rank=6 at=3s", [6], "process", "host_software"),
])
def test_hang_names_rank_stage_component(fault: str, ranks: list[int], stage: str,
                                         component: str) -> None:
    w, now = window(fault)
    d = diagnose(w, now)
    assert d is not None and d.kind == "hang"
    assert (d.culprit_ranks, d.stage, d.component) == (ranks, stage, component)
    assert d.culprit_hosts == [w.topo.hosts[ranks[0]]] and d.sql and d.rules


def test_gpu_slowdown_names_the_rank_and_compute() -> None:
    w, now = window("gpu_slow rank=9 factor=1.6 at=2s", steps=16)
    d = diagnose(w, now, "straggler")
    assert d is not None and d.kind in ("slowdown", "jitter")
    assert (d.culprit_ranks, d.stage, d.component) == ([9], "compute", "gpu_compute")


def test_a_stall_too_young_for_a_hang_is_no_slowdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A performance trigger while a rank sits in a call longer than 1.5 steps but the hang
    analysis does not yet call it a hang: no conclusion — the stall's waiting read as a
    slowdown opened a wrong incident on a real pipeline (the hang analysis names it once it is
    one). The same trigger with nothing stuck runs the slowdown analysis. The analyses are
    stubbed: what is tested is the dispatch."""
    from diagnosis import hang_rca, slow
    from diagnosis.conclusion import Conclusion

    w, _ = window("hang rank=13 stage=bwd mb=3 at=3s")
    t0 = int(w.get("ops")["t_start"].min())
    stuck, calm = t0 + 5 * 10**9, t0 + int(3.5e9)
    assert hang_rca.stuck_ranks(w, stuck).size and not hang_rca.stuck_ranks(w, calm).size
    named = Conclusion("slowdown", (3,), "data", "data_loader", 0.9)
    monkeypatch.setattr(hang_rca, "analyze", lambda w_, n: None)
    monkeypatch.setattr(hang_rca, "analyze_past_stall", lambda w_, n: None)
    monkeypatch.setattr(slow, "analyze", lambda w_, n, **_k: named)
    t = Trigger("t", stuck, "straggler", ())
    assert engine.diagnose(w, t, stuck) is None
    assert engine.diagnose(w, t, calm) is named


def test_a_culprit_not_seen_alive_since_the_wait_is_not_named_at_095() -> None:
    """A rank its peers wait for, 1.5 s into the wait: with a beat of it since the wait began
    it is alive and hung (0.95); with none, a killed process and a hung one look alike until
    its exit beat or more silence says which — at most 0.75, label alive_unjudged."""
    from diagnosis import hang_rca

    w, now = window("hang rank=13 stage=bwd mb=3 at=3s")
    full = hang_rca.analyze(w, now)
    assert full is not None and full.onset_ns is not None
    at = full.onset_ns + int(1.5e9)
    seen = hang_rca.analyze(w, at)
    assert seen is not None and seen.ranks == (13,) and seen.confidence == 0.95
    assert "alive_unjudged" not in seen.labels
    b = w.get("beats")
    keep = ~((b["rank"] == 13) & (b["ts"] > full.onset_ns))
    quiet = Window(w.topo, {**w.tables, "beats": {k: v[keep] for k, v in b.items()}},
                   w.start_ns, w.now_ns)
    c = hang_rca.analyze(quiet, at)
    assert c is not None and c.ranks == (13,) and c.confidence <= 0.75
    assert "alive_unjudged" in c.labels


def test_no_fault_no_diagnosis() -> None:
    w, now = window("gpu_slow rank=9 factor=1.01 at=2s expect=no", steps=16)
    assert diagnose(w, now, "straggler") is None


@settings(max_examples=12, deadline=None)
@example(victim=8, wait_ms=101, frac=1.0)
@given(victim=st.integers(0, 15), wait_ms=st.integers(1, 400), frac=st.floats(0.1, 1.0))
def test_pure_waiting_on_a_victim_never_moves_blame(victim: int, wait_ms: int,
                                                    frac: float) -> None:
    """A victim that arrives earlier at its collectives and waits longer (t_enqueue and t_start
    earlier by the same amount, nothing else changed) is never blamed; the culprit stays.
    Collectives only: a point-to-point Recv posted earlier with the same end is not pure
    waiting when the victim was the later poster — after the shift its partner is, and the data
    then took longer to move after both had posted, which is what a slow link looks like (a
    Send/Recv pair's time counts from the later post). Hypothesis found that case (victim 8,
    101 ms, every op: rank 4's link to 8 was blamed). A call's kernel waits on the device
    behind the rank's compute kernels it was queued after: it starts earlier only as far back
    as the start of the compute kernel it queued behind — earlier than that, the data say the
    device sat idle while the call waited to start, which is a late start (launch.py), not
    waiting (Hypothesis found that case too: victim 10, 359 ms, its TP calls moved before their
    compute began)."""
    from diagnosis.slow.compute import kernel_classes

    w, now = window("gpu_slow rank=9 factor=1.6 at=2s", steps=16)
    base = diagnose(w, now, "straggler")
    assert base is not None and base.culprit_ranks == [9]
    if victim == 9:
        return
    ops = dict(w.get("ops"))
    rng = np.random.default_rng(victim * 1000 + wait_ms)
    p2p = np.isin(np.asarray(ops["op"], dtype=str), ["Send", "Recv"])
    mine = (ops["rank"] == victim) & (ops["t_end"] > 0) & ~p2p & (
        rng.random(ops["rank"].size) < frac)
    k = w.get("kernels")
    own = (k["rank"] == victim) & (kernel_classes(k["kernel"]) != 0)  # compute, not NCCL
    starts = np.sort(k["t_start"][own])
    behind = starts[np.maximum(np.searchsorted(starts, ops["t_start"], side="right") - 1, 0)]
    room = np.where(behind <= ops["t_start"], ops["t_start"] - behind, 0)
    shift = np.where(mine, np.minimum(wait_ms * 1_000_000, room), 0)
    ops["t_start"] = ops["t_start"] - shift
    ops["t_enqueue"] = ops["t_enqueue"] - shift
    w2 = Window(w.topo, {**w.tables, "ops": ops}, w.start_ns, w.now_ns)
    d = diagnose(w2, now, "straggler")
    assert d is not None and victim not in d.culprit_ranks and d.culprit_ranks == [9]


def _d(ranks: list[int], stage: str, version: int = 1) -> Diagnosis:
    w, now = window("hang rank=13 stage=bwd mb=3 at=3s")
    d = diagnose(w, now)
    assert d is not None
    return d.model_copy(update={"culprit_ranks": ranks, "stage": stage, "version": version})


def test_incident_open_update_resolve_and_restore() -> None:
    book = IncidentBook(clear_after=2)
    first = book.conclude(_d([13], "bwd mb=3 pp=3"))
    assert first is not None and first.status == "open" and first.version == 1
    assert book.conclude(_d([13], "bwd mb=3 pp=3")) is None  # not re-announced
    upd = book.conclude(_d([13], "process"))
    assert upd is not None and (upd.status, upd.version) == ("updated", 2)
    assert upd.incident_id == first.incident_id
    assert book.clear("t", "hang", 1) is None
    res = book.clear("t", "hang", 2)
    assert res is not None and (res.status, res.version) == ("resolved", 3)
    again = IncidentBook()
    again.restore([first, upd])
    assert again.is_open("t", "hang")
    again2 = IncidentBook()
    again2.restore([first, upd, res])
    assert not again2.is_open("t", "hang")


def test_a_new_suspect_on_another_host_is_an_update() -> None:
    book = IncidentBook()
    base = _d([13], "bwd mb=3 pp=3")
    assert book.conclude(base) is not None
    second = Suspect(ranks=[40], hosts=["h5"], stage="dp_allreduce", component="nic_rdma",
                     score=1.0)
    upd = book.conclude(base.model_copy(update={"suspects": [second]}))
    assert upd is not None and (upd.status, upd.version) == ("updated", 2)
    rescored = second.model_copy(update={"score": 0.5})  # same suspicion, new score: no news
    assert book.conclude(base.model_copy(update={"suspects": [rescored]})) is None


def test_schema_round_trip() -> None:
    d = _d([13], "bwd mb=3 pp=3")
    assert Diagnosis.model_validate_json(d.to_json()) == d
    schema = json.loads(json_schemas())
    assert schema["Diagnosis"]["properties"]["v"]["const"] == 1


def test_watch_fires_heartbeat_on_a_hang_and_nothing_before() -> None:
    cfg = JobConfig(job_id="t", tp=2, pp=4, dp=2, steps=12, hang_tail_s=6.0)
    sim = Simulation(cfg, ["hang rank=13 stage=bwd mb=3 at=4s"])
    d = collect(sim.batches())
    watch = JobWatch(d["jobs"]["topology"][0])
    ops, beats = d["ops"], d["beats"]
    steps = steps_from_stages(d["stages"])
    fired: list[Trigger] = []
    onset = sim.truth[0].start_ns

    def part(c: dict[str, np.ndarray], tc: str, t: int) -> dict[str, np.ndarray]:
        sel = (c[tc] <= t) & (c[tc] > t - 250_000_000)
        return {k: v[sel] for k, v in c.items()}

    for t in range(cfg.epoch_ns + 10**9, int(beats["ts"].max()), 250_000_000):
        fired += watch.observe(t, ops=part(ops, "t_enqueue", t), beats=part(beats, "ts", t),
                               steps=part(steps, "t_end", t))
    hang = [f for f in fired if f.kind in ("hang", "failure")]
    assert hang and min(f.ts for f in hang) > onset
    assert min(f.ts for f in hang) - onset < 5 * 10**9


def test_an_op_published_in_flight_and_again_completed_counts_once() -> None:
    from diagnosis.window import latest_op_rows

    ops = {"rank": np.array([0, 1, 0, 1]), "comm_id": np.array(["dp", "dp", "dp", "tp"], object),
           "op_seq": np.array([7, 7, 7, 7]), "t_end": np.array([0, 0, 950, 0])}
    out = latest_op_rows(ops)
    # rank 0's op 7 on dp: the completed row wins; rank 1's ops on dp and tp are distinct ops
    assert sorted(zip(out["rank"].tolist(), out["comm_id"].tolist(), out["t_end"].tolist(),
                      strict=True)) == [(0, "dp", 950), (1, "dp", 0), (1, "tp", 0)]
    assert latest_op_rows({}) == {}
    # every op read once: nothing to pick, the columns as read (one sort, no grouping)
    once = {k: v[1:] for k, v in ops.items()}
    assert latest_op_rows(once) is once


def test_the_same_conclusion_rising_into_high_confidence_is_an_update() -> None:
    """A conclusion first published as a suspect (medium) whose evidence firms up into high is
    announced again; one that falls, or moves within a label, is not."""
    book = IncidentBook()
    base = _d([13], "bwd mb=3 pp=3")

    def at(c: float) -> Diagnosis:
        return base.model_copy(update={"confidence": c, "confidence_label": confidence_label(c)})

    assert book.conclude(at(0.65)) is not None
    assert book.conclude(at(0.7)) is None  # still medium
    up = book.conclude(at(0.95))
    assert up is not None and (up.status, up.version, up.confidence) == ("updated", 2, 0.95)
    assert book.conclude(at(0.6)) is None  # a fall is not news
    assert book.conclude(at(0.9)) is None  # the published version is already high


def test_ranks_catching_up_after_a_stall_are_not_named_for_it() -> None:
    """Rank 5 of a TP × PP × DP job stalls 10 s in its backward and recovers. Read in the moments
    after (an analysis a broker's failover delayed), its replica is finishing the interrupted
    step while the other replica still waits in the gradient all-reduce for it: every rank of
    the replica "never reached" that op. They are moving, not hung — the stall is what to name,
    on rank 5, as recovered; and a read at any moment of the catch-up says so."""
    from diagnosis import hang_rca

    cfg = JobConfig(job_id="t", tp=2, pp=2, dp=2, steps=26, microbatches=8)
    d = collect(Simulation(cfg, ["hang rank=5 stage=bwd mb=2 at=4s for=10s"]).batches())
    topo = d.pop("jobs")["topology"][0]
    full = Window(topo, d, 0, int(d["ops"]["t_end"].max()))
    gap = hang_rca.past_stall(full)
    assert gap is not None
    named = set()
    for k in range(1, 24):  # every 25 ms of the 0.6 s after the stall's end
        at = gap[1] + k * 25_000_000
        w = Window(topo, d, 0, at)
        c = engine.diagnose(w, Trigger("t", at, "hang", ()), at)
        assert c is not None, at
        named.add((c.ranks, c.stage))
        assert c.ranks == (5,) and "recovered" in c.labels, (k, c.ranks, c.stage, c.labels)
    assert named == {((5,), "bwd mb=2 pp=1")}
