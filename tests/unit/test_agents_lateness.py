"""The diagnosis agents bound a job's event time by the derived feed's configured lateness, and
drop what they hold of a job another worker owns now."""

from __future__ import annotations

from typing import cast

import faust

from diagnosis.agents import DiagnosisAgents
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
