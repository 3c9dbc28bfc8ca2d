"""Mycroft Alg. 1 triggers with an explicit clock (no sleeping)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from diagnosis.triggers.mycroft import MycroftTriggerConfig, MycroftTriggerState, mycroft_trigger
from ingest.units import MILLISECOND as MS
from ingest.units import SECOND as S


def ops_window(ranks: Sequence[int], t0: int, t1: int, *, period: int = 100 * MS,
               dur: int = 20 * MS, nbytes: int = 1 << 20,
               inflight: Sequence[int] = ()) -> dict[str, np.ndarray]:
    """Every rank completes one op per `period` in [t0, t1); `inflight` ranks add a stuck op."""
    names = ("rank", "comm_id", "op_seq", "bytes", "t_enqueue", "t_start", "t_end")
    rows: dict[str, list[object]] = {k: [] for k in names}
    for r in ranks:
        for i, t in enumerate(range(t0, t1, period)):
            rows["rank"].append(r)
            rows["comm_id"].append("dp:pp0:tp0")
            rows["op_seq"].append(i)
            rows["bytes"].append(nbytes)
            rows["t_enqueue"].append(t)
            rows["t_start"].append(t)
            rows["t_end"].append(t + dur)
    for r in inflight:
        rows["rank"].append(r)
        rows["comm_id"].append("dp:pp0:tp0")
        rows["op_seq"].append(10**6)
        rows["bytes"].append(nbytes)
        rows["t_enqueue"].append(t0)
        rows["t_start"].append(t0)
        rows["t_end"].append(0)
    return {k: np.asarray(v, dtype=object if k == "comm_id" else np.int64)
            for k, v in rows.items()}


def run_normal(state: MycroftTriggerState, windows: int = 4,
               ranks: Sequence[int] = (3, 7)) -> None:
    for w in range(windows):
        assert mycroft_trigger(state, ops_window(ranks, w * 10 * S, (w + 1) * 10 * S),
                               (w + 1) * 10 * S) == []


def test_failure_when_no_op_completes_in_delta_and_fires_once():
    st = MycroftTriggerState("j", np.array([3, 7]))
    run_normal(st)
    t = 40 * S
    # rank 7 keeps going; rank 3 gets stuck in an op at t
    w = ops_window([7], t, t + 5 * S)
    stuck = ops_window([], t, t, inflight=[3])
    merged = {k: np.concatenate([w[k], stuck[k]]) for k in w}
    assert mycroft_trigger(st, merged, t + 5 * S) == []  # 5.08 s since rank 3's last op: < Δ
    out = mycroft_trigger(st, ops_window([7], t + 5 * S, t + 20 * S), t + 20 * S)
    assert [(x.kind, x.ranks) for x in out] == [("failure", (3,))]
    assert out[0].ts == t + 20 * S
    assert out[0].evidence["in_flight"] == [{"rank": 3, "comm_id": "dp:pp0:tp0", "op_seq": 10**6}]
    assert mycroft_trigger(st, ops_window([7], t + 20 * S, t + 30 * S), t + 30 * S) == []
    # recovery re-arms
    mycroft_trigger(st, ops_window([3, 7], t + 30 * S, t + 40 * S), t + 40 * S)
    assert not st.failing.any()


def test_straggler_when_interval_doubles_or_throughput_halves():
    st = MycroftTriggerState("j", np.array([3, 7]))
    run_normal(st)
    t = 40 * S
    slow = ops_window([3], t, t + 10 * S, period=250 * MS)  # interval ×2.5
    fast = ops_window([7], t, t + 10 * S)
    out = mycroft_trigger(st, {k: np.concatenate([slow[k], fast[k]]) for k in slow}, t + 10 * S)
    assert [(x.kind, x.ranks) for x in out] == [("straggler", (3,))]
    base = st.itv_base[0]
    # the triggering window did not move the baseline; a second slow window does not re-fire
    slow = ops_window([3], t + 10 * S, t + 20 * S, period=250 * MS)
    fast = ops_window([7], t + 10 * S, t + 20 * S)
    out = mycroft_trigger(st, {k: np.concatenate([slow[k], fast[k]]) for k in slow}, t + 20 * S)
    assert out == [] and st.itv_base[0] == base
    # throughput halving alone (same interval, ops take 3× longer)
    st2 = MycroftTriggerState("j", np.array([1]))
    run_normal(st2, ranks=(1,))
    out = mycroft_trigger(st2, ops_window([1], t, t + 10 * S, dur=60 * MS), t + 10 * S)
    assert [(x.kind, x.ranks) for x in out] == [("straggler", (1,))]


def test_no_trigger_during_warmup_or_for_unsampled_ranks():
    st = MycroftTriggerState("j", np.array([3]), MycroftTriggerConfig(warmup_windows=3))
    out = mycroft_trigger(st, ops_window([3, 9], 0, 10 * S, period=50 * MS), 10 * S)
    out += mycroft_trigger(st, ops_window([3, 9], 10 * S, 20 * S, period=400 * MS), 20 * S)
    assert out == []


def test_resample_keeps_baselines_of_retained_ranks():
    st = MycroftTriggerState("j", np.array([3, 7]))
    run_normal(st)
    new = st.resample(np.array([7, 11]))
    assert new.ranks.tolist() == [7, 11]
    assert new.itv_base[0] == st.itv_base[1] and np.isnan(new.itv_base[1])
