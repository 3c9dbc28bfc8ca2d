"""The Analyst's incident decisions that need no engine run (diagnosis/analyst.py)."""

from __future__ import annotations

from diagnosis.analyst import Analyst, AnalystConfig
from diagnosis.conclusion import Conclusion

S = 1_000_000_000


def slow(ranks: tuple[int, ...]) -> Conclusion:
    return Conclusion("jitter", ranks, "data", "data_loader", 0.9)


def test_the_trace_of_a_resolved_stall_is_not_a_second_incident() -> None:
    a = Analyst(lambda job, lo, hi: None, AnalystConfig(aftermath_s=20))
    assert not a._aftermath("j", slow((3,)), 100 * S)  # no stall resolved yet
    a.resolved_hangs["j"] = (frozenset({3}), 100 * S)
    assert a._aftermath("j", slow((3,)), 110 * S)  # same culprit, same episode
    assert not a._aftermath("j", slow((3, 4)), 110 * S)  # another culprit is news
    assert not a._aftermath("j", slow((3,)), 121 * S)  # later: a new episode
    assert not a._aftermath("k", slow((3,)), 110 * S)  # another job
    assert not a._aftermath("j", Conclusion("hang", (3,), "data", "data_loader", 0.9), 110 * S)


def test_a_new_incident_is_rechecked_after_first_recheck_s() -> None:
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("hang rank=13 stage=bwd mb=3 at=3s")
    a = Analyst(lambda job, lo, hi: w, AnalystConfig(recheck_s=4, first_recheck_s=1))
    out = a.on_trigger(Trigger(w.topo.job_id, now, "hang", ()), now)
    assert [d.status for d in out] == ["open"]
    a.tick(now + S // 2)
    assert a.last_check[w.topo.job_id] < now  # not yet
    a.tick(now + S)
    assert a.last_check[w.topo.job_id] == now + S  # the first re-check ran
    a.tick(now + 2 * S)
    assert a.last_check[w.topo.job_id] == now + S  # then every recheck_s


def test_a_job_whose_event_clock_stands_still_is_swept_once() -> None:
    """The sweep reads the job's window; a job that ended (its event clock no longer moves) is
    not read again every sweep_s."""
    reads: list[int] = []

    def read(job: str, lo: int, hi: int) -> None:
        reads.append(hi)

    clock = {"at": 50 * S}
    a = Analyst(read, AnalystConfig(sweep_s=10), event_clock=lambda job, now: clock["at"])
    a.jobs.add("j")
    a.tick(100 * S)
    a.tick(110 * S)
    a.tick(120 * S)
    assert reads == [50 * S]  # ended: one sweep
    clock["at"] = 60 * S  # its records move on again
    a.tick(130 * S)
    assert reads == [50 * S, 60 * S]
