"""`rankwatch notify` as a part of the local stack: started by `rankwatch up` when a notify
configuration exists (RANKWATCH_NOTIFY_CONFIG, or <home>/notify.toml), stopped by `down`, shown
by `status`. Like the worker it runs detached with a pid file and a log under <home>."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rankwatch.daemon import Daemon, Progress, tail
from rankwatch.settings import Settings


def config_file(settings: Settings) -> Path | None:
    if settings.notify_config:
        return Path(settings.notify_config)
    default = settings.home / "notify.toml"
    return default if default.exists() else None


def daemon(settings: Settings) -> Daemon:
    return Daemon("notify", settings.run_dir / "notify.pid",
                  settings.home / "logs" / "notify.log", marker="rankwatch.cli")


def start(settings: Settings, env: dict[str, str], progress: Progress) -> None:
    """Start notify if configured and not running; raise RuntimeError when it exits at once
    (a bad configuration: the message carries its log)."""
    cfg = config_file(settings)
    if cfg is None:
        return
    d = daemon(settings)
    pid = d.pid()
    if pid is not None:
        progress(f"notify: already running (pid {pid})")
        return
    argv = [sys.executable, "-m", "rankwatch.cli", "--home", str(settings.home),
            "--kafka-port", str(settings.kafka_port), "notify", "--config", str(cfg.resolve())]
    pid = d.start(argv, env=env, cwd=settings.home)
    time.sleep(1.0)  # a bad configuration ends it within this
    if d.exited() is not None or d.pid() != pid:
        raise RuntimeError(f"notify: exited while starting; the end of {d.log_file}:\n"
                           f"{tail(d.log_file)}")
    progress(f"notify: running (pid {pid}), routes {cfg}, log {d.log_file}")


def stop(settings: Settings, progress: Progress, timeout: float = 30.0) -> bool:
    d = daemon(settings)
    pid = d.pid()
    if pid is None:
        return False
    progress(f"notify: stopping (pid {pid})…")
    return d.stop(timeout)


def status(settings: Settings) -> dict[str, Any]:
    d = daemon(settings)
    cfg = config_file(settings)
    pid = d.pid()
    return {"configured": cfg is not None, "config": str(cfg) if cfg else None,
            "running": pid is not None, "pid": pid, "log": str(d.log_file)}
