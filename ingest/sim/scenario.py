"""Named scenarios from the versioned catalog `scenarios.toml` (loaded with tomllib).

A scenario is a JobConfig (any JobConfig field as a key) plus fault specs. The catalog covers
every fault family at several magnitudes — including ones too small to matter, marked
`expect=no` in their spec — rank counts from 8 to 4,096, simultaneous faults and no-fault
controls. `rankwatch eval` scores diagnoses against it; `rankwatch simulate --scenario NAME`
runs one.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from ingest.sim.config import JobConfig
from ingest.sim.faults import parse_fault

CATALOG_VERSION = 1


@dataclass(frozen=True)
class Scenario:
    name: str
    config: JobConfig
    faults: tuple[str, ...] = ()
    description: str = ""
    tags: tuple[str, ...] = field(default=())


def _scenario(name: str, raw: dict[str, Any], defaults: dict[str, Any]) -> Scenario:
    known = {f.name for f in fields(JobConfig)}
    raw = {**defaults, **raw}
    faults = tuple(raw.pop("faults", ()))
    description = str(raw.pop("description", ""))
    tags = tuple(raw.pop("tags", ()))
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"scenario {name!r}: unknown keys {sorted(unknown)}; valid: "
                         f"faults, description, tags, {', '.join(sorted(known))}")
    raw.setdefault("job_id", name)
    cfg = JobConfig(**raw)
    for spec in faults:
        parse_fault(spec).target(cfg.layout)  # fail at load time, naming the scenario's spec
    return Scenario(name, cfg, faults, description, tags)


def load_catalog(path: str | Path | None = None) -> dict[str, Scenario]:
    """All scenarios of the catalog (default: the one shipped beside this module)."""
    if path is None:
        text = resources.files("ingest.sim").joinpath("scenarios.toml").read_text()
    else:
        text = Path(path).read_text()
    doc = tomllib.loads(text)
    if doc.get("version") != CATALOG_VERSION:
        raise ValueError(f"catalog version {doc.get('version')!r}; this reader speaks "
                         f"{CATALOG_VERSION}")
    defaults = dict(doc.get("defaults", {}))
    return {name: _scenario(name, dict(raw), defaults)
            for name, raw in doc.get("scenario", {}).items()}


def get_scenario(name: str, path: str | Path | None = None) -> Scenario:
    catalog = load_catalog(path)
    if name not in catalog:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(sorted(catalog))}")
    return catalog[name]
