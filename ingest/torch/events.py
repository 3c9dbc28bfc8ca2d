"""The tracer's fixed-size event: what one training process writes into its ring, per event.

A slot is ``SLOT_WORDS`` int64 words: ``[kind, rank, f0 … f9]``. The field meaning depends on the
kind; the agent decodes whole arrays of slots column-wise (ingest/agent/decode.py). Strings never
enter the ring: communicators travel as a per-rank index into the rank's communicator table
(written once per new process group to the rank's sidecar, ingest/torch/comms.py) and op names as
a code into `OP_NAMES`.

| kind | f0 | f1 | f2 | f3 | f4 | f5 | f6 | f7 | f8 | f9 |
|---|---|---|---|---|---|---|---|---|---|---|
| OP_START | comm | op_seq | op code | bytes | peer | t_enqueue | t_start | step | | |
| OP_END | comm | op_seq | t_end | | | | | | | |
| STAGE | step | t_start | data | fwd_loss | backward | callbacks | optim | other | device_ns | |

Times are ``time.time_ns()`` (the host's realtime clock, as the record contract asks).
"""

from __future__ import annotations

from typing import Final

SLOT_WORDS: Final = 12
OP_START: Final = 1
OP_END: Final = 2
STAGE: Final = 3

#: op code -> the contract's op name (ingest.records.OpName); index = code.
OP_NAMES: Final = ("AllReduce", "AllGather", "ReduceScatter", "Reduce", "Broadcast", "AllToAll",
                   "Send", "Recv", "Barrier")
OP_CODE: Final = {name: i for i, name in enumerate(OP_NAMES)}

#: StageFrontier's ordered stages (Appendix A); the record fields of `ingest.records.Stage`.
STAGES: Final = ("data.next_wait", "model.fwd_loss", "model.backward", "callbacks", "optim.step")
STAGE_FIELDS: Final = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks",
                       "optim_step", "step_other")
