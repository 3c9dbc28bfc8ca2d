"""The diagnosis agents bound a job's event time by the derived feed's configured lateness, and
drop what they hold of a job another worker owns now; batches read before their job's topology
wait for it."""

from __future__ import annotations

import asyncio
from typing import cast

import faust
import numpy as np
import pytest

import diagnosis.agents as mod
from diagnosis.agents import DiagnosisAgents
from ingest.batch import RecordBatch
from ingest.topics import Topics
from ingest.units import SECOND
from rankwatch.commands.worker import build
from rankwatch.settings import Settings
from streams.db import Database


def agents(lateness_ns: int | None = None) -> DiagnosisAgents:
    # the app is only built, never started: nothing connects to the (unused) broker address
    app = faust.App("rankwatch-test-lateness", broker="kafka://127.0.0.1:9", autodiscover=False)
    db = cast(Database, None)  # _event_time reads no table
    if lateness_ns is None:
        return DiagnosisAgents(app, db, Topics())
    return DiagnosisAgents(app, db, Topics(), lateness_ns=lateness_ns)


def test_event_time_uses_the_configured_lateness() -> None:
    a = agents(7 * SECOND)
    a.watermark["job"] = 100 * SECOND
    assert a._event_time("job", 200 * SECOND) == 107 * SECOND
    assert a._event_time("job", 103 * SECOND) == 103 * SECOND  # the wall clock when earlier
    assert a._event_time("other", 200 * SECOND) == 200 * SECOND  # no watermark yet


def test_default_lateness_is_the_feeds_default() -> None:
    a = agents()
    a.watermark["job"] = 100 * SECOND
    assert a._event_time("job", 200 * SECOND) == 102 * SECOND


def test_worker_passes_derived_lateness_s() -> None:
    """The worker's diagnosis agents get the lateness the derived feed is configured with."""
    settings = Settings(derived_lateness_s=5.5)
    sapp = build(settings, cast(Database, None))  # built only: no table is read
    assert sapp.derived.cfg.lateness_ns == 5_500_000_000
    agents = vars(sapp)["diagnosis"]  # attached by the worker
    assert isinstance(agents, DiagnosisAgents) and agents.lateness_ns == 5_500_000_000


def test_a_handed_over_job_leaves_no_pending_trigger_behind() -> None:
    """A trigger pending here (a hang or a slowdown analysed too early) of a job another worker
    now owns is dropped with the rest of the job's state: retried here, it would open an
    incident the new owner opens too."""
    from diagnosis.triggers.base import Trigger

    a = agents()
    for job in ("gone", "kept"):
        a.analyst.jobs.add(job)
        a.analyst.pending[job] = (Trigger(job, 1, "hang", (3,)), 1, 1)
        a.analyst.pending_slow[job] = (Trigger(job, 1, "straggler", (3,)), 1, 2)
    assert {"gone", "kept"} <= a._held()
    a._forget(["gone"])
    assert "gone" not in a._held()
    assert set(a.analyst.pending) == set(a.analyst.pending_slow) == {"kept"}


