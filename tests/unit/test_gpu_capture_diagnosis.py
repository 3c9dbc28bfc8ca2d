"""The engine on records of a real GPU job: an H100 loopback pair (NCCL 2.28.9's profiler
plugin, CUDA 13's CUPTI injector and the Python tracer, captured by `rankwatch agent --capture`
in native/gpu/check.sh) where rank 1's data loading stalls 8 s at step 25 while rank 0 waits in
the step's AllReduce. Pure logic on the capture's rows (decoded as the worker would store them);
the same capture goes through the real broker and worker in
tests/integration/test_ingest_pipeline.py."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from diagnosis import engine
from diagnosis.agents import WINDOW_COLUMNS
from diagnosis.columns import Columns
from diagnosis.triggers.base import Trigger
from diagnosis.window import Window, latest_op_rows
from ingest.agent.capture import read_capture
from ingest.batch import decode_batch
from ingest.records import JobTopology
from ingest.units import SECOND as S

CAPTURE = Path(__file__).parents[1] / "fixtures" / "gpu" / "h100-nccl-2.28.9-data-stall.rwcap"


def stored() -> tuple[JobTopology, dict[str, Columns]]:
    parts: dict[str, list[Columns]] = defaultdict(list)
    topo = None
    for frame in read_capture(CAPTURE):
        b = decode_batch(frame.data)
        if frame.kind == "jobs":
            topo = b.topologies[-1]
        elif frame.kind in WINDOW_COLUMNS:
            parts[frame.kind].append({c: b.column(c) for c in WINDOW_COLUMNS[frame.kind][1]})
    assert topo is not None
    return topo, {k: {c: np.concatenate([p[c] for p in v]) for c in v[0]}
                  for k, v in parts.items()}


def as_of(tables: dict[str, Columns], now: int) -> dict[str, Columns]:
    """What the tables held at `now`: rows whose event happened by then, ops not yet ended
    shown in flight, a step's stage record only once the step ended."""
    out: dict[str, Columns] = {}
    for kind, t in tables.items():
        tcol = WINDOW_COLUMNS[kind][0]
        keep = np.asarray(t[tcol]) <= now
        if kind == "stages":
            total = sum(np.asarray(t[c]) for c in ("data_next_wait", "model_fwd_loss",
                                                     "model_backward", "callbacks", "optim_step",
                                                     "step_other"))
            keep &= np.asarray(t["t_start"]) + total <= now
        if kind == "kernels":
            keep &= np.asarray(t["t_start"]) + np.asarray(t["duration"]) <= now
        rows = {c: np.asarray(v)[keep] for c, v in t.items()}
        if kind == "ops":
            rows["t_end"] = np.where(rows["t_end"] > now, 0, rows["t_end"])
        out[kind] = latest_op_rows(rows) if kind == "ops" else rows
    return out


def stall_bounds(tables: dict[str, Columns]) -> tuple[int, int]:
    st = tables["stages"]
    i = int(np.argmax(st["data_next_wait"]))
    assert int(st["rank"][i]) == 1 and int(st["step"][i]) == 25
    return int(st["t_start"][i]), int(st["t_start"][i] + st["data_next_wait"][i])


def test_while_rank_1_stalls_the_engine_names_its_data_loading() -> None:
    topo, tables = stored()
    a, _ = stall_bounds(tables)
    now = a + 6 * S  # the real pipeline's trigger came ~6 s into the stall
    w = Window(topo, as_of(tables, now), now - 600 * S, now)
    c = engine.diagnose(w, Trigger(topo.job_id, now, "failure", (0,)), now)
    assert c is not None and c.kind == "hang" and c.ranks == (1,), c
    assert c.stage == "data" and c.component == "data_loader", c
    assert "live_hang" in c.labels or "min_op" in c.labels


def test_after_the_stall_recovered_it_is_a_transient_hang_of_rank_1s_data_loading() -> None:
    topo, tables = stored()
    _, b = stall_bounds(tables)
    now = b + 3 * S
    w = Window(topo, as_of(tables, now), now - 600 * S, now)
    c = engine.diagnose(w, Trigger(topo.job_id, now, "failure", (0,)), now)
    assert c is not None and c.kind == "hang" and c.ranks == (1,), c
    assert c.stage == "data" and c.component == "data_loader", c
    assert {"transient", "recovered"} <= set(c.labels)
    assert any("8.0 s in data_next_wait" in text for _, text in c.summaries), c.summaries
