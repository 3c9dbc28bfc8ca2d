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
