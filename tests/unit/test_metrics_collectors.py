"""What the agent's and notify's /metrics say, read back through Prometheus's own text parser:
ring drops per rank from real native rings, and per-sink delivery counters."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ingest import ring
from ingest.agent.agent import Agent, AgentConfig
from ingest.torch.sink import RingSink
from rankwatch import metrics
from tests.unit.test_agent_loop import FakePublisher

try:
    ring.load_library()
except ring.RingLibraryMissing as e:  # pragma: no cover - `make build` builds it
    pytest.skip(str(e), allow_module_level=True)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"/rwm{uuid.uuid4().hex[:8]}"
    yield p
    for name in ring.list_rings(p):
        ring.load_library().rw_ring__unlink(name.encode())


def test_agent_metrics_count_ring_drops_per_rank(tmp_path: Path, prefix: str) -> None:
    full = RingSink("job1", 3, 64, prefix)
    calm = RingSink("job1", 4, 64, prefix)
    for step in range(100):  # nobody drains: 64 fit, 36 are dropped
        full.stage(step, 1, 2, 3, 4, 5, 6, 7, -1)
    calm.stage(0, 1, 2, 3, 4, 5, 6, 7, -1)
    agent = Agent(AgentConfig(tmp_path, prefix=prefix, linger_s=0.0), FakePublisher())
    agent.discover()
    registry = CollectorRegistry()
    registry.register(metrics.AgentCollector(agent))
    got = samples(registry)
    drops = {dict(k[1])["rank"]: v for k, v in got.items() if k[0] == "rankwatch_ring_drops_total"}
    assert drops == {"3": 36.0, "4": 0.0}
    backlog = {dict(k[1])["rank"]: v for k, v in got.items()
               if k[0] == "rankwatch_ring_backlog_bytes"}
    assert backlog["3"] > backlog["4"] > 0
    assert got[("rankwatch_agent_tracer_dropped", ())] == 36.0
    full.close()
    calm.close()
