"""The per-process tracer state: the ring writer, communicator table, step, and op completions.

Threading contract — the ring has ONE producer, the training thread:

- op starts are written by the training thread when the call is made;
- completions of asynchronous work arrive on other threads (gloo's worker threads, NCCL's
  watchdog) through ``Future.add_done_callback``. A callback does one thing: store
  ``time.time_ns()`` into its preallocated slot of `ends` (a list item store, atomic under the
  GIL). No lock, no ring write, no allocation beyond the int;
- the training thread *harvests* finished slots into op end records at its next intercepted call
  or stage boundary. Timestamps are the completion times, however late the harvest.

Work without a future (gloo's point-to-point) and NCCL work (whose future completes at enqueue,
collectives.py) are polled with ``Work.is_completed()`` at each harvest: its end is the time the
training thread first saw it done (its next intercepted call or stage boundary after the work
finished).

Work that completes with an error (a peer process gone, a timeout) gets no end record: it did
not complete, and a failed collective recorded as finished would hide which rank its peers were
waiting for. It stays in flight in the ring; when the process ends, the host agent publishes it
in flight (ingest.agent), as the call a rank was inside when its job failed.

Nothing here blocks, locks or raises into training: a full ring drops and counts (native ring), and
more than `PENDING` outstanding async ops leave the excess untracked (counted in `untracked`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ingest.torch.comms import CommTable
from ingest.torch.sink import RingSink

PENDING = 4096
_now = time.time_ns


class Tracer:
    def __init__(self, sink: RingSink, comms: CommTable, rank: int) -> None:
        self.sink = sink
        self._op_start, self._op_end = sink.op_start, sink.op_end
        self.comms = comms
        self.rank = rank
        self.step = -1
        self.untracked = 0
        self.failed = 0  # async ops that completed with an error (no end record written)
        self.ends: list[int] = [0] * PENDING
        self.slot_comm: list[int] = [0] * PENDING
        self.slot_seq: list[int] = [0] * PENDING
        self.outstanding: list[int] = []
        self._free: list[int] = list(range(PENDING - 1, -1, -1))
        self.callbacks: list[Callable[[Any], None]] = [self._make_cb(i) for i in range(PENDING)]
        self.group_of: Callable[[Any], int] = lambda g: 0  # set by collectives.install
        self.nccl: list[bool] = []  # per communicator: issue sync collectives async + wait
        self.polled: dict[int, Any] = {}  # slot -> Work polled for completion (gloo p2p, NCCL)
        self.hosts: Any = None  # rank 0: comms.HostGather until the hosts are in

    def _make_cb(self, slot: int) -> Callable[[Any], None]:
        ends = self.ends

        def done(fut: Any) -> None:
            try:
                fut.value()  # raises when the work failed (a peer gone, a timeout)
            except Exception:
                ends[slot] = -_now()
                return
            ends[slot] = _now()

        return done

    # -- training thread only ------------------------------------------------------------------

    def start(self, comm: int, opcode: int, nbytes: int, peer: int) -> int:
        """Write the start record of the next op on `comm`; returns its op_seq."""
        if self.outstanding:
            self.harvest()
        seqs = self.comms.seq
        seq = seqs[comm]
        seqs[comm] = seq + 1
        self._op_start(comm, seq, opcode, nbytes, peer, _now(), self.step)
        return seq

    def end_now(self, comm: int, seq: int) -> None:
        self._op_end(comm, seq, _now())

    def track(self, comm: int, seq: int) -> int:
        """A slot whose callback records the completion time of (comm, seq); -1 if none free."""
        if not self._free:
            self.untracked += 1
            return -1
        slot = self._free.pop()
        self.ends[slot] = 0
        self.slot_comm[slot] = comm
        self.slot_seq[slot] = seq
        self.outstanding.append(slot)
        return slot

    def harvest(self) -> None:
        """Turn every finished slot into an op end record."""
        ends, keep = self.ends, []
        if self.polled:
            for slot, work in list(self.polled.items()):
                if work.is_completed():
                    ends[slot] = -_now() if _failed(work) else _now()
                    del self.polled[slot]
        for slot in self.outstanding:
            t = ends[slot]
            if t > 0:
                self._op_end(self.slot_comm[slot], self.slot_seq[slot], t)
                self._free.append(slot)
            elif t < 0:  # failed: no end record, the op stays in flight (module docstring)
                self.failed += 1
                self._free.append(slot)
            else:
                keep.append(slot)
        self.outstanding = keep


def _failed(work: Any) -> bool:
    """Whether completed `work` (a c10d Work) ended in an error; False when it cannot say."""
    try:
        return work.exception() is not None
    except Exception:
        return False
