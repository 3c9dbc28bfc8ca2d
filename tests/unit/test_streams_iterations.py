"""Iteration rows from simulator records: stage records, the DP-collective rule, comm time."""

from __future__ import annotations

import numpy as np
import pytest

from ingest.records import comm_kind_codes
from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect
from ingest.units import SECOND as SEC
from streams.iterations import (
    KIND_CODES,
    OpFrame,
    iteration_rows,
    union_length,
)


@pytest.fixture(scope="module")
def sim_tables() -> dict[str, dict[str, np.ndarray]]:
    cfg = JobConfig(tp=2, pp=2, dp=2, steps=12, microbatches=4, seed=3)
    return collect(Simulation(cfg).batches())


def frame(ops: dict[str, np.ndarray]) -> OpFrame:
    kind = comm_kind_codes(ops["comm_id"], {})
    grad = (kind == KIND_CODES["dp"]) & np.isin(ops["op"], ["AllReduce", "ReduceScatter"])
    return OpFrame(ops["rank"], kind, grad, ops["op_seq"], ops["step"], ops["bytes"],
                   ops["t_start"], ops["t_end"])


def no_stages() -> dict[str, np.ndarray]:
    return {k: np.zeros(0, np.int64) for k in ("rank", "step", "t_start", "data_next_wait",
                                               "model_fwd_loss", "model_backward", "callbacks",
                                               "optim_step", "step_other")}


def test_union_length_counts_overlaps_once() -> None:
    g = np.array([0, 0, 0, 1, 1])
    s = np.array([0, 5, 20, 100, 100])
    e = np.array([10, 8, 30, 150, 120])
    assert union_length(g, s, e, 3).tolist() == [20, 50, 0]


def _union_brute(g: np.ndarray, s: np.ndarray, e: np.ndarray, n: int) -> list[int]:
    out = []
    for k in range(n):
        spans = sorted(zip(s[g == k].tolist(), e[g == k].tolist(), strict=True))
        total, reach = 0, None
        for a, b in spans:
            lo = a if reach is None else max(a, reach)
            total += max(0, b - lo)
            reach = b if reach is None else max(reach, b)
        out.append(total)
    return out


@pytest.mark.parametrize("spread", [10_000, 1 << 62])  # packed argsort / lexsort fallback
def test_union_length_is_the_union_of_each_groups_intervals(spread: int) -> None:
    rng = np.random.default_rng(spread % 97)
    g = rng.integers(0, 40, 3000)
    s = rng.integers(0, spread // 2, 3000)
    s[0] = 0
    e = s + rng.integers(0, 500, 3000)
    assert union_length(g, s, e, 41).tolist() == _union_brute(g, s, e, 41)


def test_a_ranks_first_step_starts_at_its_first_op_in_frames_of_any_length(sim_tables) -> None:
    """The first step of each rank in a frame starts at its earliest op within max_step_ns before
    the step's end, both when (rank, time) fit one sortable key and when the frame is too long
    for it (an op far in the past)."""
    ops = sim_tables["ops"]
    rows = iteration_rows(no_stages(), frame(ops), 0, 1 << 62, max_step_ns=30 * SEC)
    far = {k: np.r_[v[:1], v] for k, v in ops.items()}
    far["t_start"][0] = int(ops["t_start"].min()) - (1 << 41)  # a stray op ~37 min earlier
    far["t_end"][0] = far["t_start"][0] + 1
    rows_far = iteration_rows(no_stages(), frame(far), 0, 1 << 62, max_step_ns=30 * SEC)
    first = np.r_[True, rows["rank"][1:] != rows["rank"][:-1]]
    starts = {int(r): int(ops["t_start"][ops["rank"] == r].min()) for r in rows["rank"][first]}
    assert rows["t_start"][first].tolist() == [starts[int(r)] for r in rows["rank"][first]]
    for c in ("rank", "step", "t_start", "t_end"):
        np.testing.assert_array_equal(rows[c], rows_far[c])


def test_rows_from_stage_records_match_the_simulator(sim_tables) -> None:
    st, ops = sim_tables["stages"], sim_tables["ops"]
    truth = st["t_start"] + sum(st[k] for k in ("data_next_wait", "model_fwd_loss",
                                                "model_backward", "callbacks", "optim_step",
                                                "step_other"))
    rows = iteration_rows(st, frame(ops), 0, 1 << 62, max_step_ns=30 * SEC)
    assert len(rows["rank"]) == len(st["rank"]) == 8 * 12
    assert set(rows["source"]) == {"stages"}
    order = np.lexsort((st["step"], st["rank"]))
    assert rows["t_end"].tolist() == truth[order].tolist()
    assert (rows["step_ns"] == truth[order] - st["t_start"][order]).all()
    # exposed comm + compute never exceed the step; dp comm is there on every step
    comm = rows["tp_comm_ns"] + rows["pp_comm_ns"] + rows["dp_comm_ns"]
    assert (rows["compute_ns"] + np.minimum(comm, rows["step_ns"]) >= rows["step_ns"] * 0.99).all()
    assert (rows["dp_comm_ns"] > 0).all() and (rows["tp_comm_ns"] > 0).all()
    assert (rows["ops"] > 0).all() and (rows["op_bytes"] > 0).all()


def test_steps_inferred_from_the_dp_collective_match_stage_step_times(sim_tables) -> None:
    st, ops = sim_tables["stages"], sim_tables["ops"]
    rows = iteration_rows(no_stages(), frame(ops), 0, 1 << 62, max_step_ns=30 * SEC)
    assert set(rows["source"]) == {"dp_collective"}
    assert set(rows["step_other"]) == {-1}
    # steps 1..: the span between consecutive DP gradient AllReduce ends is the step time
    by = {(r, s): (t0, t1) for r, s, t0, t1 in zip(rows["rank"], rows["step"], rows["t_start"],
                                                    rows["t_end"], strict=True)}
    stage_end = {(r, s): t0 + d for r, s, t0, d in zip(
        st["rank"], st["step"], st["t_start"],
        sum(st[k] for k in ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks",
                            "optim_step", "step_other")), strict=True)}
    steps = [(r, s) for (r, s) in by if s >= 1 and (r, s - 1) in by]
    assert len(steps) == 8 * 11
    inferred = np.array([by[k][1] - by[k][0] for k in steps])
    true = np.array([stage_end[k] - stage_end[(k[0], k[1] - 1)] for k in steps])
    # DP AllReduce ends before the optimizer and callbacks of its step: same period, shifted
    assert np.abs(inferred - true).max() < 0.1 * np.median(true)


