"""Where a rank is: its current step and stage, from the position its beats carry.

The PyTorch tracer publishes a rank's position — the step it is in, the stage it is inside
(StageFrontier's stages, ingest.torch.events.STAGES; "" between stages) and when it got there —
and the host agent copies it into every `beats` row (ingest.records.Beat: `step`, `stage`,
`stage_ts`). A rank hung inside backward keeps beating `model.backward` at the hung step, while
its step never ends and no stage record says so. Pure; no I/O.
"""

from __future__ import annotations

import numpy as np

from diagnosis.columns import Columns, col, ints


def current_stage(beats: Columns, rank: int, at_ns: int | None = None
                  ) -> tuple[int, str, int] | None:
    """(step, stage, stage_ts) of `rank` from its newest beat that carries a position (with
    `at_ns`: the newest at or before it — where the rank was at that moment, e.g. inside a stall
    that has since ended), or None when none of its beats does (no beats, an old producer, a
    rank without a stage clock).

    `stage` is "" when the rank was between stages (then `stage_ts` is when it left the last
    one); `step` is -1 when the rank times stages without numbering steps. Among beats of the
    same `ts` (one per communicator) the latest `stage_ts` wins."""
    if not beats or "rank" not in beats or "stage_ts" not in beats:
        return None
    stage_ts = ints(beats, "stage_ts", 0)
    sel = (ints(beats, "rank") == rank) & (stage_ts > 0)
    if at_ns is not None:
        sel &= ints(beats, "ts", 0) <= at_ns
    mine = np.flatnonzero(sel)
    if not mine.size:
        return None
    ts = ints(beats, "ts", 0)[mine]
    newest = mine[ts == ts.max()]
    i = int(newest[np.argmax(stage_ts[newest])])
    stage = col(beats, "stage", "")[i]
    return int(ints(beats, "step", -1)[i]), "" if stage is None else str(stage), int(stage_ts[i])
