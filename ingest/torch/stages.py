"""StageFrontier's stage contract as context managers (StageFrontier §3, Appendix A).

    from ingest.torch import stages
    for batch_idx in range(n):
        with stages.step():                      # one logical step; closes the vector
            with stages.data():        batch = next(loader)        # data.next_wait
            with stages.fwd_loss():    loss = model(batch)         # model.fwd_loss
            with stages.backward():    loss.backward()             # model.backward
            with stages.callbacks():   log(loss)                   # callbacks
            with stages.optim():       opt.step()                  # optim.step

At the end of the step the rank writes one stage record: the five ordered spans (CPU wall time,
``perf_counter_ns``: rank-local and monotonic, no synchronized clocks) and ``step.other``, the
residual ``max(0, wall - Σ spans)``, so the vector sums to the step's wall time whenever the spans
do not overlap (StageFrontier's closure; a nested ordered span makes Σ exceed the wall and shows
as zero residual — the overlap error the labeler gates on). The data wait belongs to the step
that consumes the batch: call `data()` inside that step's `step()`.

Optional side channel: with ``cuda_sample=q`` (0 < q ≤ 1) every ⌈1/q⌉-th step records two CUDA
events around `fwd_loss` on the current stream and polls them (``Event.query``, never
``synchronize``) when the step closes; a ready pair gives ``device_ns``, otherwise -1 (missing).
It never enters the ordered vector.

CPU wait: a traced step also records ``sched_wait_ns``, the time its thread spent runnable but
waiting for a CPU between the step's start and end (Linux ``/proc/thread-self/schedstat``, read
at both; -1 where unreadable). A rank whose step got slower because other processes took its
CPU waits where it used to run; one whose work got slower does not (`diagnosis.slow.cpu`).
And ``cpu_pressure_ns``, the time during the step in which some runnable task of the host waited
for a CPU (Linux PSI, ``/proc/pressure/cpu``, its ``some`` total, read at both; -1 where the
kernel has no PSI): new demand on the host — a process that arrived and took CPUs — raises it,
while the scheduler moving the same threads between cores does not (`diagnosis.slow.context`,
`demand_rose`).

Position: entering and leaving a span or a step also publishes where the rank is — its step, the
stage it is inside (or none: between stages) and since when — in its ring's header
(`ingest.ring.RingWriter.position`); the host agent copies it into every `beats` row, so a rank
hung inside backward says so while its step never ends. A transition is one store of the
``perf_counter_ns`` the span reads anyway into that stage's entry word (or the "left" word); the
step start also stores the step and the realtime offset. No call, no lock, no allocation.
Entering a span with asynchronous calls outstanding first harvests their completions
(`Tracer.harvest`): a rank that stops in its optimizer has its backward's all-reduces recorded
complete, not left "in flight" while its peers wait in the next step's.

Every context manager is preallocated: entering and leaving allocates nothing but the ints.
Without an active tracer the spans still time (cheaply) and the position goes to a private
scratch array.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

from ingest.ring import POS_ENTER, POS_LEFT, POS_OFFSET, POS_STEP, POS_WORDS
from ingest.torch.events import STAGES

_perf = time.perf_counter_ns
_LEFT = POS_LEFT


def scratch_position() -> Any:
    """Position words nobody reads: where the position goes while no ring is attached."""
    return (ctypes.c_int64 * POS_WORDS)()


class _Span:
    __slots__ = ("acc", "i", "owner", "pos", "slot", "t0")

    def __init__(self, owner: StageClock, i: int) -> None:
        self.owner, self.acc, self.i, self.t0 = owner, owner.acc, i, 0
        self.pos, self.slot = owner.pos, POS_ENTER + i

    def __call__(self) -> _Span:
        return self

    def __enter__(self) -> _Span:
        tracer = self.owner.tracer
        if tracer is not None and tracer.outstanding:  # e.g. backward's all-reduces, now done
            tracer.harvest()
        self.t0 = self.pos[self.slot] = _perf()
        return self

    def __exit__(self, *exc: object) -> None:
        t = self.pos[_LEFT] = _perf()
        self.acc[self.i] += t - self.t0


class _FwdSpan(_Span):
    __slots__ = ()

    def __enter__(self) -> _Span:
        o = self.owner
        if o.tracer is not None and o.tracer.outstanding:
            o.tracer.harvest()
        if o.sample_every and o.step_index % o.sample_every == 0:
            o.cuda_begin()
        self.t0 = self.pos[self.slot] = _perf()
        return self

    def __exit__(self, *exc: object) -> None:
        t = self.pos[_LEFT] = _perf()
        self.acc[self.i] += t - self.t0
        if self.owner.events_armed:
            self.owner.cuda_end()


class _Step:
    __slots__ = ("owner", "p0", "t0", "tid", "u0", "w0")

    def __init__(self, owner: StageClock) -> None:
        self.owner, self.t0, self.p0, self.w0, self.u0, self.tid = owner, 0, 0, -1, -1, 0

    def __enter__(self) -> _Step:
        o = self.owner
        acc = o.acc
        acc[0] = acc[1] = acc[2] = acc[3] = acc[4] = 0
        o.events_armed = False
        tracer = o.tracer
        if tracer is not None:
            tracer.step = o.step_index
            if tracer.outstanding:
                tracer.harvest()
            self.tid = threading.get_ident()
            self.w0 = o.sched_wait(self.tid)
            self.u0 = o.cpu_pressure()
        self.t0 = t0 = time.time_ns()
        self.p0 = p0 = _perf()
        pos = o.pos
        pos[POS_OFFSET] = t0 - p0
        # the step first: a reader between these two stores sees the new step "between stages
        # since the last one was left", which is true
        pos[POS_STEP] = o.step_index
        pos[_LEFT] = p0
        return self

    def __exit__(self, *exc: object) -> None:
        o = self.owner
        p1 = o.pos[_LEFT] = _perf()
        wall = p1 - self.p0
        a = o.acc
        other = wall - (a[0] + a[1] + a[2] + a[3] + a[4])
        tracer = o.tracer
        if tracer is not None:
            device = o.cuda_poll() if o.events_armed else -1
            # a step left on another thread than it entered has no wait of one thread
            w1 = o.sched_wait(self.tid) if threading.get_ident() == self.tid else -1
            u1 = o.cpu_pressure()
            tracer.sink.stage(o.step_index, self.t0, a[0], a[1], a[2], a[3], a[4],
                              other if other > 0 else 0, device,
                              w1 - self.w0 if self.w0 >= 0 and w1 >= self.w0 else -1,
                              u1 - self.u0 if self.u0 >= 0 and u1 >= self.u0 else -1)
            if tracer.outstanding:
                tracer.harvest()
            gather = tracer.hosts
            if gather is not None and o.step_index in gather.POLL_STEPS and gather.poll():
                tracer.hosts = None
        o.step_index += 1


class StageClock:
    """One rank's stage timers; `ingest.torch` keeps the process-wide instance."""

    def __init__(self) -> None:
        self.acc = [0, 0, 0, 0, 0]
        self.tracer: Any = None
        self.step_index = 0
        self.sample_every = 0
        self.events_armed = False
        self._events: tuple[Any, Any] | None = None
        self.pos = scratch_position()
        self._sched: tuple[int, int] | None = None  # (thread ident, fd or -1)
        self._psi: int | None = None  # /proc/pressure/cpu's fd, -1 when unreadable
        self._step = _Step(self)
        self.spans = {name: (_FwdSpan if i == 1 else _Span)(self, i)
                      for i, name in enumerate(STAGES)}
        self.data = self.spans["data.next_wait"]
        self.fwd_loss = self.spans["model.fwd_loss"]
        self.backward = self.spans["model.backward"]
        self.callbacks = self.spans["callbacks"]
        self.optim = self.spans["optim.step"]

    def publish_position(self, words: Any) -> None:
        """Publish the position into `words` (a ring's `RingWriter.position`), or stop (None:
        before that ring closes). Call from the training thread, outside any span."""
        pos = words if words is not None else scratch_position()
        pos[POS_OFFSET] = time.time_ns() - _perf()
        self.pos = pos
        for span in self.spans.values():
            span.pos = pos

    def sched_wait(self, me: int) -> int:
        """The calling thread's (ident `me`) time runnable but waiting for a CPU so far, ns
        (Linux schedstat, its second field); -1 where it cannot be read. The file stays open
        per thread: a read is one ``pread`` (~0.4 µs), two per step."""
        sched = self._sched
        if sched is None or sched[0] != me:
            try:
                fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = -1
            if sched is not None and sched[1] >= 0:
                os.close(sched[1])
            self._sched = sched = (me, fd)
        if sched[1] < 0:
            return -1
        try:
            return int(os.pread(sched[1], 96, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return -1

    def cpu_pressure(self) -> int:
        """The host's CPU pressure so far, ns: the time in which some runnable task waited for
        a CPU (Linux PSI, the ``some`` line's ``total``, µs); -1 where the kernel has none (no
        CONFIG_PSI, booted ``psi=0``). Host-wide, also inside a container: demand from
        anywhere on the host counts. The file stays open: a read is one ``pread`` (the kernel
        sums its per-CPU times then: 5–9 µs on a 2-vCPU VM with a catalog running beside it,
        twice the schedstat read), two per step."""
        fd = self._psi
        if fd is None:
            try:
                fd = os.open("/proc/pressure/cpu", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = -1
            self._psi = fd
        if fd < 0:
            return -1
        try:
            line = os.pread(fd, 128, 0)
            return int(line[line.index(b"total=") + 6:line.index(b"\n")]) * 1000
        except (OSError, ValueError):
            return -1

    def step(self, index: int | None = None) -> _Step:
        """The step context manager; `index` sets this step's number (default: previous + 1)."""
        if index is not None:
            self.step_index = index
        return self._step

    def stage(self, name: str) -> _Span:
        """The span of stage `name` (one of data.next_wait, model.fwd_loss, model.backward,
        callbacks, optim.step)."""
        try:
            return self.spans[name]
        except KeyError:
            raise ValueError(f"unknown stage {name!r}; expected one of {', '.join(STAGES)}"
                             " (step.other is the residual)") from None

    # -- sampled CUDA-event side channel --------------------------------------------------------

    def enable_cuda_events(self, q: float) -> None:
        if not 0 <= q <= 1:
            raise ValueError(f"cuda_sample={q}: expected a fraction in [0, 1]")
        import torch

        if q == 0 or not torch.cuda.is_available():
            self.sample_every = 0
            return
        self.sample_every = max(1, round(1 / q))
        self._events = (torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True))

    def cuda_begin(self) -> None:
        if self._events is not None:
            self._events[0].record()
            self.events_armed = True

    def cuda_end(self) -> None:
        if self._events is not None:
            self._events[1].record()

    def cuda_poll(self) -> int:
        self.events_armed = False
        ev = self._events
        if ev is None or not ev[1].query():
            return -1
        return int(ev[0].elapsed_time(ev[1]) * 1e6)
