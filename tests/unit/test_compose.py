"""docker-compose.yml stays valid and in step with the CLI and the local stack's settings."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from rankwatch.cli import build_parser
from rankwatch.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_services_and_health_checks() -> None:
    services = compose()["services"]
    assert {"kafka", "clickhouse", "migrate", "topics", "worker"} <= set(services)
    for name in ("kafka", "clickhouse", "worker"):
        assert "healthcheck" in services[name], name
    assert services["worker"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully")


def test_rankwatch_service_commands_exist_in_the_cli() -> None:
    commands = cli_commands()
    for name, svc in compose()["services"].items():
        cmd = svc.get("command")
        if not cmd or cmd[0] != "rankwatch":
            continue
        parser = commands.get(cmd[1])
        assert parser is not None, f"service {name}: `rankwatch {cmd[1]}` is not a CLI command"
        parser.parse_args(cmd[2:])  # exits (fails the test) on an unknown sub-command or flag


def test_same_kafka_version_and_settings_as_the_local_stack() -> None:
    services = compose()["services"]
    assert services["kafka"]["image"] == f"apache/kafka:{Settings.load({}).kafka_version}"
    env = services["worker"]["environment"]
    Settings.load({k: str(v) for k, v in env.items()})  # every variable is a valid setting
    assert all(not k.startswith("RANKWATCH_") or k[10:].lower() in Settings.model_fields
               for k in env)


def test_published_ports_are_loopback_only() -> None:
    for name, svc in compose()["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
