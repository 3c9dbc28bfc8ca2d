"""`rankwatch report INCIDENT_ID --html FILE`: one incident's page as a self-contained HTML file
to attach to a ticket (the page the worker serves at /incidents/INCIDENT_ID), read through the
worker's SQL endpoint (or the database directly when no worker runs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import orjson

from rankwatch.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="write an incident's page as one HTML file",
                       description=__doc__)
    p.add_argument("incident_id", help="the incident (`rankwatch tail diagnoses` shows ids)")
    p.add_argument("--html", metavar="FILE", required=True, help="where to write the page")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=run)


def settings_query(settings: Settings) -> Any:
    from rankwatch.commands.sql import execute

    def query(sql: str) -> list[dict[str, Any]]:
        raw = execute(settings, sql, "JSONEachRow")
        return [orjson.loads(line) for line in raw.splitlines() if line.strip()]

    return query


def run(args: argparse.Namespace, settings: Settings) -> int:
    from diagnosis.page.data import load
    from diagnosis.page.render import incident_page
    from streams.db import ClickHouseError

    try:
        data = load(settings_query(settings), args.incident_id)
    except (ClickHouseError, RuntimeError) as e:
        print(f"rankwatch report: cannot read the incident: {e}", file=sys.stderr)
        return 1
    if data is None:
        print(f"rankwatch report: no incident {args.incident_id!r} is stored; `rankwatch sql "
              "\"SELECT DISTINCT incident_id FROM diagnoses\"` lists them", file=sys.stderr)
        return 1
    html = incident_page(data)
    out = Path(args.html)
    try:
        out.write_text(html)
    except OSError as e:
        print(f"rankwatch report: cannot write {out}: {e.strerror}", file=sys.stderr)
        return 1
    info = {"incident_id": args.incident_id, "file": str(out.resolve()), "bytes": len(html),
            "versions": len(data.versions), "ranks": data.world_size}
    print(json.dumps(info) if args.json else
          f"wrote {out} ({len(html):,} bytes): {data.latest.summary}")
    return 0