def test_window_selects_steps_by_end_and_late_records_complete_a_step(sim_tables) -> None:
    st, ops = sim_tables["stages"], sim_tables["ops"]
    full = iteration_rows(st, frame(ops), 0, 1 << 62, max_step_ns=30 * SEC)
    mid = int(np.median(full["t_end"]))
    a = iteration_rows(st, frame(ops), 0, mid, max_step_ns=30 * SEC)
    b = iteration_rows(st, frame(ops), mid, 1 << 62, max_step_ns=30 * SEC)
    assert len(a["rank"]) + len(b["rank"]) == len(full["rank"])
    # out of order: shuffled input gives the same rows
    perm = np.random.default_rng(0).permutation(len(ops["rank"]))
    shuffled = iteration_rows(st, frame({k: v[perm] for k, v in ops.items()}), 0, 1 << 62,
                              max_step_ns=30 * SEC)
    for k in full:
        assert full[k].tolist() == shuffled[k].tolist(), k
    # a step whose stage record is missing falls back to the DP rule, then is replaced
    keep = ~((st["rank"] == 3) & (st["step"] == 5))
    partial = iteration_rows({k: v[keep] for k, v in st.items()}, frame(ops), 0, 1 << 62,
                             max_step_ns=30 * SEC)
    i = np.flatnonzero((partial["rank"] == 3) & (partial["step"] == 5))
    assert len(i) == 1 and partial["source"][i[0]] == "dp_collective"


