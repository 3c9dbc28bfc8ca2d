"""Fault specs: `FAMILY key=value ...`, one dataclass per family, parsed through a dispatch table.

    hang rank=13 stage=bwd mb=3 at=30s            compute hang, permanent
    nic_bw host=2 factor=0.25 at=10s for=20s       NIC bandwidth cut to 25 % for 20 s

Keys every family takes: `rank=` (comma list) and/or `host=` (comma list of host indices), `at=`
(onset in simulated job time, default 0), `for=` (duration; absent or `inf` = permanent) and
`expect=yes|no` (whether a diagnosis should find it; default yes). Durations take s/ms/us/m
suffixes; a bare number is seconds. Family keys are listed by `describe_families()` and in every
parse error. Which mechanism each family drives in the engine is documented on its class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from ingest.sim.topology import Layout


class FaultSpecError(ValueError):
    """A fault spec that cannot be parsed; the message lists what is valid."""


@dataclass(frozen=True)
class Fault:
    """Common fields. `ranks`/`hosts` name the target; `duration` None means permanent."""

    family: ClassVar[str] = ""
    component: ClassVar[str] = "gpu"
    host_level: ClassVar[bool] = False  # the fault hits every rank of a host
    ranks: tuple[int, ...] = ()
    hosts: tuple[int, ...] = ()
    at: float = 0.0
    duration: float | None = None
    expect: bool = True
    spec: str = ""

    @property
    def end(self) -> float:
        return math.inf if self.duration is None else self.at + self.duration

    def active(self, t: float) -> bool:
        return self.at <= t < self.end

    def target(self, layout: Layout) -> np.ndarray:
        """Sorted int64 ranks the fault acts on (host-level faults cover whole hosts)."""
        for r in self.ranks:
            if not 0 <= r < layout.world:
                raise FaultSpecError(f"{self.spec!r}: rank={r} is outside 0..{layout.world - 1}")
        for h in self.hosts:
            if not 0 <= h < layout.n_hosts:
                raise FaultSpecError(f"{self.spec!r}: host={h} is outside 0..{layout.n_hosts - 1}")
        ranks = set(self.ranks)
        hosts = set(self.hosts)
        if self.host_level:
            hosts |= {int(layout.host_of[r]) for r in ranks}
        for h in hosts:
            ranks |= set(np.flatnonzero(layout.host_of == h).tolist())
        return np.array(sorted(ranks), dtype=np.int64)

    def stage_label(self, layout: Layout) -> str:
        return "dp_allreduce"

    @property
    def magnitude(self) -> float:
        return float(getattr(self, "factor", getattr(self, "delay", 0.0)))


@dataclass(frozen=True)
class Hang(Fault):
    """Compute hang: the first matching pass at or after `at` stalls for `for` (or forever).
    stage: fwd|bwd (microbatch `mb`), optim, data. Component gpu (dataloader for data)."""

    family: ClassVar[str] = "hang"
    stage: str = "bwd"
    mb: int = 0

    def validate(self) -> None:
        _choice("stage", self.stage, ("fwd", "bwd", "optim", "data"))
        _check(self.mb >= 0, "mb", self.mb, "an integer >= 0")

    def stage_label(self, layout: Layout) -> str:
        if self.stage in ("fwd", "bwd"):
            pps = sorted({layout.position(r)[1] for r in self.ranks})
            return f"{self.stage} mb={self.mb} pp={','.join(map(str, pps))}"
        return self.stage

    @property
    def magnitude(self) -> float:
        return math.inf if self.duration is None else self.duration


@dataclass(frozen=True)
class Death(Fault):
    """Process death at `at`: the rank's records stop; its peers wait forever."""

    family: ClassVar[str] = "death"
    component: ClassVar[str] = "software"

    def stage_label(self, layout: Layout) -> str:
        return "process"


@dataclass(frozen=True)
class NicDown(Fault):
    """NIC down: nothing leaves or enters the rank's NIC until the fault ends."""

    family: ClassVar[str] = "nic_down"
    component: ClassVar[str] = "nic"