def test_batches_before_the_topology_wait_for_it_in_order_and_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's feed and beats batches read before its `jobs` record is stored wait for it and
    are read first, in order, once it is; the waiting is bounded and what it drops counted."""
    a = agents()
    stored: set[str] = set()
    seen: list[tuple[str, str, int]] = []

    async def watch(job: str) -> object | None:
        return object() if job in stored else None

    async def observe(what: str, b: RecordBatch, w: object) -> None:
        seen.append((what, b.job_id, int(b.cols["n"][0])))

    monkeypatch.setattr(a, "_watch", watch)
    monkeypatch.setattr(a, "_observe", observe)
    monkeypatch.setattr(mod, "WAITING_BATCHES", 3)
    monkeypatch.setattr(mod, "WAITING_JOBS", 2)

    def batch(job: str, n: int) -> RecordBatch:
        return RecordBatch("progress", job, "test", n, {"n": np.asarray([n])})

    async def run() -> None:
        for n, what in enumerate(["progress", "beats", "iterations", "progress"]):
            assert await a._ready_watch(what, batch("j", n)) is None
        assert a.waiting_dropped == 1  # 3 kept per job: the oldest went
        stored.add("j")
        w = await a._ready_watch("progress", batch("j", 4))
        assert w is not None and "j" not in a._waiting
        # three more jobs without a topology: the longest waiting is dropped whole
        for job in ("x", "y", "z"):
            await a._ready_watch("progress", batch(job, 0))
            await a._ready_watch("progress", batch(job, 1))
        assert set(a._waiting) == {"y", "z"} and a.waiting_dropped == 3
        # and the bytes held, all jobs together: the longest waiting job's oldest go first
        monkeypatch.setattr(mod, "WAITING_BYTES", 3 * 8)
        await a._ready_watch("progress", batch("z", 2))
        assert [int(b.cols["n"][0]) for _, b in a._waiting["z"]] == [0, 1, 2]
        assert "y" not in a._waiting and a._waiting_bytes == 24 and a.waiting_dropped == 5

    asyncio.run(run())
    # the waiting batches are read in order, before the batch that found the topology (which
    # its caller reads)
    assert seen == [("beats", "j", 1), ("iterations", "j", 2), ("progress", "j", 3)]
    a._forget(["z"])
    assert a._waiting == {} and a._waiting_bytes == 0


def test_the_timer_releases_a_job_whose_last_batch_came_before_its_topology(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch of a replayed job may be read before its topology is stored; no later batch
    then finds the topology, so the timer looks for it — at most once a second — and reads
    the waiting batches in order."""
    a = agents()
    stored: set[str] = set()
    seen: list[int] = []
    looks: list[str] = []

    async def watch(job: str) -> object | None:
        looks.append(job)
        return object() if job in stored else None

    async def observe(what: str, b: RecordBatch, w: object) -> None:
        seen.append(int(b.cols["n"][0]))

    monkeypatch.setattr(a, "_watch", watch)
    monkeypatch.setattr(a, "_observe", observe)

    async def run() -> None:
        for n in range(3):
            await a._ready_watch("progress", RecordBatch("progress", "j", "test", n,
                                                         {"n": np.asarray([n])}))
        looks.clear()
        await a._release_waiting(10 * SECOND)  # not stored yet: still waiting
        assert looks == ["j"] and seen == [] and "j" in a._waiting
        stored.add("j")
        await a._release_waiting(10 * SECOND + SECOND // 2)  # looked half a second ago
        assert looks == ["j"] and seen == []
        await a._release_waiting(11 * SECOND)
        assert seen == [0, 1, 2] and a._waiting == {} and a._waiting_bytes == 0
        await a._release_waiting(12 * SECOND)  # nothing waits: no look
        assert looks == ["j", "j"]

    asyncio.run(run())


def test_stored_stage_records_reach_the_step_trigger_without_the_derived_feed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage records go to the job's step-time trigger as the raw sink stores them (no
    iteration preview needed): a rank's steps twice as long fire a straggler trigger; other
    stored kinds do not reach it, and a full queue drops and counts."""
    from diagnosis.triggers.base import Trigger
    from diagnosis.triggers.watch import JobWatch
    from ingest.records import Communicator, JobTopology

    a = agents()
    topo = JobTopology(job_id="j", ts=0, world_size=2, dp=2, hosts=["h", "h"],
                       communicators=[Communicator(comm_id="w", kind="dp", members=[0, 1])])
    watch = JobWatch(topo)
    fired: list[Trigger] = []

    async def get_watch(job: str) -> JobWatch | None:
        return watch if job == "j" else None

    async def publish(ts: list[Trigger]) -> None:
        fired.extend(ts)

    monkeypatch.setattr(a, "_watch", get_watch)
    monkeypatch.setattr(a, "_publish_triggers", publish)

    def stages(first: int, n: int, step_ms: int) -> RecordBatch:
        step = np.repeat(np.arange(first, first + n), 2)
        rank = np.tile([0, 1], n)
        dur = np.full(step.size, step_ms * 1_000_000, np.int64)
        z = np.zeros(step.size, np.int64)
        t0 = step.astype(np.int64) * 200_000_000
        return RecordBatch("stages", "j", "test", first, {
            "rank": rank, "step": step, "t_start": t0, "data_next_wait": z,
            "model_fwd_loss": dur, "model_backward": z, "callbacks": z, "optim_step": z,
            "step_other": z})

    async def run() -> None:
        task = asyncio.ensure_future(a._on_stored())
        a.on_stored("ops", stages(0, 1, 50))  # not a kind the trigger reads
        a.on_stored("stages", stages(0, 20, 50))
        a.on_stored("stages", stages(20, 4, 100))
        for _ in range(50):
            await asyncio.sleep(0.01)
            if fired:
                break
        task.cancel()

    asyncio.run(run())
    assert [t.kind for t in fired][:1] == ["straggler"]
    monkeypatch.setattr(a, "_stored", asyncio.Queue(maxsize=1))
    a.on_stored("stages", stages(0, 1, 50))
    a.on_stored("stages", stages(1, 1, 50))
    assert a.stages_dropped == 1 and a.beats_dropped == 0


def test_stored_stage_records_time_a_pending_slowdowns_next_try(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stored stage or call batch tells the analyst how far each rank's records are
    stored; a stage batch of a job with a pending performance trigger has it tried at once
    (`Analyst.retry_slow`), not at the next tick. A batch without rank or time columns is
    stored all the same: it only goes uncounted."""
    from diagnosis.triggers.base import Trigger

    a = agents()
    tries: list[int] = []

    def retry_slow(now: int) -> list[object]:
        tries.append(now)
        return []

    monkeypatch.setattr(a.analyst, "retry_slow", retry_slow)
    a.clock = lambda: 5 * SECOND
    a.restored_generation = a.ownership.generation  # its open incidents loaded (none here)

    def batch(kind: str, cols: dict[str, np.ndarray]) -> RecordBatch:
        return RecordBatch(kind, "j", "test", 0, cols)

    z = np.zeros(2, np.int64)
    st = {"rank": np.array([0, 1]), "step": np.array([3, 3]), "t_start": np.array([10, 12]),
          "data_next_wait": z, "model_fwd_loss": np.array([5, 9]), "model_backward": z,
          "callbacks": z, "optim_step": z, "step_other": z}

    async def run() -> None:
        task = asyncio.ensure_future(a._on_evidence())
        a.on_stored("stages", batch("stages", st))  # nothing pending: no try
        await asyncio.sleep(0.05)
        assert tries == []
        a.analyst.pending_slow["j"] = (Trigger("j", 1, "straggler", ()), 1, 2)
        a.on_stored("ops", batch("ops", {"rank": np.array([1, 1]), "t_enqueue": np.array([
            30, 40]), "t_end": np.array([35, 0])}))  # calls do not time a try
        await asyncio.sleep(0.05)
        assert tries == []
        a.on_stored("stages", batch("stages", st))
        for _ in range(50):
            await asyncio.sleep(0.01)
            if tries:
                break
        task.cancel()

    asyncio.run(run())
    assert tries == [5 * SECOND]
    assert a.analyst.stages_stored["j"] == 2
    assert a.analyst.stored_to[("j", "stages")] == {0: 15, 1: 21}
    assert a.analyst.stored_to[("j", "ops")] == {1: 40}  # its call in flight since 40
    a.on_stored("stages", batch("stages", {"step": np.array([4])}))  # no rank, no times
    assert a.analyst.stages_stored["j"] == 2


