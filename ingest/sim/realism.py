"""Realism: the noise real training runs have and the clean model lacks (all off by default).

Measured on real multi-process PyTorch jobs (gloo on CPU, 4–8 processes on 2 cores), step
times are not a 3 % log-normal around a mean. They have:

- **heavy-tailed jitter** — most passes close to nominal, a few much longer: a log-normal body
  times, with probability `tail_p`, a Pareto (Lomax) excess `1 + tail_scale·X`, X ~ Lomax(α)
  (`heavy_tail`). With α ≤ 2 the excess has no finite variance, as scheduler-induced
  slowdowns of shared machines are usually described.
- **OS noise** — preemptions arrive at `os_pause_rate` per second of a phase's run time (a
  Poisson process, so a phase of d seconds is hit with probability 1 − e^(−rate·d): a long
  backward more often than a short callback), each a pause of a few to tens of ms (log-uniform
  in [`os_pause_min_ms`, `os_pause_max_ms`]: other processes' time slices, daemons, page
  reclaim; `os_pauses`).
- **ranks sharing cores** — consecutive ranks in groups of `core_group` run on the same cores:
  a per-step, per-group factor (log-normal, `core_sigma`) slows the whole group together, and
  inside a pass slot the members take turns (`interleave`: a random order per group, the k-th
  member waits k scheduler quanta of `core_quantum_ms`).
- **communicators that differ** — every communicator (a DP ring, a PP link) gets a persistent
  transfer-speed factor for the run (log-normal, `ring_sigma`: placement, NUMA, which cores the
  transport threads got), and every call a log-normal transfer noise (`xfer_sigma`). With two
  DP rings one of them is, at random, "the slower one" for the whole run.
- **no kernel records** — a CPU job traced by the PyTorch tracer has ops and stages only
  (`kernels = false`).

Stage times contain waiting in both modes: a rank's `model_backward` covers its backward
passes *and* its time in the DP gradient all-reduce, which lasts until the slowest DP peer
arrives — as DDP's backward does (the all-reduce hooks run inside `loss.backward()`) and as a
pipeline's gradient sync does; a PP stage's passes include their Recv waits.

Every function here is pure: the caller passes the generator. The engine draws realism from
its own streams (`step_rng`, `run_rng`), so a run with realism off draws exactly what it drew
before realism existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

REALISM_STREAM = 0x5EA1

# `realism = "cpu"` in a catalog / `rankwatch simulate --realism`: the noise of the real CPU runs
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "noise_sigma": 0.06,
        "tail_p": 0.08, "tail_alpha": 1.7, "tail_scale": 0.25,
        "os_pause_rate": 1.0, "os_pause_min_ms": 2.0, "os_pause_max_ms": 40.0,
        "core_group": 2, "core_sigma": 0.1, "core_quantum_ms": 0.5,
        "ring_sigma": 0.3, "xfer_sigma": 0.15,
        "kernels": False,
    },
}


@dataclass(frozen=True)
class RealismParams:
    """The JobConfig's realism fields, gathered (see module docstring for their meaning)."""

    tail_p: float = 0.0
    tail_alpha: float = 1.7
    tail_scale: float = 0.25
    os_pause_rate: float = 0.0
    os_pause_min_ms: float = 2.0
    os_pause_max_ms: float = 40.0
    core_group: int = 1
    core_sigma: float = 0.0
    core_quantum_ms: float = 0.0
    ring_sigma: float = 0.0
    xfer_sigma: float = 0.0

    @property
    def compute(self) -> bool:
        """Whether any compute-side effect is on."""
        return (self.tail_p > 0 or self.os_pause_rate > 0
                or (self.core_group > 1 and (self.core_sigma > 0 or self.core_quantum_ms > 0)))

    @property
    def comm(self) -> bool:
        return self.ring_sigma > 0 or self.xfer_sigma > 0

    @property
    def on(self) -> bool:
        return self.compute or self.comm