@dataclass(frozen=True)
class NicBandwidth(Fault):
    """NIC bandwidth limit to `factor` (0..1) of nominal: rdma_transmitted lags gpu_ready."""

    family: ClassVar[str] = "nic_bw"
    component: ClassVar[str] = "nic"
    factor: float = 0.25

    def validate(self) -> None:
        _check(0 < self.factor < 1, "factor", self.factor, "a bandwidth fraction in (0, 1)")


@dataclass(frozen=True)
class ReceiverFailure(Fault):
    """Receiver failure: data sent to the rank is never acknowledged (sender transmitted > done,
    receiver's own counters all equal)."""

    family: ClassVar[str] = "recv_fail"
    component: ClassVar[str] = "nic"


@dataclass(frozen=True)
class PcieDowngrade(Fault):
    """PCIe link downgraded to `factor` of its bandwidth: GPU↔NIC staging and host-to-device
    copies slow; counters stay equal but advance slowly; kernels stay normal."""

    family: ClassVar[str] = "pcie"
    component: ClassVar[str] = "pcie"
    factor: float = 0.25

    def validate(self) -> None:
        _check(0 < self.factor < 1, "factor", self.factor, "a bandwidth fraction in (0, 1)")


@dataclass(frozen=True)
class GpuSlow(Fault):
    """GPU power limit / slow compute: every kernel on the rank takes `factor` times longer."""

    family: ClassVar[str] = "gpu_slow"
    factor: float = 1.3

    def validate(self) -> None:
        _check(self.factor > 1, "factor", self.factor, "a slowdown factor > 1")

    def stage_label(self, layout: Layout) -> str:
        return "compute"


@dataclass(frozen=True)
class HostCompute(GpuSlow):
    """Background compute contention on a host: all its ranks' kernels slow by `factor`."""

    family: ClassVar[str] = "host_compute"
    component: ClassVar[str] = "host"
    host_level: ClassVar[bool] = True


@dataclass(frozen=True)
class BackgroundTraffic(Fault):
    """Background network traffic on the host's NICs: delivery latency and serialization grow by
    `factor`; gpu_ready == rdma_transmitted but rdma_done lags (Mycroft #6)."""

    family: ClassVar[str] = "bg_traffic"
    component: ClassVar[str] = "nic"
    host_level: ClassVar[bool] = True
    factor: float = 4.0

    def validate(self) -> None:
        _check(self.factor > 1, "factor", self.factor, "a slowdown factor > 1")


@dataclass(frozen=True)
class ProxyDelay(Fault):
    """NCCL proxy delay: with probability `p` per collective the proxy thread sleeps `delay`
    before progressing it, so the rank starts transmitting late (Mycroft #7)."""

    family: ClassVar[str] = "proxy_delay"
    component: ClassVar[str] = "software"
    p: float = 0.05
    delay: float = 1.0

    def validate(self) -> None:
        _check(0 < self.p <= 1, "p", self.p, "a probability in (0, 1]")
        _check(self.delay > 0, "delay", self.delay, "a duration > 0")


@dataclass(frozen=True)
class DataStall(Fault):
    """Data-loader stall: one step's data.next_wait grows by `delay` at the first step >= at."""

    family: ClassVar[str] = "data_stall"
    component: ClassVar[str] = "dataloader"
    delay: float = 2.0

    def validate(self) -> None:
        _check(self.delay > 0, "delay", self.delay, "a duration > 0")

    def stage_label(self, layout: Layout) -> str:
        return "data"


@dataclass(frozen=True)
class DataTail(DataStall):
    """Data tail: each step, with probability `p`, data.next_wait grows by `delay`."""

    family: ClassVar[str] = "data_tail"
    p: float = 0.2
    delay: float = 0.12

    def validate(self) -> None:
        super().validate()
        _check(0 < self.p <= 1, "p", self.p, "a probability in (0, 1]")