def test_previews_keep_only_rows_known_exactly(sim_tables: dict[str, dict[str, np.ndarray]]
                                               ) -> None:
    ops, stages = sim_tables["ops"], sim_tables["stages"]
    lo = int(np.sort(stages["t_start"])[len(stages["t_start"]) // 2])  # a frame starting mid-run
    inside = ops["t_start"] >= lo
    part = {k: v[inside] for k, v in ops.items()}
    hi = int(ops["t_end"].max()) + 1
    full = iteration_rows(no_stages(), frame(ops), lo, hi, max_step_ns=60 * SEC)
    cut = iteration_rows(no_stages(), frame(part), lo, hi, max_step_ns=60 * SEC)
    prev = iteration_rows(no_stages(), frame(part), lo, hi, max_step_ns=60 * SEC, preview=True)
    truth = {(int(r), int(s)): int(d) for r, s, d in
             zip(full["rank"], full["step"], full["step_ns"], strict=True)}
    got = {(int(r), int(s)): int(d) for r, s, d in
           zip(prev["rank"], prev["step"], prev["step_ns"], strict=True)}
    assert got and len(got) < len(cut["rank"])  # each rank's first step in the frame is dropped
    assert all(truth[k] == d for k, d in got.items())  # what is previewed is exact
    st = {k: v[stages["t_start"] >= lo] for k, v in stages.items()}
    both = iteration_rows(st, frame(part), lo, hi, max_step_ns=60 * SEC, preview=True)
    assert set(both["source"]) == {"stages"}  # never the other source for a rank with stages
    # a frame whose stage records are not stored yet (the stages topic read behind the ops
    # topic): the ranks known to publish them get no row from their collectives either
    staged = np.unique(stages["rank"]).astype(np.int64)
    behind = iteration_rows(no_stages(), frame(part), lo, hi, max_step_ns=60 * SEC,
                            preview=True, staged=staged[1:])
    assert len(behind["rank"]) and set(behind["rank"].tolist()) == {int(staged[0])}


def test_rows_without_any_op_in_them_get_zero_communication() -> None:
    """A stage record on a rank whose ops are all outside its steps: no op is assigned to any
    row (the exposed-time sort gets nothing to sort)."""
    t = 10**18
    ops = OpFrame(np.array([0], np.int32), np.array([KIND_CODES["dp"]], np.int8),
                  np.array([False]), np.array([0]), np.array([0]), np.array([1]), np.array([t]),
                  np.array([t + 5]))
    st = {k: np.array([0]) for k in ("step", "model_fwd_loss", "model_backward", "callbacks",
                                      "optim_step", "step_other")}
    st.update(rank=np.array([1]), t_start=np.array([t]), data_next_wait=np.array([10]))
    rows = iteration_rows(st, ops, t - 100, t + 100, max_step_ns=SEC)
    assert rows["rank"].tolist() == [1] and rows["dp_comm_ns"].tolist() == [0]
    assert rows["compute_ns"].tolist() == [10] and rows["ops"].tolist() == [0]


def test_a_prior_step_end_makes_a_frames_first_step_exact(
        sim_tables: dict[str, dict[str, np.ndarray]]) -> None:
    """A preview frame that starts at the ranks' last known step ends (`prior`) instead of a
    step earlier: each rank's next step is then exact — bounds and communication columns equal
    those from the whole run — though the collective that ended the known step is not in it."""
    ops = sim_tables["ops"]
    hi = int(ops["t_end"].max()) + 1
    full = iteration_rows(no_stages(), frame(ops), 0, hi, max_step_ns=60 * SEC)
    mid = int(np.median(full["t_end"]))
    known = full["t_end"] < mid  # what earlier previews and windows knew
    last: dict[int, tuple[int, int]] = {}
    for r, st, e in zip(full["rank"][known], full["step"][known], full["t_end"][known],
                        strict=True):
        if int(st) > last.get(int(r), (-1, 0))[0]:
            last[int(r)] = (int(st), int(e))
    ranks = np.array(sorted(last), np.int64)
    prior = (ranks, np.array([last[r][0] for r in ranks]), np.array([last[r][1] for r in ranks]))
    lo = int(prior[2].min())
    part = {k: v[ops["t_start"] >= lo] for k, v in ops.items()}
    without = iteration_rows(no_stages(), frame(part), mid, hi, max_step_ns=60 * SEC,
                             preview=True)
    got = iteration_rows(no_stages(), frame(part), mid, hi, max_step_ns=60 * SEC, preview=True,
                         prior=prior)
    key = {(int(r), int(s)): i for i, (r, s) in enumerate(zip(full["rank"], full["step"],
                                                               strict=True))}
    names = ("t_start", "t_end", "step_ns", "compute_ns", "tp_comm_ns", "pp_comm_ns",
             "dp_comm_ns", "ops", "op_bytes")
    assert len(got["rank"]) > len(without["rank"])  # the prior previews the next steps
    for i, (r, s) in enumerate(zip(got["rank"], got["step"], strict=True)):
        j = key[(int(r), int(s))]
        assert all(int(got[n][i]) == int(full[n][j]) for n in names), (r, s)
    # a prior that is not the previous step (a step missing in between) changes nothing
    stale = (prior[0], prior[1] - 1, prior[2])
    same = iteration_rows(no_stages(), frame(part), mid, hi, max_step_ns=60 * SEC,
                          preview=True, prior=stale)
    assert len(same["rank"]) == len(without["rank"])


def test_op_bytes_the_contract_allows_saturate_instead_of_wrapping(sim_tables) -> None:
    """Calls of 2^62 bytes (the contract allows any int64): a step's byte sum stays at 2^62
    instead of casting past int64 to its minimum."""
    st, ops = sim_tables["stages"], dict(sim_tables["ops"])
    ops["bytes"] = np.full(ops["bytes"].size, 1 << 62, dtype=np.int64)
    rows = iteration_rows(st, frame(ops), 0, 1 << 62, max_step_ns=30 * SEC)
    assert (rows["op_bytes"] == 1 << 62).all()
