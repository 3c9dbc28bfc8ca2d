"""Named scenarios from the versioned catalog `scenarios.toml` (loaded with tomllib).

A scenario is a JobConfig (any JobConfig field as a key) plus fault specs. The catalog covers
every fault family at several magnitudes — including ones too small to matter, marked
`expect=no` in their spec — rank counts from 8 to 4,096, simultaneous faults and no-fault
controls. `rankwatch eval` scores diagnoses against it; `rankwatch simulate --scenario NAME`
runs one.

Catalogs by name: `standard` (scenarios.toml, the clean model) and `realistic`
(realistic.toml: the noise of real CPU jobs, ingest/sim/realism.py — fault-free controls of
several shapes and lengths, and faults seen on real runs); any other value is a file path.
`realism = "NAME"` in a scenario (or the catalog's defaults) applies a preset of realism keys
(`realism.PRESETS`; keys given explicitly win; "off" applies none).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from ingest.sim.config import JobConfig
from ingest.sim.faults import parse_fault
from ingest.sim.realism import PRESETS

CATALOGS = {"standard": "scenarios.toml", "realistic": "realistic.toml"}

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
    preset = str(raw.pop("realism", "off"))
    if preset != "off":
        if preset not in PRESETS:
            raise ValueError(f"scenario {name!r}: realism={preset!r}; valid: off, "
                             + ", ".join(sorted(PRESETS)))
        raw = {**PRESETS[preset], **raw}
    faults = tuple(raw.pop("faults", ()))
    description = str(raw.pop("description", ""))
    tags = tuple(raw.pop("tags", ()))
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"scenario {name!r}: unknown keys {sorted(unknown)}; valid: "
                         f"faults, description, tags, realism, {', '.join(sorted(known))}")
    raw.setdefault("job_id", name)
    cfg = JobConfig(**raw)
    for spec in faults:
        parse_fault(spec).target(cfg.layout)  # fail at load time, naming the scenario's spec
    return Scenario(name, cfg, faults, description, tags)


def load_catalog(path: str | Path | None = None) -> dict[str, Scenario]:
    """All scenarios of a catalog: a shipped one by name (`CATALOGS`; default standard) or a
    file."""
    name = "standard" if path is None else str(path)
    if name in CATALOGS:
        text = resources.files("ingest.sim").joinpath(CATALOGS[name]).read_text()
    else:
        p = Path(path)  # type: ignore[arg-type]
        if not p.is_file():
            raise ValueError(f"catalog {name!r}: not a shipped catalog "
                             f"({', '.join(CATALOGS)}) nor a file")
        text = p.read_text()
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