def validate(p: RealismParams) -> None:
    """Raise ValueError naming the field, its value and what is expected."""
    def need(ok: bool, name: str, expected: str) -> None:
        if not ok:
            raise ValueError(f"{name}={getattr(p, name)!r}: expected {expected}")
    need(0 <= p.tail_p <= 1, "tail_p", "a probability in [0, 1]")
    need(p.tail_alpha > 0, "tail_alpha", "a Pareto shape > 0")
    need(p.tail_scale >= 0, "tail_scale", "a scale >= 0")
    need(p.os_pause_rate >= 0, "os_pause_rate", "a rate >= 0 (pauses per second)")
    need(p.os_pause_min_ms > 0, "os_pause_min_ms", "a duration > 0 ms")
    need(p.os_pause_max_ms >= p.os_pause_min_ms, "os_pause_max_ms",
         f">= os_pause_min_ms ({p.os_pause_min_ms})")
    need(p.core_group >= 1, "core_group", "an integer >= 1")
    for name in ("core_sigma", "core_quantum_ms", "ring_sigma", "xfer_sigma"):
        need(getattr(p, name) >= 0, name, "a value >= 0")


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The realism generator of one step (independent of the clean model's stream)."""
    return np.random.default_rng([seed, step, REALISM_STREAM])


def run_rng(seed: int) -> np.random.Generator:
    """The realism generator of per-run draws (communicator speeds)."""
    return np.random.default_rng([seed, REALISM_STREAM])


def heavy_tail(rng: np.random.Generator, shape: tuple[int, ...], p: float, alpha: float,
               scale: float) -> np.ndarray:
    """Multiplicative slowdown ≥ 1: 1 + scale·X with probability p, X ~ Lomax(alpha) (Pareto II,
    P(X > x) = (1 + x)^-alpha); 1 otherwise."""
    hit = rng.random(shape) < p
    x = rng.pareto(alpha, shape)
    return np.asarray(np.where(hit, 1.0 + scale * x, 1.0))


def os_pauses(rng: np.random.Generator, dur: np.ndarray, rate: float, lo_ms: float,
              hi_ms: float) -> np.ndarray:
    """Seconds added by OS noise to phases lasting `dur` seconds: a pause log-uniform in
    [lo_ms, hi_ms] with probability 1 − exp(−rate·dur) (at most one per phase), else 0."""
    shape = np.shape(dur)
    with np.errstate(invalid="ignore"):  # a hung phase (inf) is hit: it never ends anyway
        p = -np.expm1(-rate * np.asarray(dur, dtype=np.float64))
    hit = rng.random(shape) < p
    ms = np.exp(rng.uniform(np.log(lo_ms), np.log(hi_ms), shape))
    return np.asarray(np.where(hit, ms / 1e3, 0.0))


def core_groups(ranks: np.ndarray, size: int) -> np.ndarray:
    """Core group of each rank: consecutive ranks in groups of `size` (ranks on one host are
    numbered consecutively, as torchrun places them)."""
    return np.asarray(ranks, dtype=np.int64) // max(size, 1)


def group_factor(rng: np.random.Generator, groups: np.ndarray, sigma: float) -> np.ndarray:
    """One log-normal factor per group, broadcast to its members (arrays shaped like
    `groups`): ranks sharing cores slow down together."""
    n = int(groups.max()) + 1 if groups.size else 0
    f = np.exp(sigma * rng.standard_normal(n))
    return np.asarray(f[groups])


def interleave(rng: np.random.Generator, groups: np.ndarray, quantum_s: float) -> np.ndarray:
    """Seconds each rank waits for its turn on shared cores: within each group the members get
    a random order, the k-th waits k quanta (the first runs at once). `groups` is flat."""
    n = groups.size
    key = groups * 2.0 + rng.random(n)  # random order inside each group, groups kept apart
    order = np.argsort(key, kind="stable")
    g_sorted = groups[order]
    start = np.searchsorted(g_sorted, g_sorted, side="left")
    turn = np.empty(n, dtype=np.int64)
    turn[order] = np.arange(n) - start
    return np.asarray(turn * quantum_s)


def comm_speed(rng: np.random.Generator, n_comms: int, sigma: float) -> np.ndarray:
    """Persistent transfer-time factor per communicator (log-normal, drawn once per run)."""
    return np.asarray(np.exp(sigma * rng.standard_normal(n_comms)))


def lognormal(rng: np.random.Generator, shape: tuple[int, ...], sigma: float) -> np.ndarray:
    """exp(sigma·N(0,1)): median 1."""
    return np.asarray(np.exp(sigma * rng.standard_normal(shape)))