@dataclass(frozen=True)
class CallbackSpike(Fault):
    """Periodic callback spike: every `every` steps the callbacks stage grows by `delay`."""

    family: ClassVar[str] = "callback_spike"
    component: ClassVar[str] = "host"
    every: int = 10
    delay: float = 0.5

    def validate(self) -> None:
        _check(self.every >= 1, "every", self.every, "an integer >= 1")
        _check(self.delay > 0, "delay", self.delay, "a duration > 0")

    def stage_label(self, layout: Layout) -> str:
        return "callbacks"


KERNEL_CLASSES = ("gemm", "attn", "elementwise")


@dataclass(frozen=True)
class KernelSlow(Fault):
    """Single-kernel degradation: kernels of one class (`kernel`) take `factor` times longer."""

    family: ClassVar[str] = "kernel_slow"
    kernel: str = "attn"
    factor: float = 2.0

    def validate(self) -> None:
        _choice("kernel", self.kernel, KERNEL_CLASSES)
        _check(self.factor > 1, "factor", self.factor, "a slowdown factor > 1")

    def stage_label(self, layout: Layout) -> str:
        return f"kernel {self.kernel}"


@dataclass(frozen=True)
class EccJitter(Fault):
    """ECC-like intermittent jitter: with probability `p` per compute pass a GEMM takes `factor`
    times longer (ARGUS Table 6: intermittent spikes, tail on specific kernels)."""

    family: ClassVar[str] = "ecc_jitter"
    p: float = 0.02
    factor: float = 8.0

    def validate(self) -> None:
        _check(0 < self.p <= 1, "p", self.p, "a probability in (0, 1]")
        _check(self.factor > 1, "factor", self.factor, "a slowdown factor > 1")

    def stage_label(self, layout: Layout) -> str:
        return "compute"


@dataclass(frozen=True)
class CpuContention(Fault):
    """Host CPU contention: CPU-side work (data loading, callbacks, optimizer launch, step
    overhead, kernel launch gaps) on every rank of the host slows by `factor`; kernels normal."""

    family: ClassVar[str] = "cpu_contention"
    component: ClassVar[str] = "host"
    host_level: ClassVar[bool] = True
    factor: float = 3.0

    def validate(self) -> None:
        _check(self.factor > 1, "factor", self.factor, "a slowdown factor > 1")

    def stage_label(self, layout: Layout) -> str:
        return "host cpu"


SLOW_STAGES = ("data", "fwd", "bwd", "optim")


@dataclass(frozen=True)
class StageSlow(Fault):
    """One stage of the rank's step slower by `factor`: its data loading (component dataloader)
    or its forward passes, backward passes or optimizer (compute, component gpu) — e.g. a layer
    whose backward recomputes, a loader that lost its workers. Its peers wait for it inside their
    own stages (a DP peer's backward contains the gradient all-reduce)."""

    family: ClassVar[str] = "stage_slow"
    stage: str = "bwd"
    factor: float = 4.0

    def validate(self) -> None:
        _choice("stage", self.stage, SLOW_STAGES)
        _check(self.factor > 1, "factor", self.factor, "a slowdown factor > 1")

    def stage_label(self, layout: Layout) -> str:
        if self.stage in ("fwd", "bwd"):
            pps = sorted({layout.position(r)[1] for r in self.ranks})
            return f"{self.stage} pp={','.join(map(str, pps))}"
        return self.stage


FAMILIES: dict[str, type[Fault]] = {
    c.family: c
    for c in (Hang, Death, NicDown, NicBandwidth, ReceiverFailure, PcieDowngrade, GpuSlow,
              HostCompute, BackgroundTraffic, ProxyDelay, DataStall, DataTail, CallbackSpike,
              KernelSlow, EccJitter, CpuContention, StageSlow)
}
_COMMON = ("rank", "host", "at", "for", "expect")
_SKIP = {"ranks", "hosts", "at", "duration", "expect", "spec"}


def family_keys(cls: type[Fault]) -> list[str]:
    return [*_COMMON, *(f.name for f in fields(cls) if f.name not in _SKIP)]


