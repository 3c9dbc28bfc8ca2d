"""Mycroft Table 3 flow/op rules: constant late start (culprit) vs late end (waiters)."""

from __future__ import annotations

import numpy as np

from diagnosis.groups import grid_of
from diagnosis.rules.mycroft_flow import late_ends, late_starts, slow_flows
from ingest.units import MILLISECOND as MS
from ingest.units import SECOND as S
from tests.unit.topo_fixtures import megatron_topology

GRID = grid_of(megatron_topology(1, 1, 4))  # one DP group dp:pp0:tp0 = [0, 1, 2, 3]
COMM = "dp:pp0:tp0"


def allreduces(n_ops: int = 10, *, arrive: dict[int, int] | None = None,
               launch: dict[int, int] | None = None, finish: dict[int, int] | None = None,
               offset: dict[int, int] | None = None, xfer: int = 20 * MS) -> dict[str, np.ndarray]:
    """Four ranks, `n_ops` AllReduces 1 s apart. arrive: extra call delay per rank; launch: delay
    between call and start; finish: extra end delay; offset: clock offset of the rank's host."""
    arrive, launch, finish, offset = (d or {} for d in (arrive, launch, finish, offset))
    rows: list[tuple[int, int, int, int, int]] = []
    for k in range(n_ops):
        t0 = k * S
        starts = {r: t0 + arrive.get(r, 0) + launch.get(r, 0) for r in range(4)}
        end = max(starts.values()) + xfer
        for r in range(4):
            o = offset.get(r, 0)
            rows.append((r, k, t0 + arrive.get(r, 0) + o, starts[r] + o,
                         end + finish.get(r, 0) + o))
    a = np.asarray(rows, dtype=np.int64)
    return {"rank": a[:, 0], "comm_id": np.full(len(rows), COMM, dtype=object), "op_seq": a[:, 1],
            "op": np.full(len(rows), "AllReduce", dtype=object), "t_enqueue": a[:, 2],
            "t_start": a[:, 3], "t_end": a[:, 4]}


def test_constant_late_arrival_is_the_culprit_not_the_waiters():
    ops = allreduces(arrive={2: 30 * MS}, offset={1: 3 * MS, 3: -4 * MS})
    found = late_starts(ops, GRID, 100 * S)
    assert [(f.culprit_ranks, f.component) for f in found] == [((2,), "gpu_compute")]
    assert "late_arrival" in found[0].labels and found[0].kind == "slowdown"
    assert late_ends(ops, GRID, 100 * S) == []  # everyone ended late because of rank 2


def test_proxy_delay_is_late_launch_software():
    found = late_starts(allreduces(launch={1: 40 * MS}), GRID, 100 * S)
    assert [(f.culprit_ranks, f.component) for f in found] == [((1,), "host_software")]
    assert "late_launch" in found[0].labels


def test_constant_clock_offset_is_not_lateness():
    ops = allreduces(offset={3: 50 * MS, 0: -20 * MS})
    assert late_starts(ops, GRID, 100 * S) == [] and late_ends(ops, GRID, 100 * S) == []


def test_occasional_lateness_is_not_constant():
    ops = allreduces(arrive={2: 30 * MS})
    keep = ~((ops["rank"] == 2) & (ops["op_seq"] >= 3))
    ops2 = allreduces()
    mixed = {k: np.concatenate([ops[k][keep], ops2[k][(ops2["rank"] == 2)
                                                    & (ops2["op_seq"] >= 3)]]) for k in ops}
    assert late_starts(mixed, GRID, 100 * S) == []


def test_late_end_when_nobody_starts_late():
    found = late_ends(allreduces(finish={1: 25 * MS}), GRID, 100 * S)
    assert [f.culprit_ranks for f in found] == [(1,)]
    assert late_starts(allreduces(finish={1: 25 * MS}), GRID, 100 * S) == []


def test_slow_and_incomplete_flows():
    rows: list[tuple[int, int, int, int, int, int]] = []
    for k in range(6):
        for r in range(4):
            for ch in range(2):
                dur = 60 * MS if (r == 3 and ch == 1) else 10 * MS
                rows.append((r, k, ch, (r + 1) % 4, k * S, k * S + dur))
    rows.append((0, 6, 0, 1, 90 * S, 90 * S + 10 * MS))
    rows.append((2, 6, 0, 3, 90 * S, 0))  # never completes
    a = np.asarray(rows, dtype=np.int64)
    flows = {"rank": a[:, 0], "comm_id": np.full(len(rows), COMM, dtype=object),
             "op_seq": a[:, 1], "channel": a[:, 2], "peer": a[:, 3],
             "nic": np.asarray([f"mlx5_{r}" for r in a[:, 0]], dtype=object),
             "t_start": a[:, 4], "t_end": a[:, 5]}
    found = {f.rule: f for f in slow_flows(flows, 100 * S)}
    assert found["mycroft.table3.slow_flow"].culprit_ranks == (3,)
    assert found["mycroft.table3.slow_flow"].evidence["nic"] == "mlx5_3"
    assert found["mycroft.table3.flow_incomplete"].culprit_ranks == (2,)
