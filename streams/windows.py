"""Event-time windows per job: watermarks, which windows are due, late marks, and checkpoints.

Pure bookkeeping, no I/O (the derived runner, streams/derived.py, does the I/O). Windows are
aligned to multiples of their width in absolute ns (`[k·W, (k+1)·W)`), so every worker and every
restart cuts the same windows.

Contract:
- `observe(job, t_min, t_max)` is called with the event-time range of every raw batch *after* it
  is durable in ClickHouse. The job's watermark is the largest event time seen minus the
  allowed lateness; a window `[s, s+W)` is due once `s + W <= watermark`.
- A derived kind's windows close in order: `next_start` is the first window not yet closed, and
  starts at the window holding the first event seen for the job.
- A batch whose events fall before `next_start` of a kind that asked for late marks
  (`late_kinds`) marks the closed windows it touches (extended by `reach_ns` forward: a late op
  changes the step it belongs to, which may end in the next window) for recomputation; marks
  further back than `max_late_windows` windows are dropped and counted.
- State per job is O(kinds + late marks): no events are held here, and nothing grows with the
  length of the run. `checkpoint()` / `restore()` carry it across restarts (the `stream_state`
  table); see docs/architecture.md, "Derived streams".
"""

from __future__ import annotations

from dataclasses import dataclass, field


def window_start(t_ns: int, width_ns: int) -> int:
    """Start of the aligned window holding `t_ns`."""
    return (t_ns // width_ns) * width_ns


@dataclass(frozen=True)
class WindowSpec:
    kind: str
    width_ns: int
    #: How far past its own time a late record can change a result (iterations: the longest step).
    reach_ns: int = 0
    late_marks: bool = False
    max_late_windows: int = 360


@dataclass
class KindState:
    next_start: int
    late: set[int] = field(default_factory=set)


@dataclass
class JobState:
    first_ns: int
    max_ns: int
    kinds: dict[str, KindState] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    """One row of `stream_state`: where a job's kind stands."""

    job_id: str
    kind: str
    next_start: int
    max_ns: int


class Windows:
    """Watermarks and due windows for every job the worker has seen; see the module docstring."""

    def __init__(self, specs: list[WindowSpec], lateness_ns: int) -> None:
        if lateness_ns < 0:
            raise ValueError(f"lateness_ns={lateness_ns} must be >= 0")
        for s in specs:
            if s.width_ns <= 0:
                raise ValueError(f"{s.kind}: width_ns={s.width_ns} must be > 0")
        self.specs = {s.kind: s for s in specs}
        self.lateness_ns = lateness_ns
        self.jobs: dict[str, JobState] = {}
        self.dropped_late = 0

    def observe(self, job: str, t_min: int, t_max: int) -> None:
        """A durable batch of `job` with event times in [t_min, t_max] (ns; 0 = unknown)."""
        if t_max <= 0:
            return
        t_min = t_min if t_min > 0 else t_max
        st = self.jobs.get(job)
        if st is None:
            st = self.jobs[job] = JobState(t_min, t_max)
        st.first_ns = min(st.first_ns, t_min)
        st.max_ns = max(st.max_ns, t_max)
        for kind, spec in self.specs.items():
            ks = self._kind(st, kind)
            if t_min < ks.next_start and spec.late_marks:
                self._mark_late(ks, spec, t_min, t_max)

    def _kind(self, st: JobState, kind: str) -> KindState:
        ks = st.kinds.get(kind)
        if ks is None:
            ks = st.kinds[kind] = KindState(window_start(st.first_ns, self.specs[kind].width_ns))
        return ks

    def _mark_late(self, ks: KindState, spec: WindowSpec, t_min: int, t_max: int) -> None:
        w = spec.width_ns
        oldest = ks.next_start - spec.max_late_windows * w
        last = min(window_start(t_max + spec.reach_ns, w), ks.next_start - w)
        first = window_start(t_min, w)
        if first < oldest:
            self.dropped_late += (min(last, oldest - w) - first) // w + 1
            first = oldest
        ks.late.update(range(first, last + 1, w))

    def watermark(self, job: str) -> int:
        st = self.jobs.get(job)
        return -1 if st is None else st.max_ns - self.lateness_ns

    def due(self, job: str, kind: str, limit: int = 64) -> list[int]:
        """Starts of windows of `kind` ready to close, oldest first, at most `limit`."""
        st = self.jobs.get(job)
        if st is None:
            return []
        ks = self._kind(st, kind)
        w = self.specs[kind].width_ns
        wm = st.max_ns - self.lateness_ns
        n = max(0, min(limit, (wm - ks.next_start) // w))
        return [ks.next_start + i * w for i in range(n)]

    def late(self, job: str, kind: str, limit: int = 64) -> list[int]:
        """Closed windows marked for recomputation, oldest first (they stay marked until
        `recomputed`)."""
        st = self.jobs.get(job)
        if st is None or kind not in st.kinds:
            return []
        return sorted(st.kinds[kind].late)[:limit]

    def closed(self, job: str, kind: str, start: int) -> None:
        """Window `start` of `kind` is durable: the next one is due next."""
        ks = self._kind(self.jobs[job], kind)
        if start != ks.next_start:
            raise ValueError(f"{job}/{kind}: closing {start} but the next window is "
                             f"{ks.next_start}")
        ks.next_start = start + self.specs[kind].width_ns

    def recomputed(self, job: str, kind: str, start: int) -> None:
        self.jobs[job].kinds[kind].late.discard(start)

    def checkpoint(self, job: str) -> list[Checkpoint]:
        st = self.jobs[job]
        return [Checkpoint(job, k, ks.next_start, st.max_ns) for k, ks in st.kinds.items()]

    def restore(self, rows: list[Checkpoint]) -> None:
        """Resume from stored checkpoints (before any batch is observed)."""
        for r in rows:
            if r.kind not in self.specs:
                continue
            st = self.jobs.get(r.job_id)
            if st is None:
                st = self.jobs[r.job_id] = JobState(r.next_start, r.max_ns)
            st.max_ns = max(st.max_ns, r.max_ns)
            st.first_ns = min(st.first_ns, r.next_start)
            st.kinds[r.kind] = KindState(r.next_start)