def describe_families() -> str:
    return "\n".join(f"  {name}: {' '.join(k + '=' for k in family_keys(cls))}"
                     for name, cls in FAMILIES.items())


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise FaultSpecError(f"{key}={value!r}: expected {expected}")


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    _check(value in options, key, value, "one of " + "|".join(options))


def parse_duration(text: str) -> float | None:
    """Seconds from '30s', '250ms', '50us', '2m' or a bare number; None for inf/forever."""
    t = text.strip().lower()
    if t in ("inf", "forever", "permanent"):
        return None
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if t.endswith(suffix):
            t, mult = t[: -len(suffix)], scale
            break
    else:
        mult = 1.0
    try:
        value = float(t) * mult
    except ValueError:
        raise FaultSpecError(f"{text!r} is not a duration (e.g. 30s, 250ms, 2m, inf)") from None
    if not math.isfinite(value) or value < 0:
        raise FaultSpecError(f"{text!r} is not a non-negative duration")
    return value


def _int_list(key: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise FaultSpecError(f"{key}={text!r}: expected integers like 3 or 1,5,9") from None


def parse_fault(spec: str) -> Fault:
    """Parse one spec; raises FaultSpecError naming the problem and listing what is valid."""
    words = spec.split()
    if not words:
        raise FaultSpecError("empty fault spec; valid families and keys:\n" + describe_families())
    name, *pairs = words
    cls = FAMILIES.get(name)
    if cls is None:
        raise FaultSpecError(f"unknown fault family {name!r}; valid families and keys:\n"
                             + describe_families())
    valid = family_keys(cls)
    kw: dict[str, Any] = {"spec": spec}
    types = {f.name: f.type for f in fields(cls)}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in valid:
            raise FaultSpecError(f"{spec!r}: unknown key {key!r} for {name}; valid keys: "
                                 + ", ".join(valid))
        try:
            kw.update(_convert(key, value, str(types.get(key, ""))))
        except FaultSpecError as e:
            raise FaultSpecError(f"{spec!r}: {e}") from None
    if not kw.get("ranks") and not kw.get("hosts"):
        raise FaultSpecError(f"{spec!r}: needs rank= or host= (valid keys: {', '.join(valid)})")
    fault = cls(**kw)
    validate = getattr(fault, "validate", None)
    if validate is not None:
        try:
            validate()
        except FaultSpecError as e:
            raise FaultSpecError(f"{spec!r}: {e}") from None
    return fault


def _convert(key: str, value: str, typ: str) -> dict[str, Any]:
    if key == "rank":
        return {"ranks": _int_list(key, value)}
    if key == "host":
        return {"hosts": _int_list(key, value)}
    if key == "at":
        at = parse_duration(value)
        if at is None:
            raise FaultSpecError(f"at={value!r}: expected a finite time")
        return {"at": at}
    if key == "for":
        return {"duration": parse_duration(value)}
    if key == "expect":
        _choice(key, value, ("yes", "no"))
        return {"expect": value == "yes"}
    if key == "delay":
        d = parse_duration(value)
        if d is None:
            raise FaultSpecError("delay=inf: expected a finite duration")
        return {key: d}
    if typ == "float":
        try:
            return {key: float(value)}
        except ValueError:
            raise FaultSpecError(f"{key}={value!r}: expected a number") from None
    if typ == "int":
        try:
            return {key: int(value)}
        except ValueError:
            raise FaultSpecError(f"{key}={value!r}: expected an integer") from None
    return {key: value}


@dataclass(frozen=True)
class FaultSet:
    """Faults of a run with their targets resolved against the layout."""

    faults: tuple[Fault, ...]
    targets: tuple[np.ndarray, ...] = field(default=())

    @classmethod
    def resolve(cls, faults: tuple[Fault, ...] | list[Fault], layout: Layout) -> FaultSet:
        return cls(tuple(faults), tuple(f.target(layout) for f in faults))
