"""Mycroft's straggler test (Alg. 1, lines 6-9) on the progress feed (`rw.progress`).

What the paper specifies (Mycroft §4.3, Alg. 1): every evaluation at time t reads the sampled
ranks' log of (t − Δ, t]; if no collective completed → failure (lines 3-4); else "if throughput
drops by half or Coll Op interval doubles in log" → straggler trigger with the abnormal ip
(lines 6-8); otherwise "update normal throughput and Coll Op interval" (line 9). §4.3 and §9 add
only that the ratios (½, 2×) are from experience and configurable; the paper defines neither the
measures nor the normal values, nor how often a straggler fires.

The real pipeline hands the trigger agent one progress row per (rank, comm_id) and 1 s window
(streams/progress.py: completed_ops, bytes_per_s, op_interval_ns, ...), not ops. A DP all-reduce
completes about once per step, so one window holds 0, 1 or 2 of them: per-window ratios are
noise, and an empty window is not "throughput 0". `mycroft.mycroft_trigger` needs ≥ 3
completions per rank and window and never fires on this feed; this module does the test there.

Per sampled (rank, comm_id) — a "key" — the state keeps the last `ring` windows (completions,
bytes) and (our choices, beyond the paper):
- recent measure, taken each time the key completes something (its newest window with a
  completion, L, advances): over a span of T ≥ max(`min_span_ns`, `span_steps` × expected step
  time, `span_ops` × baseline op interval), i.e. at least one step and several completions,
  extended back to the last window with a completion P before L − T, so the span runs from a
  completion to a completion: op interval = (L − P) / completions in (P, L], throughput = bytes
  completed in (P, L] / (L − P). Windows with no completion only lengthen the span; they never
  read as throughput 0, and a span is only read when it ends at a completion.
- baseline ("normal throughput and op interval", line 9): a bias-corrected EWMA (weight `ewma`
  per window) of the windows' completion rate and bytes/s, fed with each window once it has left
  the recent span (so a slowdown is never compared with itself), zero-completion windows
  included (they are samples of a rate), not fed while the key is straggling. Warm-up: no test
  until `warmup_windows` windows and `warmup_ops` completions are in the baseline.
- test (lines 6-8): throughput ≤ `throughput_drop` × baseline or op interval ≥
  `interval_growth` × baseline → the key straggles; one `straggler` Trigger per evaluation
  naming the ranks that newly straggle, once per episode of a rank (a rank straggles while any
  of its keys does; a second comm of a straggling rank slowing down fires nothing). Re-armed
  after recovery: a key recovers on a measure with throughput > `recover` × baseline and
  interval < baseline / `recover` (hysteresis, so a value near the threshold does not flap).
- failure stays with the failure path: a key silent for longer than max(Δ, `stall_intervals` ×
  baseline interval) is stalled (Alg. 1 line 3: `mycroft_trigger` and the heartbeat hang trigger
  report it); the gap is neither measured nor learned, and after it the key is not tested until
  a whole span has passed since it resumed. A hang therefore never reads as a straggler, nor does
  the catch-up after a transient one. The same rule covers a job's start (first span).

Throughput here is bytes completed per second of wall time (the feed's bytes_per_s), not busy
bandwidth; a key whose ops carry no bytes is tested on its interval only. Inputs are progress
rows (window_end, rank, comm_id, completed_ops, bytes_per_s; other columns ignored) of any
order and repetition (a recomputed window replaces its earlier row); the clock is the explicit
`now_ns`. Cost per call: O(rows + keys × ring) numpy, ≤ 10 sampled ranks × their comms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diagnosis.columns import Columns, col, ints
from diagnosis.triggers.base import Trigger
from ingest.units import SECOND

Array = np.ndarray


@dataclass(frozen=True)
class ProgressStragglerConfig:
    window_ns: int = SECOND  # the progress feed's window (streams.progress.ProgressParams)
    throughput_drop: float = 0.5  # Alg. 1 line 6: "throughput drops by half"
    interval_growth: float = 2.0  # Alg. 1 line 6: "Coll Op interval doubles"
    recover: float = 0.75
    span_steps: float = 3.0
    span_ops: float = 4.0
    min_span_ns: int = 3 * SECOND
    ring: int = 64  # windows kept per key; the span is at most ring // 2
    ewma: float = 0.05  # per window
    warmup_windows: int = 8
    warmup_ops: int = 8
    stall_intervals: float = 4.0


@dataclass
class ProgressStragglerState:
    """Per-key memory (keys = (rank, comm_id) in order of first sight)."""

    job_id: str
    config: ProgressStragglerConfig = field(default_factory=ProgressStragglerConfig)
    index: dict[tuple[int, str], int] = field(default_factory=dict)
    rank: Array = field(default_factory=lambda: np.zeros(0, np.int64))
    comm: list[str] = field(default_factory=list)
    we: Array = field(init=False)  # (keys, ring) window_end per slot, 0 = empty
    done: Array = field(init=False)  # completions
    nbytes: Array = field(init=False)  # bytes completed
    last_done: Array = field(init=False)  # newest window_end with a completion (L)
    evaluated: Array = field(init=False)  # L at the last evaluation
    resume: Array = field(init=False)  # windows ending ≤ this are before a stall / the start
    folded: Array = field(init=False)  # baseline holds the windows ending ≤ this
    stalled: Array = field(init=False)
    straggling: Array = field(init=False)
    b_rate: Array = field(init=False)  # EWMA numerators: completions / window, bytes / window
    b_bytes: Array = field(init=False)
    b_w: Array = field(init=False)  # EWMA weight sum (bias correction)
    b_windows: Array = field(init=False)
    b_ops: Array = field(init=False)

    def __post_init__(self) -> None:
        r = self.config.ring
        self.we = np.zeros((0, r), np.int64)
        self.done = np.zeros((0, r), np.int64)
        self.nbytes = np.zeros((0, r), np.float64)
        for name in ("last_done", "evaluated", "resume", "folded", "b_windows", "b_ops"):
            setattr(self, name, np.zeros(0, np.int64))
        for name in ("b_rate", "b_bytes", "b_w"):
            setattr(self, name, np.zeros(0, np.float64))
        self.stalled = np.zeros(0, bool)
        self.straggling = np.zeros(0, bool)

    def keys_of(self, rank: Array, comm: Array) -> Array:
        """Key index per row, adding new keys."""
        out = np.empty(rank.size, np.int64)
        new = 0
        for i, (r, c) in enumerate(zip(rank.tolist(), comm.tolist(), strict=True)):
            k = (int(r), str(c))
            j = self.index.get(k)
            if j is None:
                j = self.index[k] = len(self.index)
                self.comm.append(k[1])
                new += 1
            out[i] = j
        if new:
            self._grow(new)
            self.rank = np.asarray([k[0] for k in self.index], np.int64)
        return out

    def _grow(self, n: int) -> None:
        r = self.config.ring
        self.we = np.vstack([self.we, np.zeros((n, r), np.int64)])
        self.done = np.vstack([self.done, np.zeros((n, r), np.int64)])
        self.nbytes = np.vstack([self.nbytes, np.zeros((n, r), np.float64)])
        for name in ("last_done", "evaluated", "folded", "b_windows", "b_ops"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n, np.int64)]))
        self.resume = np.concatenate([self.resume, np.full(n, -1, np.int64)])
        for name in ("b_rate", "b_bytes", "b_w"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n)]))
        self.stalled = np.concatenate([self.stalled, np.zeros(n, bool)])
        self.straggling = np.concatenate([self.straggling, np.zeros(n, bool)])

    def baseline(self) -> tuple[Array, Array, Array]:
        """(ready, throughput bytes/s, op interval ns) per key."""
        cfg = self.config
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(self.b_w > 0, self.b_rate / self.b_w, np.nan)  # per window
            thr = np.where(self.b_w > 0, self.b_bytes / self.b_w, np.nan) * SECOND / cfg.window_ns
            itv = np.where(rate > 0, cfg.window_ns / rate, np.nan)
        ready = (self.b_windows >= cfg.warmup_windows) & (self.b_ops >= cfg.warmup_ops) & (rate > 0)
        return ready, thr, itv


def _store(st: ProgressStragglerState, key: Array, we: Array, done: Array, nbytes: Array) -> None:
    """Put rows in their ring slots; a slot keeps the newest window (a recomputed window's row
    replaces the old one, a row older than the slot's window is dropped)."""
    w = st.config.window_ns
    slot = (we // w) % st.config.ring
    order = np.lexsort((we, key))  # per key ascending window: the last write wins
    key, we, slot, done, nbytes = key[order], we[order], slot[order], done[order], nbytes[order]
    ok = we >= st.we[key, slot]
    st.we[key[ok], slot[ok]] = we[ok]
    st.done[key[ok], slot[ok]] = done[ok]
    st.nbytes[key[ok], slot[ok]] = nbytes[ok]


def _span_windows(st: ProgressStragglerState, step_ns: float | None, itv_base: Array) -> Array:
    cfg = st.config
    span = np.full(st.rank.size, float(cfg.min_span_ns))
    if step_ns:
        span = np.maximum(span, cfg.span_steps * step_ns)
    span = np.fmax(span, cfg.span_ops * itv_base)
    n = np.ceil(span / cfg.window_ns).astype(np.int64)
    return np.asarray(np.clip(n, 1, cfg.ring // 2), dtype=np.int64)


def _fold(st: ProgressStragglerState, upto: Array, keys: Array) -> None:
    """Feed windows in (folded, upto] (after `resume`) of `keys` into the EWMA baseline."""
    cfg = st.config
    w, a = cfg.window_ns, cfg.ewma
    we = st.we[keys]
    lo = np.maximum(st.folded[keys], st.resume[keys])[:, None]
    hi = upto[keys][:, None]
    sel = (we > lo) & (we <= hi)
    # decay by elapsed windows; a window that never arrived adds no weight (bias correction)
    steps = np.where(st.folded[keys] > 0, np.maximum((hi[:, 0] - st.folded[keys]) // w, 0), 0)
    decay = (1.0 - a) ** steps
    age = np.where(sel, (hi - we) // w, 0)
    wt = np.where(sel, a * (1.0 - a) ** age, 0.0)
    follow = ~st.straggling[keys]  # a straggling key's windows are not normal (Alg. 1 line 9)
    upd = follow & (sel.any(axis=1) | (st.folded[keys] > 0))
    k = keys[upd]
    st.b_rate[k] = decay[upd] * st.b_rate[k] + (wt * st.done[keys])[upd].sum(axis=1)
    st.b_bytes[k] = decay[upd] * st.b_bytes[k] + (wt * st.nbytes[keys])[upd].sum(axis=1)
    st.b_w[k] = decay[upd] * st.b_w[k] + wt[upd].sum(axis=1)
    st.b_windows[k] += sel[upd].sum(axis=1)
    st.b_ops[k] += np.where(sel, st.done[keys], 0)[upd].sum(axis=1)
    st.folded[keys] = np.maximum(st.folded[keys], upto[keys])


def progress_straggler_trigger(st: ProgressStragglerState, progress: Columns, now_ns: int, *,
                               step_ns: float | None = None,
                               delta_ns: int = 10 * SECOND) -> list[Trigger]:
    """Fold progress rows in and run the straggler test at `now_ns` (module docstring).
    `step_ns`: the job's expected step time if known; `delta_ns`: the failure test's Δ."""
    cfg = st.config
    w = cfg.window_ns
    if progress and "rank" in progress and len(progress["rank"]):
        we = ints(progress, "window_end")
        key = st.keys_of(ints(progress, "rank"), col(progress, "comm_id", ""))
        done = np.maximum(ints(progress, "completed_ops", 0), 0)
        nbytes = np.maximum(col(progress, "bytes_per_s", 0).astype(np.float64), 0.0) * w / SECOND
        _store(st, key, we, done, nbytes)
        new_l = st.last_done.copy()
        np.maximum.at(new_l, key[done > 0], we[done > 0])
        first = np.full(st.rank.size, np.iinfo(np.int64).max)
        np.minimum.at(first, key, we)
        fresh = st.resume < 0
        st.resume[fresh] = first[fresh] - w  # a key's first span starts with its first window
    else:
        new_l = st.last_done
    n = st.rank.size
    if n == 0:
        return []
    ready, thr_b, itv_b = st.baseline()
    stall_ns = np.fmax(float(delta_ns), cfg.stall_intervals * itv_b)
    # silence longer than the stall limit, seen live (now) or inside one burst of rows (gap)
    gap = np.where(st.last_done > 0, new_l - st.last_done - w, 0)
    quiet = now_ns - np.where(st.last_done > 0, st.last_done, np.maximum(st.resume, 0) + w)
    st.stalled |= (quiet > stall_ns) & (new_l == st.last_done)
    resumed = (new_l > st.last_done) & (st.stalled | (gap > stall_ns))
    st.resume[resumed] = new_l[resumed] - w
    st.folded[resumed] = np.maximum(st.folded[resumed], new_l[resumed] - w)
    st.stalled[resumed] = False
    st.straggling[resumed] = False  # a stall is a new episode (the failure path had it)
    st.last_done = new_l

    span = _span_windows(st, step_ns, itv_b) * w
    due = np.flatnonzero((st.last_done > st.evaluated) & (st.last_done - span >= st.resume)
                         & ~st.stalled)
    if due.size == 0:
        return []
    st.evaluated[due] = st.last_done[due]
    L = st.last_done
    _fold(st, L - span, due)
    ready, thr_b, itv_b = st.baseline()

    we = st.we[due]
    lo_edge = (L - span)[due][:, None]
    older = (we > st.resume[due][:, None]) & (we <= lo_edge) & (st.done[due] > 0) \
        & (we > (L[due] - cfg.ring * w)[:, None])
    p = np.where(older.any(axis=1), np.where(older, we, 0).max(axis=1), lo_edge[:, 0])
    inside = (we > p[:, None]) & (we <= L[due][:, None])
    c = np.where(inside, st.done[due], 0).sum(axis=1)
    b = np.where(inside, st.nbytes[due], 0.0).sum(axis=1)
    dur = (L[due] - p).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        itv = np.where(c > 0, dur / c, np.inf)
        thr = b / dur * SECOND
    tb, ib, rd = thr_b[due], itv_b[due], ready[due]
    with np.errstate(invalid="ignore"):
        has_bytes = tb > 0
        slow = rd & ((has_bytes & (thr <= cfg.throughput_drop * tb))
                     | (itv >= cfg.interval_growth * ib))
        fine = rd & (~has_bytes | (thr > cfg.recover * tb)) & (itv < ib / cfg.recover)
    was = st.straggling[due]
    rank_was = np.isin(st.rank[due], st.rank[st.straggling])  # one episode per rank
    new = slow & ~rank_was
    st.straggling[due] = slow | (was & ~fine)
    if not new.any():
        return []
    hit = np.flatnonzero(new)
    ranks = tuple(sorted({int(st.rank[due[i]]) for i in hit}))
    comms = [{"rank": int(st.rank[due[i]]), "comm_id": st.comm[int(due[i])],
              "throughput_Bps": _r(thr[i]), "throughput_base_Bps": _r(tb[i]),
              "interval_ns": _r(itv[i]), "interval_base_ns": _r(ib[i]),
              "span_ns": int(dur[i]), "ops_in_span": int(c[i])} for i in hit]
    return [Trigger(st.job_id, now_ns, "straggler", ranks, {
        "rule": "mycroft.alg1.progress", "comms": comms,
        "thresholds": {"throughput_drop": cfg.throughput_drop,
                       "interval_growth": cfg.interval_growth, "recover": cfg.recover}})]


def _r(x: float) -> float | None:
    return None if not np.isfinite(x) else round(float(x), 3)
