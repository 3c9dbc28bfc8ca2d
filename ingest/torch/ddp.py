"""DDP's gradient all-reduces through the traced API, with a comm hook.

DistributedDataParallel reduces gradient buckets in C++ (the Reducer calls the process group
directly), so patching torch.distributed alone never sees them. After a DDP model is built we
register a comm hook equal to torch's default ``allreduce_hook`` — divide by the group size,
``all_reduce(async_op=True)``, return the future — except that the all-reduce goes through the
traced `torch.distributed.all_reduce`. Numerics and overlap are those of the default hook.

A model that registers its own comm hook gets it: DDP accepts one hook, so our wrapper of
``register_comm_hook`` lets the user's call replace ours (DDP's Python attribute bookkeeping
only; the C++ reducer is told once, at the user's call, because we register lazily: ours is
installed at the first forward if none was registered by then).
Set ``RANKWATCH_TRACE_DDP=0`` to leave DDP alone.
"""

from __future__ import annotations

import functools
import os
from typing import Any


def _traced_allreduce_hook(group: Any, bucket: Any) -> Any:
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    buf = bucket.buffer()
    buf.div_(pg.size())
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def install(saved: dict[str, Any]) -> None:
    if os.environ.get("RANKWATCH_TRACE_DDP", "1") == "0":
        return
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    # DDP checks the hook's annotations as objects (not the strings of `from __future__`)
    _traced_allreduce_hook.__annotations__ = {
        "group": object, "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor]}
    orig_register = DDP.register_comm_hook
    orig_forward = DDP.forward
    saved["DDP.register_comm_hook"] = orig_register
    saved["DDP.forward"] = orig_forward

    @functools.wraps(orig_register)
    def register_comm_hook(self: Any, state: Any, hook: Any) -> Any:
        self._rankwatch_hooked = True
        return orig_register(self, state, hook)

    @functools.wraps(orig_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_rankwatch_hooked", False):
            self._rankwatch_hooked = True
            try:
                orig_register(self, self.process_group, _traced_allreduce_hook)
            except Exception as e:  # an unusual DDP config: leave it untraced
                print(f"rankwatch: DDP all-reduces not traced: {e}", flush=True)
        return orig_forward(self, *args, **kwargs)

    DDP.register_comm_hook = register_comm_hook
    DDP.forward = forward


def uninstall(saved: dict[str, Any]) -> None:
    if "DDP.forward" not in saved:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP.register_comm_hook = saved.pop("DDP.register_comm_hook")
    DDP.forward = saved.pop("DDP.forward")
