"""Mycroft's trigger mechanism (Mycroft §4.3, Alg. 1) over the op feed of the sampled ranks.

Alg. 1, per sampled rank, every evaluation at time t over the log of (t − Δ, t]:
- no collective op completed in the window → *failure* trigger (line 3-4);
- else, throughput dropped by half or the interval between ops doubled against the rank's normal
  values → *straggler* trigger (line 6-8);
- otherwise the normal throughput and op interval are updated (line 9).

Inputs are op rows (ingest.records.Op columns: rank, bytes, t_start, t_end; comm_id and op_seq
for evidence) of the sampled ranks, handed over window by window; the state remembers what it
needs, so windows may be shorter than Δ and rows may repeat (an in-flight row, then its
completion). Time is the explicit `now_ns`; nothing reads a clock.

Definitions and thresholds (the paper gives the ratios, not the measures):
- throughput of a window = Σ bytes / Σ (t_end − t_start) over ops completed in it (busy
  bandwidth, same-host clock); op interval = mean gap between consecutive completions. Both need
  at least `min_ops` completions in the window, else the window is not measured. Mixed op sizes
  are fine as long as a window spans several steps (Mycroft evaluates every 10 s).
- normal values are an EWMA (weight `ewma`) of measured windows that did not trigger, available
  after `warmup_windows` measured windows (the first steps of a job are not "normal").
- failure uses the time since the rank's last completion (`now_ns − last_end > Δ`) rather than a
  per-window count, so late rows cannot cause a false failure; a rank that never completed an op
  fails only if an op of it has been in flight for longer than Δ (it is stuck, not idle).
- each trigger fires once per episode: a failing rank re-arms when it completes an op again, a
  straggling rank when a window measures normal again. The caller (the agent) keeps incidents.

Better than the paper: the ratio tests ignore windows with too few ops (noise), and the baseline is
never updated by a window that triggered, so a slow drift into straggling is still caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diagnosis.columns import Columns, col, ints
from diagnosis.triggers.base import Trigger
from ingest.units import SECOND

Array = np.ndarray


@dataclass(frozen=True)
class MycroftTriggerConfig:
    delta_ns: int = 10 * SECOND  # Δ: Mycroft runs detection every 10 s
    throughput_drop: float = 0.5  # "throughput drops by half"
    interval_growth: float = 2.0  # "Coll Op interval doubles"
    min_ops: int = 3
    warmup_windows: int = 2
    ewma: float = 0.2


@dataclass
class MycroftTriggerState:
    """Per-sampled-rank memory of Alg. 1 (arrays aligned with `ranks`, ascending)."""

    job_id: str
    ranks: Array
    config: MycroftTriggerConfig = field(default_factory=MycroftTriggerConfig)
    last_now_ns: int = 0
    last_end_ns: Array = field(init=False)
    first_inflight_ns: Array = field(init=False)
    thr_base: Array = field(init=False)
    itv_base: Array = field(init=False)
    measured: Array = field(init=False)
    failing: Array = field(init=False)
    straggling: Array = field(init=False)
    in_flight: dict[int, tuple[str, int]] = field(init=False)  # rank -> (comm_id, op_seq)

    def __post_init__(self) -> None:
        self.ranks = np.unique(np.asarray(self.ranks, dtype=np.int64))
        n = self.ranks.size
        self.last_end_ns = np.zeros(n, dtype=np.int64)
        self.first_inflight_ns = np.zeros(n, dtype=np.int64)
        self.thr_base = np.full(n, np.nan)
        self.itv_base = np.full(n, np.nan)
        self.measured = np.zeros(n, dtype=np.int64)
        self.failing = np.zeros(n, dtype=bool)
        self.straggling = np.zeros(n, dtype=bool)
        self.in_flight = {}

    def resample(self, ranks: Array) -> MycroftTriggerState:
        """A state for a new sample that keeps what it knew about ranks still sampled."""
        new = MycroftTriggerState(self.job_id, np.asarray(ranks), self.config, self.last_now_ns)
        keep, old = locate(self.ranks, new.ranks)
        for name in ("last_end_ns", "first_inflight_ns", "thr_base", "itv_base", "measured",
                     "failing", "straggling"):
            arr = getattr(new, name)
            arr[keep] = getattr(self, name)[old]
        return new


def locate(sorted_ranks: Array, rank: Array) -> tuple[Array, Array]:
    """(mask of `rank` entries present in `sorted_ranks`, their positions there)."""
    if sorted_ranks.size == 0:
        return np.zeros(rank.size, dtype=bool), np.zeros(0, dtype=np.int64)
    pos = np.minimum(np.searchsorted(sorted_ranks, rank), sorted_ranks.size - 1)
    mine = sorted_ranks[pos] == rank
    return mine, pos[mine].astype(np.int64)


def _window_measures(state: MycroftTriggerState, idx: Array, t_start: Array, t_end: Array,
                     nbytes: Array, now_ns: int) -> tuple[Array, Array, Array]:
    n = state.ranks.size
    new = (t_end > state.last_now_ns) & (t_end <= now_ns) & (t_end >= t_start)
    i = idx[new]
    count = np.bincount(i, minlength=n)
    busy = np.bincount(i, weights=(t_end[new] - t_start[new]).astype(np.float64), minlength=n)
    sent = np.bincount(i, weights=nbytes[new].astype(np.float64), minlength=n)
    lo = np.full(n, np.inf)
    hi = np.full(n, -np.inf)
    np.minimum.at(lo, i, t_end[new].astype(np.float64))
    np.maximum.at(hi, i, t_end[new].astype(np.float64))
    ok = count >= state.config.min_ops
    with np.errstate(divide="ignore", invalid="ignore"):
        thr = np.where(ok & (busy > 0), sent / busy, np.nan)
        itv = np.where(ok, (hi - lo) / np.maximum(count - 1, 1), np.nan)
    return count, thr, itv


def mycroft_trigger(state: MycroftTriggerState, ops: Columns, now_ns: int) -> list[Trigger]:
    """Evaluate Alg. 1 at `now_ns` over new op rows of the sampled ranks; updates `state`."""
    cfg = state.config
    mine, idx = locate(state.ranks, ints(ops, "rank"))
    t_start, t_end = ints(ops, "t_start")[mine], ints(ops, "t_end")[mine]
    nbytes = ints(ops, "bytes", 0)[mine]
    np.maximum.at(state.last_end_ns, idx, np.where(t_end <= now_ns, t_end, 0))
    inflight = t_end == 0
    first = np.full(state.ranks.size, np.iinfo(np.int64).max)
    np.minimum.at(first, idx[inflight], np.maximum(t_start[inflight], 1))
    seen = first < np.iinfo(np.int64).max
    done_since = state.last_end_ns >= state.first_inflight_ns
    state.first_inflight_ns = np.where(seen, first, np.where(done_since, 0,
                                                             state.first_inflight_ns))
    if inflight.any() and "comm_id" in ops and "op_seq" in ops:
        r = state.ranks[idx[inflight]]
        c = col(ops, "comm_id")[mine][inflight]
        q = ints(ops, "op_seq")[mine][inflight]
        for rr, cc, qq in zip(r.tolist(), c.tolist(), q.tolist(), strict=True):
            state.in_flight[int(rr)] = (str(cc), int(qq))
    for rr in state.ranks[state.first_inflight_ns == 0].tolist():
        state.in_flight.pop(int(rr), None)

    count, thr, itv = _window_measures(state, idx, t_start, t_end, nbytes, now_ns)
    since = np.where(state.last_end_ns > 0, now_ns - state.last_end_ns,
                     np.where(state.first_inflight_ns > 0, now_ns - state.first_inflight_ns, 0))
    stalled = since > cfg.delta_ns
    new_fail = stalled & ~state.failing
    state.failing = stalled

    base_ok = state.measured >= cfg.warmup_windows
    with np.errstate(invalid="ignore"):
        slow_thr = base_ok & (thr < cfg.throughput_drop * state.thr_base)
        slow_itv = base_ok & (itv > cfg.interval_growth * state.itv_base)
    slow = (slow_thr | slow_itv) & ~stalled
    normal = ~np.isnan(thr) & ~slow & ~stalled
    new_slow = slow & ~state.straggling
    state.straggling = np.where(normal, False, state.straggling | slow)
    a = cfg.ewma
    first_m = normal & (state.measured == 0)
    state.thr_base = np.where(first_m, thr, np.where(normal, (1 - a) * state.thr_base + a * thr,
                                                       state.thr_base))
    state.itv_base = np.where(first_m, itv, np.where(normal, (1 - a) * state.itv_base + a * itv,
                                                       state.itv_base))
    state.measured = state.measured + normal
    state.last_now_ns = max(state.last_now_ns, now_ns)

    out: list[Trigger] = []
    if new_fail.any():
        out.append(_failure(state, new_fail, since, now_ns))
    if new_slow.any():
        w = np.flatnonzero(new_slow)
        out.append(Trigger(state.job_id, now_ns, "straggler", tuple(int(r) for r in state.ranks[w]),
                           {"throughput_Bpns": _f(thr[w]), "throughput_base": _f(state.thr_base[w]),
                            "interval_ns": _f(itv[w]), "interval_base": _f(state.itv_base[w]),
                            "ops_in_window": count[w].tolist(), "rule": "mycroft.alg1",
                            "thresholds": {"throughput_drop": cfg.throughput_drop,
                                           "interval_growth": cfg.interval_growth}}))
    return out


def _f(a: Array) -> list[float | None]:
    return [None if np.isnan(x) else round(float(x), 6) for x in a]


def _failure(state: MycroftTriggerState, fire: Array, since: Array, now_ns: int) -> Trigger:
    w = np.flatnonzero(fire)
    ranks = tuple(int(r) for r in state.ranks[w])
    evidence: dict[str, object] = {
        "rule": "mycroft.alg1", "delta_ns": state.config.delta_ns,
        "ns_since_last_completion": since[w].tolist(),
        "last_end_ns": state.last_end_ns[w].tolist(),
        "in_flight": [{"rank": r, "comm_id": state.in_flight[r][0],
                       "op_seq": state.in_flight[r][1]} for r in ranks if r in state.in_flight],
    }
    return Trigger(state.job_id, now_ns, "failure", ranks, evidence)
