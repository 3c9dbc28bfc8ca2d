"""The diagnosis agents bound a job's event time by the derived feed's configured lateness."""

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
