"""What a right diagnosis of each injected fault says, in the vocabulary of diagnosis/model.py.

The training job (`bench.real.workload`) calls `expected` when its fault begins and writes the
result into its ground truth; docs/real-catalog.md has the table and the reasons.
"""

from __future__ import annotations

from typing import Any


def expected(kind: str, stage: str, shape: str, pp_stage: int, mb: int) -> dict[str, Any]:
    """The labels of a right diagnosis, in the vocabulary of diagnosis/model.py.

    `stage` is what a right diagnosis names first; `accept` lists the other stage strings that
    count as right (a trailing ``*`` is a prefix). docs/real-catalog.md has the table."""
    comm = {"ddp": "dp_allreduce", "tp": "tp_collectives", "pipeline": "pp_p2p"}[shape]
    compute_comp = "gpu_compute"  # the vocabulary's model-compute component (no GPU here)
    node_mb = mb if shape == "pipeline" else 0
    node_pp = pp_stage if shape == "pipeline" else 0
    if kind in ("hang", "stall"):
        if stage in ("fwd", "bwd"):
            node = f"{stage} mb={node_mb} pp={node_pp}"
            accept = [node] if shape == "pipeline" else [node, f"{stage} *"]
            return {"kind": "hang", "stage": node, "accept": accept, "component": compute_comp}
        if stage == "data":
            return {"kind": "hang", "stage": "data", "accept": ["data"],
                    "component": "data_loader"}
        return {"kind": "hang", "stage": "optim", "accept": ["optim"],
                "component": compute_comp}
    if kind == "desync":
        return {"kind": "hang", "stage": "dp_allreduce", "accept": ["dp_allreduce"],
                "component": "host_software"}
    if kind == "kill":
        return {"kind": "hang", "stage": "process", "accept": ["process"],
                "component": "host_software"}
    if kind == "hog":
        return {"kind": "slowdown", "stage": "host cpu", "accept": ["host cpu"],
                "component": "host_software"}
    if kind == "link":
        return {"kind": "slowdown", "stage": comm, "accept": [comm], "component": "nic_rdma"}
    # slow
    if stage in ("fwd", "bwd"):
        return {"kind": "slowdown", "stage": "compute", "accept": ["compute", f"{stage} *"],
                "component": compute_comp}
    if stage == "data":
        return {"kind": "slowdown", "stage": "data", "accept": ["data"],
                "component": "data_loader"}
    return {"kind": "slowdown", "stage": "optim", "accept": ["optim"], "component": compute_comp}
