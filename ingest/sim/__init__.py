"""Discrete-event simulator of hybrid-parallel training that emits the contract's record batches.

Public API:

    from ingest.sim import Simulation, JobConfig, load_catalog, simulate

    sim = simulate("hang-bwd-small-job")            # a catalog scenario, or a Scenario/JobConfig
    for release_s, kind, data in sim.batches(): ...  # kind "jobs" first, then ops, chunks, ...
    sim.truth                                        # list[TruthRecord], complete after the run

See ingest/sim/README.md for the model, fault grammar and catalog.
"""

from ingest.sim.config import JobConfig
from ingest.sim.faults import FaultSpecError, describe_families, parse_fault
from ingest.sim.simulation import Simulation
from ingest.sim.truth import TruthRecord

__all__ = ["FaultSpecError", "JobConfig", "Simulation", "TruthRecord", "describe_families",
           "parse_fault"]
