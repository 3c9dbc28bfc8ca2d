"""The real-workload catalog: rankwatch diagnosing real PyTorch training (gloo, CPU).

- `workload`: the training script (DDP, a 1F1B pipeline × DP, tensor parallel × DP) with faults
  injected into one rank; it writes its own ground truth.
- `catalog`: the cases (shape, ranks, steps, fault, contention) and what a right diagnosis is.
- `harness`: one private stack, every case run through tracer → ring → `rankwatch agent` →
  broker → worker → rw.diagnoses, scored against the truth, plus the tracing overhead.

`rankwatch eval --real` is the command; docs/real-catalog.md explains the cases and the labels.
"""
