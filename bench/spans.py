"""`rankwatch bench spans`: what one stage span costs the training thread, in ns.

Times `with span:` on an empty body (enter + leave), `--calls` times per round, over `--rounds`
interleaved rounds, for:

- ``scratch``: the stage clock with no ring attached (its position goes to a scratch buffer);
- ``ring``: the clock publishing its position into a real ring's header, as a traced rank does;
- ``step``: one `step()` with its five spans and the stage record written to the ring;
- with ``--baseline FILE``: the same spans and step of another version of
  ingest/torch/stages.py (e.g. ``git show REV:ingest/torch/stages.py > /tmp/old.py``), loaded
  beside this one, so the before/after ratio comes from one run on the same machine state.

Medians over rounds; the ratio is new / baseline. Needs the native ring (``make build``), not
torch. Prints a table, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from types import ModuleType
from typing import Any

from ingest import ring


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rankwatch bench spans", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200_000, help="spans per round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--baseline", help="another stages.py to compare against (before/after)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("rankwatch_bench_baseline_stages", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"bench spans: cannot load {path} as a Python module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Tracer:
    """What the stage clock needs of a tracer: a sink for its stage record, nothing pending."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.outstanding: list[int] = []
        self.hosts = None
        self.step = -1


def _time_span(span: Any, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with span:
            pass
    return (time.perf_counter_ns() - t0) / n


def _time_step(clock: Any, n: int) -> float:
    step, data, fwd, bwd, cb, opt = (clock.step(), clock.data, clock.fwd_loss, clock.backward,
                                     clock.callbacks, clock.optim)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with step:
            with data:
                pass
            with fwd:
                pass
            with bwd:
                pass
            with cb:
                pass
            with opt:
                pass
    return (time.perf_counter_ns() - t0) / n


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from ingest.torch.sink import RingSink
    from ingest.torch.stages import StageClock

    try:
        ring.load_library()
    except ring.RingLibraryMissing as e:
        print(f"bench spans: {e}", file=sys.stderr)
        return 2
    prefix = f"/rwspans{os.getpid()}"
    sink = RingSink("bench-spans", 0, 1 << 16, prefix)
    clocks: dict[str, Any] = {"scratch": StageClock()}
    ringed = StageClock()
    ringed.publish_position(sink.writer.position())
    clocks["ring"] = ringed
    base: Any = None
    if args.baseline:
        base = _load(args.baseline).StageClock()
        clocks["baseline"] = base
    samples: dict[str, list[float]] = {k: [] for k in clocks}
    steps: dict[str, list[float]] = {"ring": [], **({"baseline": []} if base else {})}
    n, n_steps = args.calls, max(1, args.calls // 6)
    try:
        for k in ("ring", "baseline"):
            if k in clocks:
                clocks[k].tracer = _Tracer(sink)
        for _ in range(args.rounds):
            for k, clock in clocks.items():
                samples[k].append(_time_span(clock.backward, n))
            for k in steps:
                steps[k].append(_time_step(clocks[k], n_steps))
                _drain(sink)
    finally:
        ringed.publish_position(None)
        sink.close(unlink=True)
    med = {k: round(statistics.median(v), 1) for k, v in samples.items()}
    low = {k: round(min(v), 1) for k, v in samples.items()}
    med_steps = {k: round(statistics.median(v), 1) for k, v in steps.items()}
    low_steps = {k: round(min(v), 1) for k, v in steps.items()}
    out: dict[str, Any] = {"span_ns": med, "span_ns_min": low, "step_ns": med_steps,
                           "step_ns_min": low_steps, "calls": n, "rounds": args.rounds}
    if base is not None:
        for what, m, lo in (("span", med, low), ("step", med_steps, low_steps)):
            out[f"{what}_ratio"] = round(m["ring"] / m["baseline"], 3)
            out[f"{what}_ratio_min"] = round(lo["ring"] / lo["baseline"], 3)
        # each round times both back to back: the median of per-round ratios cancels the
        # machine's load drifting between rounds
        for what, d in (("span", samples), ("step", steps)):
            out[f"{what}_ratio_paired"] = round(statistics.median(
                r / b for r, b in zip(d["ring"], d["baseline"], strict=True)), 3)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"one empty stage span (enter + leave), ns, {args.rounds} rounds × {n}: median (min)")
    for k, v in med.items():
        print(f"  {k:<9} {v:8.1f}  ({low[k]:.1f})")
    print("one step() with five spans and its stage record into the ring, ns: median (min)")
    for k, v in med_steps.items():
        print(f"  {k:<9} {v:8.1f}  ({low_steps[k]:.1f})")
    if base is not None:
        print(f"ratio position published / baseline, median of per-round ratios: span "
              f"{out['span_ratio_paired']}×, step {out['step_ratio_paired']}× (of medians: "
              f"{out['span_ratio']}×, {out['step_ratio']}×; of minima: "
              f"{out['span_ratio_min']}×, {out['step_ratio_min']}×)")
    return 0


def _drain(sink: Any) -> None:
    """Empty the ring so the stage records of the next round are written, not dropped."""
    reader = ring.RingReader(sink.name)
    try:
        reader.drain()
    finally:
        reader.close()


if __name__ == "__main__":
    raise SystemExit(main())