def test_a_trigger_of_a_job_gained_meanwhile_waits_for_its_open_incidents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebalance lands while this worker reads triggers: the next trigger, of a job it has
    just gained, is analysed only once the job's open incidents (stored by its previous owner)
    are loaded — analysed first, it would open a second incident, and the restore keeps an
    incident already held."""
    from types import SimpleNamespace

    from diagnosis.model import Diagnosis
    from diagnosis.triggers.base import Trigger
    from streams.ownership import Ownership, job_partition
    from tests.unit.test_diagnosis_engine import _d

    job = next(j for j in (f"gained-{i}" for i in range(100)) if job_partition(j, 2) == 1)
    prior = _d([13], "bwd mb=3 pp=3").model_copy(update={"job_id": job})
    reads: list[int] = []
    announced: list[Diagnosis] = []
    held_at_analysis: list[bool] = []
    own = Ownership(standalone=False)

    class Stored:
        async def aquery(self, sql: str, parameters: object = None) -> SimpleNamespace:
            reads.append(own.generation)
            await asyncio.sleep(0)
            return SimpleNamespace(result_rows=[(prior.to_json().decode(),)]
                                   if own.owns(job) else [])

    app = faust.App("rankwatch-test-handover", broker="kafka://127.0.0.1:9", autodiscover=False)
    a = DiagnosisAgents(app, cast(Database, Stored()), Topics(), ownership=own)

    async def announce(d: Diagnosis) -> None:
        announced.append(d)

    def on_trigger(t: Trigger, now: int) -> list[Diagnosis]:
        held_at_analysis.append(a.analyst.book.is_open(t.job_id, "hang"))
        return []

    monkeypatch.setattr(a, "_announce", announce)
    monkeypatch.setattr(a.analyst, "on_trigger", on_trigger)

    async def run() -> None:
        own.assign([0], 2)
        await a._restored()
        assert reads == [1] and not a.analyst.book.is_open(job, "hang")
        assert await a._analyse(Trigger(job, 1, "hang", (13,))) == []  # not owned: skipped
        own.assign([0, 1], 2)  # the job's owner died mid-batch of triggers
        await a._analyse(Trigger(job, 2, "hang", (13,)))

    asyncio.run(run())
    assert reads == [1, 2]
    assert held_at_analysis == [True]  # the previous owner's incident, before the analysis
    assert [d.incident_id for d in announced] == [prior.incident_id]  # announced again, once


def test_analysis_cpu_is_counted_per_kind_of_work_and_exported() -> None:
    """Each analyst call run by `_in_thread` adds its thread's CPU and the database thread's CPU
    on its reads (`Database.cpu_s`, per calling thread) to its kind of work, a call that fails
    too; the worker's /metrics exports the totals."""
    import time
    from types import SimpleNamespace

    from rankwatch.metrics import WorkerCollector

    class Db:  # the database thread's CPU billed to the calling thread
        def __init__(self) -> None:
            self.cpu = 0.0

        def cpu_s(self) -> float:
            return self.cpu

    def spin(s: float) -> None:
        t = time.thread_time()
        while time.thread_time() - t < s:
            pass

    db = Db()
    app = faust.App("rankwatch-test-cpu", broker="kafka://127.0.0.1:9", autodiscover=False)
    a = DiagnosisAgents(app, cast(Database, db), Topics())

    def work(x: int) -> list[int]:
        spin(0.05)
        db.cpu += 0.5  # its reads
        return [x]

    def bad() -> list[int]:
        spin(0.05)
        raise ValueError("a bad window")

    assert asyncio.run(a._in_thread("tick", work, 7)) == [7]
    assert 0.55 <= a.analysis_cpu_s["tick"] < 0.9
    with pytest.raises(ValueError):
        asyncio.run(a._in_thread("trigger", bad))
    assert 0.05 <= a.analysis_cpu_s["trigger"] < 0.4
    assert a.analysis_cpu_s["evidence"] == 0.0  # exported from the start, not when first used
    sapp = SimpleNamespace(stats=dict, diagnosis=a)
    fam = next(m for m in WorkerCollector(sapp).collect()
               if m.name == "rankwatch_analysis_cpu_seconds")
    got = {s.labels["work"]: s.value for s in fam.samples if s.name.endswith("_total")}
    assert got == a.analysis_cpu_s
