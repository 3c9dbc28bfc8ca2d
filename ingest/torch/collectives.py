"""Interception of torch.distributed collectives and point-to-point calls.

The narrow waist (VenusTrace/MegaTrace §3): every collective and p2p call of the Python API goes
through a wrapper that writes an OP_START event (communicator, per-communicator op_seq, op, bytes,
peer, enqueue time, step) and arranges an OP_END at completion:

- asynchronous work (``async_op=True``, isend/irecv): ``Work.get_future().add_done_callback`` —
  no added synchronization; gloo's p2p work has no future, so the tracer polls
  ``Work.is_completed()`` at its next touchpoint (an intercepted call or a stage boundary) and
  records the time it first sees it done;
- synchronous calls on gloo/CPU return complete: the end is the return time;
- NCCL work (synchronous collectives are issued asynchronously and waited, exactly what torch
  does inside) is polled with ``Work.is_completed()``, which queries the work's CUDA end event
  without blocking. Not its future: on a GPU (PyTorch 2.11, NCCL 2.28) an NCCL future
  completes on the CPU as soon as the kernel is enqueued, so a callback would time every
  collective at its enqueue and a rank stuck in an AllReduce would look complete
  (native/README.md, "Status"). The end is the first touchpoint that sees the GPU done (a
  step's stages are touchpoints).

DDP's gradient all-reduces happen in C++ and bypass this API; `ddp.py` routes them through it
with a comm hook. Calls the table below does not name (gather, scatter, object collectives built
on these, batch_isend_irecv) are not traced individually.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ingest.torch.events import OP_CODE
from ingest.torch.tracer import Tracer


@dataclass(frozen=True)
class Spec:
    """Where a function keeps its arguments: tensor(s), group, async flag, peer (positions)."""

    op: str
    size_at: int  # argument whose bytes count (-1: none)
    size_name: str
    group_at: int
    async_at: int = -1  # -1: the call has no async flag
    peer_at: int = -1
    is_async: bool = False  # always returns Work (isend/irecv)


SPECS: dict[str, Spec] = {
    "all_reduce": Spec("AllReduce", 0, "tensor", 2, 3),
    "broadcast": Spec("Broadcast", 0, "tensor", 2, 3),
    "reduce": Spec("Reduce", 0, "tensor", 3, 4),
    "all_gather": Spec("AllGather", 0, "tensor_list", 2, 3),
    "all_gather_into_tensor": Spec("AllGather", 0, "output_tensor", 2, 3),
    "reduce_scatter": Spec("ReduceScatter", 1, "input_list", 3, 4),
    "reduce_scatter_tensor": Spec("ReduceScatter", 1, "input", 3, 4),
    "all_to_all_single": Spec("AllToAll", 1, "input", 4, 5),
    "all_to_all": Spec("AllToAll", 1, "input_tensor_list", 2, 3),
    "barrier": Spec("Barrier", -1, "", 0, 1),
    "send": Spec("Send", 0, "tensor", 2, peer_at=1),
    "recv": Spec("Recv", 0, "tensor", 2, peer_at=1),
    "isend": Spec("Send", 0, "tensor", 2, peer_at=1, is_async=True),
    "irecv": Spec("Recv", 0, "tensor", 2, peer_at=1, is_async=True),
}
_KW = {  # keyword names of the positions above, per function
    "send": ("dst",), "recv": ("src",), "isend": ("dst",), "irecv": ("src",),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    try:
        return int(x.numel() * x.element_size())
    except AttributeError:
        return 0


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _wrap(tracer: Tracer, name: str, spec: Spec, orig: Callable[..., Any]) -> Callable[..., Any]:
    opcode = OP_CODE[spec.op]
    peer_name = _KW.get(name, ("",))[0]
    group_of, start, track, end_now = tracer.group_of, tracer.start, tracer.track, tracer.end_now
    callbacks, nccl = tracer.callbacks, tracer.nccl

    @functools.wraps(orig)
    def traced(*args: Any, **kwargs: Any) -> Any:
        try:
            comm = group_of(_arg(args, kwargs, spec.group_at, "group", None))
            nbytes = _nbytes(_arg(args, kwargs, spec.size_at, spec.size_name, None)
                             ) if spec.size_at >= 0 else 0
            peer = _arg(args, kwargs, spec.peer_at, peer_name, -1) if spec.peer_at >= 0 else -1
            seq = start(comm, opcode, nbytes, -1 if peer is None else int(peer))
        except Exception:  # never let tracing break the call
            return orig(*args, **kwargs)
        wants_async = spec.is_async or (
            spec.async_at >= 0 and bool(_arg(args, kwargs, spec.async_at, "async_op", False)))
        if not wants_async and spec.async_at >= 0 and nccl[comm]:
            kwargs["async_op"] = True
            args = args[: spec.async_at]
            work = orig(*args, **kwargs)
            _on_done(tracer, work, track(comm, seq), callbacks, poll=True)
            if work is not None:
                work.wait()
            return None
        result = orig(*args, **kwargs)
        if wants_async:
            _on_done(tracer, result, track(comm, seq), callbacks, poll=nccl[comm])
        else:
            end_now(comm, seq)
        return result

    return traced


def _on_done(tracer: Tracer, work: Any, slot: int, callbacks: list[Callable[[Any], None]],
             *, poll: bool = False) -> None:
    if slot < 0 or work is None:
        return
    if poll:  # NCCL: the GPU's completion, not the future's (module docstring)
        tracer.polled[slot] = work
        return
    try:
        work.get_future().add_done_callback(callbacks[slot])
    except RuntimeError:  # gloo p2p: no future; polled at the next touchpoint
        tracer.polled[slot] = work


def install(tracer: Tracer, dist: Any) -> dict[str, Callable[..., Any]]:
    """Patch `dist` (torch.distributed) in place; returns the originals for `uninstall`."""
    originals: dict[str, Callable[..., Any]] = {}
    for name, spec in SPECS.items():
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        originals[name] = orig
        setattr(dist, name, _wrap(tracer, name, spec, orig))
    return originals


def uninstall(dist: Any, originals: dict[str, Callable[..., Any]]) -> None:
    for name, orig in originals.items():
        setattr(dist, name, orig)
