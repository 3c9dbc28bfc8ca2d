"""Host-side stage phases from the `stages` record (StageFrontier's contract): the data loader
wait (the rank's own loader), callbacks, the residual `step_other` and the optimizer step —
quantities in which a rank does not wait for its peers — compared with the ranks of the same
PP stage (`judge`, `sparse`: a slow batch or a stalled callback is intermittent).

Several CPU-side phases of one rank slower together (each by `phase_ratio`, each material) is
that rank's host CPU (stage "host cpu", host_software), not each phase on its own.
"""

from __future__ import annotations

import numpy as np

from diagnosis.conclusion import Suspicion
from diagnosis.slow.context import Ctx, judge, persistence, reference, stage_matrix

PHASES = (("data_next_wait", "data", "data_loader"), ("callbacks", "callbacks", "host_software"),
          ("step_other", "host cpu", "host_software"), ("optim_step", "optim", "gpu_compute"))
CPU_PHASES = ("data_next_wait", "callbacks", "step_other")


def suspects(ctx: Ctx) -> list[Suspicion]:
    res = {}
    for name, _, _ in PHASES:
        m = stage_matrix(ctx, name)
        ref = reference(m, ctx.stage_of)
        v = judge(ctx, m, ctx.cfg.min_ratio, ref=ref, sparse=True)
        stepped = v.flag & np.isin(v.how, ("change", "absorbed"))
        res[name] = (v, persistence(m, ref, np.where(stepped, v.since, -1)))
    out: list[Suspicion] = []
    # a phase of a few microseconds (callbacks that print a loss line every 10 steps) reaches
    # any ratio on noise: only a phase whose own excess is material is a hit
    material = ctx.cfg.min_share / 3 * ctx.step_ns
    cpu_hits = np.sum([(res[n][0].ratio >= ctx.cfg.phase_ratio) & (res[n][0].exc >= material)
                       for n in CPU_PHASES], axis=0)
    cpu_exc = np.sum([res[n][0].exc for n in CPU_PHASES], axis=0)
    any_flag = np.any([res[n][0].flag for n in CPU_PHASES], axis=0)
    cpu = (cpu_hits >= 2) & (cpu_exc >= ctx.cfg.min_share * ctx.step_ns) & any_flag
    for x in np.flatnonzero(cpu).tolist():
        z = max(float(res[n][0].z[x]) for n in CPU_PHASES)
        first = next(res[n][0] for n in CPU_PHASES if res[n][0].flag[x])
        how = str(first.how[x])
        out.append(Suspicion((x,), "host cpu", "host_software", float(cpu_exc[x]),
                             ("rankwatch.excess.host_cpu",),
                             f"rank {x}: CPU-side phases (data, callbacks, other) "
                             f"{', '.join(f'{res[n][0].ratio[x]:.1f}x' for n in CPU_PHASES)} "
                             f"of peers ({how} {z:.1f}σ)", z, how,
                             int(ctx.steps[first.since[x]])))
    for name, stage, comp in PHASES:
        v, pers = res[name]
        for x in np.flatnonzero(v.flag & ~cpu).tolist():
            mode = "persistent" if pers[x] >= 0.6 and v.how[x] != "sparse" else "intermittent"
            out.append(Suspicion((x,), stage, comp, float(v.exc[x]),  # type: ignore[arg-type]
                                 (f"rankwatch.excess.{name}",),
                                 f"rank {x}: {name} {v.ratio[x]:.2f}x its peers, "
                                 f"+{v.exc[x] / 1e6:.1f} ms/step ({mode}; {v.how[x]} "
                                 f"{v.z[x]:.1f}σ)", float(v.z[x]), str(v.how[x]),
                             int(ctx.steps[v.since[x]])))
    return out
