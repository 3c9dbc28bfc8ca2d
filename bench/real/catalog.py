"""The cases of the real catalog: shape, processes, steps, the fault (on one rank from one step),
and the CPU contention around it. docs/real-catalog.md describes them; `bench.real.workload`
decides the labels a right diagnosis carries.

Names read ``<shape><ranks>-<what>``: ``ddp4-hang-bwd`` is a 4-rank DDP job whose rank hangs in
its backward. Controls are ``ctl-…``; ``ovh-…`` are the overhead runs (``plain`` untraced and
without an agent, ``traced`` through the whole path, interleaved; the traced ones are controls
too). Cases tagged ``extended`` run only when named (or with ``--cases all``): the standard
catalog covers every fault kind and shape and fits in ~25 minutes on 2 busy cores. Cases tagged
``heldout`` (extended too) are combinations the rules were not developed on — a CPU hog in a
pipeline and a TP job, faults on ranks and stages no other case uses, steps three times as long
(``device_scale``) — kept apart so that a run of them says how the rules generalise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A CPU hog: a busy loop that ends when its parent does, however the parent ends.
HOG = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    pass"


@dataclass(frozen=True)
class Case:
    name: str
    shape: str  # ddp | pipeline | tp
    nproc: int
    steps: int
    fault: dict[str, Any] | None = None
    contention: int = 0  # busy processes beside the job for its whole run (unpinned)
    declare: bool = True  # launcher declares RANKWATCH_PP/TP/DP/MICROBATCHES
    traced: bool = True  # False: no tracer, no agent (overhead baseline)
    pp: int = 2
    tp: int = 2
    microbatches: int = 4
    tags: tuple[str, ...] = field(default_factory=tuple)
    #: torchrun's --monitor-interval (s): how soon it stops the other ranks once one failed
    #: (None: its default, 0.1 s)
    monitor_s: float | None = None
    #: multiplies the workload's emulated device times: 3 gives ~150 ms steps instead of ~50
    device_scale: float = 1.0

    @property
    def control(self) -> bool:
        return self.fault is None and self.traced

    @property
    def hangs(self) -> bool:
        """The job stops for good: the harness ends it once the diagnosis had time to come."""
        return self.fault is not None and self.fault["kind"] in ("hang", "desync")

    def describe(self) -> str:
        if self.fault is None:
            extra = f", {self.contention} busy processes beside it" if self.contention else ""
            extra += "" if self.declare else ", shape not declared"
            extra += f", device time x{self.device_scale:g}" if self.device_scale != 1.0 else ""
            return ("control" if self.traced else "untraced baseline") + extra
        f = self.fault
        what = {"hang": f"hang in {f.get('stage')}" + (f" mb={f['mb']}" if "mb" in f else ""),
                "desync": "hang inside a collective its peers skip",
                "slow": f"{f.get('stage')} x{f.get('factor')}",
                "link": f"sends {f.get('delay_ms')} ms late", "kill": "SIGKILL",
                "hog": f"{f.get('procs', 2)} busy processes on its core",
                "stall": f"{f.get('stall_s')} s stall in fwd, recovers"}[f["kind"]]
        if self.device_scale != 1.0:
            what += f", device time x{self.device_scale:g}"
        stop = (f", torchrun stops the rest within {self.monitor_s * 1000:.0f} ms"
                if self.monitor_s is not None else "")
        return f"rank {f['rank']} from step {f['step']}: {what}{stop}"


def _c(name: str, shape: str, nproc: int, steps: int, fault: dict[str, Any] | None = None,
       **kw: Any) -> Case:
    return Case(name, shape, nproc, steps, fault, **kw)


def _h(rank: int, stage: str, step: int = 30, **kw: Any) -> dict[str, Any]:
    return {"kind": "hang", "rank": rank, "stage": stage, "step": step, **kw}


def _s(rank: int, stage: str, factor: float, step: int = 40) -> dict[str, Any]:
    return {"kind": "slow", "rank": rank, "stage": stage, "factor": factor, "step": step}


PP8: dict[str, Any] = {"pp": 4}  # 8 ranks: 4 stages x 2 replicas
#: the held-out cases' tags: run when named (`select`), never with the standard catalog
HELD = ("extended", "heldout")

CASES: list[Case] = [
    # -- controls: every shape, several lengths, some under CPU contention --------------------
    _c("ctl-ddp4-100", "ddp", 4, 100, tags=("quick",)),
    _c("ctl-ddp4-300", "ddp", 4, 300),
    _c("ctl-ddp4-600", "ddp", 4, 600),
    _c("ctl-ddp4-contended", "ddp", 4, 150, contention=2),
    _c("ctl-ddp8-100", "ddp", 8, 100),
    _c("ctl-pp4-100", "pipeline", 4, 100),
    _c("ctl-pp4-300", "pipeline", 4, 300),
    _c("ctl-pp4-contended", "pipeline", 4, 150, contention=2, tags=("quick",)),
    _c("ctl-pp4-undeclared", "pipeline", 4, 120, declare=False),
    _c("ctl-pp8-100", "pipeline", 8, 100, **PP8),
    _c("ctl-pp8-contended", "pipeline", 8, 80, contention=1, **PP8),
    _c("ctl-tp4-100", "tp", 4, 100),
    _c("ctl-tp4-300", "tp", 4, 300),
    _c("ctl-tp4-contended", "tp", 4, 120, contention=2),
    _c("ctl-tp8-100", "tp", 8, 100),
    _c("ctl-ddp8-contended", "ddp", 8, 80, contention=1),
    # -- overhead: untraced and traced runs interleaved (the traced ones are controls too) ----
    _c("ovh-ddp4-plain-1", "ddp", 4, 200, traced=False, tags=("overhead",)),
    _c("ovh-ddp4-traced-1", "ddp", 4, 200, tags=("overhead",)),
    _c("ovh-ddp4-plain-2", "ddp", 4, 200, traced=False, tags=("overhead",)),
    _c("ovh-ddp4-traced-2", "ddp", 4, 200, tags=("overhead",)),
    _c("ovh-pp4-plain-1", "pipeline", 4, 200, traced=False, tags=("overhead",)),
    _c("ovh-pp4-traced-1", "pipeline", 4, 200, tags=("overhead",)),
    _c("ovh-pp4-plain-2", "pipeline", 4, 200, traced=False, tags=("overhead",)),
    _c("ovh-pp4-traced-2", "pipeline", 4, 200, tags=("overhead",)),
    # -- DDP, 4 and 8 ranks ---------------------------------------------------------------------
    _c("ddp4-hang-data", "ddp", 4, 200, _h(1, "data")),
    _c("ddp4-hang-fwd", "ddp", 4, 200, _h(2, "fwd"), tags=("extended",)),
    _c("ddp4-hang-bwd", "ddp", 4, 200, _h(2, "bwd"), tags=("quick",)),
    _c("ddp4-hang-optim", "ddp", 4, 200, _h(3, "optim")),
    _c("ddp4-hang-collective", "ddp", 4, 200, {"kind": "desync", "rank": 1, "step": 30}),
    _c("ddp4-slow-data-x10", "ddp", 4, 140, _s(0, "data", 10)),
    _c("ddp4-slow-fwd-x3", "ddp", 4, 140, _s(1, "fwd", 3), tags=("extended",)),
    _c("ddp4-slow-optim-x6", "ddp", 4, 140, _s(3, "optim", 6)),
    _c("ddp4-slow-link", "ddp", 4, 140, {"kind": "link", "rank": 1, "step": 40,
                                         "delay_ms": 40}, tags=("extended",)),
    _c("ddp4-kill", "ddp", 4, 200, {"kind": "kill", "rank": 2, "step": 40}),
    # the launcher stops the peers before they reach the all-reduce the killed rank never
    # joins: no call in flight, the order of the processes' ends is the evidence
    _c("ddp4-kill-fast-stop", "ddp", 4, 200, {"kind": "kill", "rank": 2, "step": 40},
       monitor_s=0.01),
    # two busy processes slow the job by anything from 5 to 30 % (the rank's stages are mostly
    # sleeps, and a sleeper waking beside busy loops gets its core back soon); four take most
    # of the rank's core while it computes and slow the job ~45 % run after run
    _c("ddp4-cpu-hog", "ddp", 4, 160, {"kind": "hog", "rank": 1, "step": 40, "procs": 2}),
    _c("ddp4-cpu-hog-heavy", "ddp", 4, 160, {"kind": "hog", "rank": 1, "step": 40, "procs": 4}),
    _c("ddp4-stall", "ddp", 4, 200, {"kind": "stall", "rank": 3, "step": 40, "stall_s": 4},
       tags=("extended",)),
    _c("ddp8-slow-bwd-x10", "ddp", 8, 120, _s(7, "bwd", 10)),
    # -- 1F1B pipeline x DP: 4 ranks (2 stages x 2), 8 ranks (4 x 2) -----------------------------
    _c("pp4-hang-bwd", "pipeline", 4, 200, _h(3, "bwd", mb=1)),
    _c("pp4-hang-fwd", "pipeline", 4, 200, _h(1, "fwd", mb=2), tags=("extended",)),
    _c("pp4-hang-undeclared", "pipeline", 4, 200, _h(3, "bwd", mb=0), declare=False),
    _c("pp4-hang-collective", "pipeline", 4, 200, {"kind": "desync", "rank": 2, "step": 30},
       tags=("extended",)),
    _c("pp4-slow-bwd-x4", "pipeline", 4, 140, _s(3, "bwd", 4), tags=("quick",)),
    _c("pp4-slow-fwd-x2", "pipeline", 4, 140, _s(0, "fwd", 2), tags=("extended",)),
    _c("pp4-slow-data-x5", "pipeline", 4, 140, _s(0, "data", 5), tags=("extended",)),
    _c("pp4-slow-link", "pipeline", 4, 140, {"kind": "link", "rank": 1, "step": 40,
                                             "delay_ms": 10}),
    _c("pp4-kill", "pipeline", 4, 200, {"kind": "kill", "rank": 3, "step": 40}, tags=("extended",)),
    _c("pp4-stall", "pipeline", 4, 200, {"kind": "stall", "rank": 0, "step": 40,
                                         "stall_s": 4}),
    _c("pp8-hang-bwd", "pipeline", 8, 200, _h(5, "bwd", mb=3), **PP8, tags=("extended",)),
    _c("pp8-slow-optim-x6", "pipeline", 8, 120, _s(5, "optim", 6), **PP8),
    # -- tensor parallel x DP: 4 ranks (2 x 2), 8 ranks (2 x 4) ----------------------------------
    _c("tp4-hang-fwd", "tp", 4, 200, _h(1, "fwd")),
    _c("tp4-slow-bwd-x4", "tp", 4, 140, _s(2, "bwd", 4), tags=("extended",)),
    _c("tp4-slow-link", "tp", 4, 140, {"kind": "link", "rank": 0, "step": 40,
                                       "delay_ms": 10}),
    _c("tp4-slow-fwd-x3", "tp", 4, 140, _s(3, "fwd", 3)),
    _c("tp8-hang-bwd", "tp", 8, 200, _h(5, "bwd")),
    _c("tp8-slow-fwd-x3", "tp", 8, 120, _s(6, "fwd", 3), tags=("extended",)),
    # -- held out: run once the rules were settled, never tuned on -----------------------------
    _c("ctl-ddp4-long", "ddp", 4, 80, device_scale=3.0, tags=HELD),
    _c("ctl-tp8-contended", "tp", 8, 80, contention=1, tags=HELD),
    _c("pp4-cpu-hog", "pipeline", 4, 160, {"kind": "hog", "rank": 2, "step": 40, "procs": 4},
       tags=HELD),
    _c("tp4-cpu-hog", "tp", 4, 160, {"kind": "hog", "rank": 3, "step": 40, "procs": 4},
       tags=HELD),
    _c("ddp8-slow-data-x3", "ddp", 8, 120, _s(5, "data", 3), tags=HELD),
    _c("pp8-slow-bwd-x3", "pipeline", 8, 120, _s(2, "bwd", 3), **PP8,
       tags=HELD),
    _c("tp4-slow-optim-x6", "tp", 4, 140, _s(1, "optim", 6), tags=HELD),
    _c("ddp4-slow-bwd-x2-long", "ddp", 4, 90, _s(2, "bwd", 2, step=30), device_scale=3.0,
       tags=HELD),
    _c("ddp4-hang-fwd-long", "ddp", 4, 120, _h(0, "fwd"), device_scale=3.0,
       tags=HELD),
    _c("tp8-hang-data", "tp", 8, 200, _h(4, "data"), tags=HELD),
    _c("pp8-hang-fwd", "pipeline", 8, 200, _h(6, "fwd", mb=1), **PP8,
       tags=HELD),
    _c("pp4-slow-fwd-x3-late", "pipeline", 4, 200, _s(2, "fwd", 3, step=120),
       tags=HELD),
    # a second batch, written and run after the fixes the first one led to
    _c("ctl-pp4-long", "pipeline", 4, 80, device_scale=3.0, tags=HELD),
    _c("ctl-ddp4-contended-long", "ddp", 4, 100, contention=2, device_scale=2.0,
       tags=HELD),
    _c("tp8-slow-bwd-x2", "tp", 8, 120, _s(7, "bwd", 2), tags=HELD),
    _c("ddp8-hang-optim", "ddp", 8, 200, _h(6, "optim"), tags=HELD),
    _c("ddp8-cpu-hog", "ddp", 8, 120, {"kind": "hog", "rank": 4, "step": 40, "procs": 4},
       tags=HELD),
    _c("pp4-slow-optim-x4", "pipeline", 4, 140, _s(1, "optim", 4), tags=HELD),
    _c("pp4-hang-data", "pipeline", 4, 200, _h(2, "data"), tags=HELD),
    _c("pp8-slow-fwd-x2", "pipeline", 8, 120, _s(3, "fwd", 2), **PP8,
       tags=HELD),
    _c("tp4-hang-optim", "tp", 4, 200, _h(2, "optim"), tags=HELD),
    _c("tp4-hang-collective", "tp", 4, 200, {"kind": "desync", "rank": 3, "step": 30},
       tags=HELD),
    _c("ddp4-slow-fwd-x5-long", "ddp", 4, 90, _s(3, "fwd", 5, step=30), device_scale=2.0,
       tags=HELD),
    _c("pp4-cpu-hog-light", "pipeline", 4, 160, {"kind": "hog", "rank": 1, "step": 40,
                                                 "procs": 2}, tags=HELD),
    _c("tp4-stall", "tp", 4, 200, {"kind": "stall", "rank": 1, "step": 40, "stall_s": 4},
       tags=HELD),
    _c("pp8-kill", "pipeline", 8, 200, {"kind": "kill", "rank": 4, "step": 40}, **PP8,
       tags=HELD),
]

BY_NAME = {c.name: c for c in CASES}
QUICK = [c.name for c in CASES if "quick" in c.tags]


def select(names: str, quick: bool) -> list[Case]:
    """The cases named (comma-separated names, ``prefix*`` or a tag — ``heldout``,
    ``extended``, ``quick``, ``overhead``; ``all``: every case), the quick subset, or the
    standard catalog (all but the ``extended`` cases, so that one run fits in ~25 minutes on 2
    cores); raises ValueError naming what is unknown."""
    if quick and not names:
        return [BY_NAME[n] for n in QUICK]
    if not names:
        return [c for c in CASES if "extended" not in c.tags]
    if names.strip() == "all":
        return list(CASES)
    out: list[Case] = []
    for raw in (n.strip() for n in names.split(",")):
        if not raw:
            continue
        hit = [c for c in CASES if c.name == raw or raw in c.tags
               or (raw.endswith("*") and c.name.startswith(raw[:-1]))]
        if not hit:
            raise ValueError(f"unknown case {raw!r} (rankwatch eval --real --list shows them)")
        out += [c for c in hit if c not in out]
    return out
