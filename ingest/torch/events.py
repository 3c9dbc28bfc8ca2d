"""Names shared by the tracer and the agent: op codes and StageFrontier's stages.

The tracer's records themselves are native ring records (native/ring/rw_record.h, written by
`ingest.torch.sink`); an op code here indexes `OP_NAMES`, which follows enum rw_func (shifted by
one: rw_func 0 is "other").
"""

from __future__ import annotations

from typing import Final

#: op code -> the contract's op name (ingest.records.OpName); index = code.
OP_NAMES: Final = ("AllReduce", "AllGather", "ReduceScatter", "Reduce", "Broadcast", "AllToAll",
                   "Send", "Recv", "Barrier")
OP_CODE: Final = {name: i for i, name in enumerate(OP_NAMES)}

#: StageFrontier's ordered stages (Appendix A); the record fields of `ingest.records.Stage`.
STAGES: Final = ("data.next_wait", "model.fwd_loss", "model.backward", "callbacks", "optim.step")
STAGE_FIELDS: Final = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks",
                       "optim_step", "step_other")
