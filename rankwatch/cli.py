"""`rankwatch` command line: a dispatch table of subcommands, one module each.

Every command module exposes `register(subparsers)` which adds its parser and sets
`func(args, settings) -> int`. Settings are built once here and passed down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rankwatch import __version__
from rankwatch.settings import Settings, SettingsError

#: Command modules under rankwatch/commands/, in the order `--help` lists them.
COMMANDS = ("stack", "db", "sql", "worker", "store", "publish", "simulate", "bench", "agent",
            "replay", "import_", "eval", "tail", "notify", "report", "export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rankwatch",
        description="Find the rank, stage and component behind a hung or slow training job.",
    )
    parser.add_argument("--version", action="version", version=f"rankwatch {__version__}")
    parser.add_argument("--home", help="state directory (default ~/.local/share/rankwatch)")
    parser.add_argument("--kafka-port", type=int, help="local broker port (default 9092)")
    parser.add_argument("--clickhouse-url", help="chdb:///path or http(s)://host:port")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"rankwatch.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"rankwatch.commands.{name}":
                continue
            # A host that only runs the agent need not install the worker's dependencies
            # (faust, chdb): the other commands stay usable and this one says what is missing.
            _unavailable(sub, name.rstrip("_"), str(e.name))
            continue
        module.register(sub)
    return parser


def _unavailable(sub: argparse._SubParsersAction, command: str,  # type: ignore[type-arg]
                 missing: str) -> None:
    p = sub.add_parser(command, help=f"(unavailable here: needs {missing})", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def refuse(_args: argparse.Namespace, _settings: Settings) -> int:
        print(f"rankwatch {command}: this installation lacks the Python package {missing!r}; "
              "install rankwatch with its dependencies (`pip install -e .` in the repository) "
              "to use it", file=sys.stderr)
        return 2

    p.set_defaults(func=refuse)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        settings = Settings.load(
            home=args.home, kafka_port=args.kafka_port, clickhouse_url=args.clickhouse_url
        )
    except SettingsError as e:
        print(f"rankwatch: {e}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args, settings) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
