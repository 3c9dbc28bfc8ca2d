"""The 1F1B pipeline schedule (PipeDream-Flush / Megatron's default).

Stage s of p runs min(p - s - 1, M) warm-up forwards, then alternates one forward and one backward
(steady state) and ends with the remaining backwards (cool-down). The bubble this leaves on early
stages is the slack that can absorb a small delay entirely (VenusTrace §3.3, Fig. 13).

`global_order` linearizes all stages into one list in which every op comes after the ops it
depends on — F(s, m) after F(s-1, m), B(s, m) after B(s+1, m) (or after F(p-1, m) on the last
stage), and each stage's own previous op — so an engine can compute times with one pass.
"""

from __future__ import annotations

from typing import Literal

Pass = Literal["F", "B"]
Slot = tuple[int, Pass, int]  # (pp stage, pass, microbatch)


def stage_order(pp: int, microbatches: int, stage: int) -> list[tuple[Pass, int]]:
    """The 1F1B order of passes on one stage: [("F", 0), ("F", 1), ("B", 0), ...]."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} out of range for pp={pp}")
    m = microbatches
    warm = min(pp - stage - 1, m)
    out: list[tuple[Pass, int]] = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out.append(("F", f))
        f += 1
        out.append(("B", b))
        b += 1
    out.extend(("B", i) for i in range(b, m))
    return out


def global_order(pp: int, microbatches: int) -> list[Slot]:
    """All (stage, pass, microbatch) slots in a dependency-respecting order."""
    orders = [stage_order(pp, microbatches, s) for s in range(pp)]
    pos = [0] * pp
    done: set[Slot] = set()
    out: list[Slot] = []
    total = sum(len(o) for o in orders)
    while len(out) < total:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, m = orders[s][pos[s]]
                if kind == "F":
                    ready = s == 0 or (s - 1, "F", m) in done
                else:
                    ready = (s, "F", m) in done if s == pp - 1 else (s + 1, "B", m) in done
                if not ready:
                    break
                done.add((s, kind, m))
                out.append((s, kind, m))
                pos[s] += 1
                progressed = True
        if not progressed:  # cannot happen for 1F1B; guards against a broken order
            raise RuntimeError("1F1B schedule has a dependency cycle")
    return out
