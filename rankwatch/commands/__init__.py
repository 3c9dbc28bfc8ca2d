"""One module per `rankwatch` subcommand; each exposes register(subparsers)."""
