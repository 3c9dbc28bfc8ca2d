"""The local stack (`rankwatch up` / `down` / `status`): the Kafka broker and one worker.

The worker (`rankwatch worker`) owns the embedded ClickHouse and serves SQL on `sql_port`; it is
ready when ``GET /ping`` there answers ``Ok.``. Both processes run detached in their own sessions
with pid files in `settings.run_dir` and logs in ``<home>/logs``, so the stack outlives the
command that started it. With `kafka_bootstrap` set, the stack uses that cluster instead of
starting a broker.

Order matters: up = jars → broker → topics → worker; down = worker (it flushes and commits on
SIGTERM) → broker.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import socket
import sys
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from rankwatch import http, notify_service
from rankwatch.daemon import Daemon, Progress, connect_host, port_open, tail
from rankwatch.kafka.admin import ensure_topics, probe
from rankwatch.kafka.broker import KafkaCluster, local_nodes
from rankwatch.kafka.jars import ensure_jars
from rankwatch.settings import Settings

#: Where `rankwatch` itself is imported from; the worker runs the same code.
_SOURCE_ROOT = Path(__file__).resolve().parents[1]
WORKER_STOP_TIMEOUT = 30.0


class StackError(RuntimeError):
    """A part of the stack did not come up; the message carries the end of its log."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, below Linux's ephemeral range (32768+): a port
    the kernel hands to outgoing connections can be taken by one between now and the bind, or
    connect to itself (a client on 127.0.0.1:P reaching for 127.0.0.1:P)."""
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free TCP port in 20000-32000 on 127.0.0.1")


def private_settings(home: Path, **overrides: Any) -> Settings:
    """Settings for a throw-away stack (demo, benchmarks, evaluation): its own home and free
    loopback ports, so it never touches a stack the user runs."""
    return Settings.load(home=home, kafka_port=free_port(), kafka_controller_port=free_port(),
                         sql_port=free_port(), **overrides)


def display_url(url: str) -> str:
    """`url` with any password masked, for output and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def settings_env(settings: Settings) -> dict[str, str]:
    """`settings` as ``RANKWATCH_*`` variables, so a child's `Settings.load()` equals `settings`."""
    out = {}
    for name, value in settings.model_dump(mode="json").items():
        secret = getattr(settings, name)
        if isinstance(secret, SecretStr):  # the child needs the value itself
            value = secret.get_secret_value()
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        out[f"RANKWATCH_{name.upper()}"] = text
    return out


def child_env(settings: Settings) -> dict[str, str]:
    """This process's environment with the settings in it (replacing any ``RANKWATCH_*``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKWATCH_")}
    env.update(settings_env(settings))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SOURCE_ROOT), env.get("PYTHONPATH")) if p)
    return env


def bootstrap(settings: Settings) -> str:
    """Where this machine reaches Kafka: the configured cluster, else the local broker."""
    return settings.kafka_bootstrap or KafkaCluster(settings).bootstrap


def worker_daemon(settings: Settings, index: int = 1) -> Daemon:
    """The worker's daemon; with several workers (`up --workers N`), worker `index` (1..N)."""
    name = "worker" if index == 1 else f"worker-{index}"
    return Daemon(name, settings.run_dir / f"{name}.pid",
                  settings.home / "logs" / f"{name}.log", marker="rankwatch.cli")


# -- several workers: one store process owns the embedded database ------------------------------

def store_daemon(settings: Settings) -> Daemon:
    return Daemon("store", settings.run_dir / "store.pid", settings.home / "logs" / "store.log",
                  marker="rankwatch.cli")


def store_command(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "rankwatch.cli", "--home", str(settings.home),
            "--kafka-port", str(settings.kafka_port), "store"]


def store_url(settings: Settings) -> str:
    """Where the workers reach the store (streams/store_server.py), token included."""
    token = urllib.parse.quote(settings.store_token.get_secret_value(), safe="")
    return f"http://rankwatch:{token}@127.0.0.1:{settings.store_port}"


def ping_store(settings: Settings, timeout: float = 1.0) -> str:
    """"" when the store's endpoint answers ``/ping``, else why not."""
    url = f"http://127.0.0.1:{settings.store_port}/ping"
    try:
        body = http.get(url, timeout=timeout, limit=64).body.decode(errors="replace").strip()
    except http.HTTPFailure as e:
        return f"{url}: {e.reason}"
    return "" if body.partition("\n")[0].strip() == "Ok." else f"{url} answered {body!r}"


def worker_settings(settings: Settings, index: int, sql_port: int) -> Settings:
    """Worker `index`'s settings among several: ClickHouse through the store, its own SQL port
    (the store serves `sql_port` to `rankwatch sql`), its own id; pages and metrics on worker 1
    only (the ports are the stack's)."""
    update: dict[str, Any] = {"clickhouse_url": store_url(settings), "sql_port": sql_port,
                              "worker_id": f"worker-{index}"}
    if index > 1:
        update.update(metrics_port=0, page_port=0)
    return settings.model_copy(update=update)


def worker_command(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "rankwatch.cli", "--home", str(settings.home),
            "--kafka-port", str(settings.kafka_port), "worker"]


def sql_endpoint(settings: Settings) -> str:
    return f"http://{connect_host(settings.bind_host)}:{settings.sql_port}"


def ping_worker(settings: Settings, timeout: float = 1.0) -> str:
    """"" if the worker's SQL endpoint answers ``/ping`` with ``Ok.`` (its first line: notes
    such as a crash loop may follow, and `status` reports those itself), else why not (the
    worker's own account when it answers that it is unhealthy)."""
    url = f"{sql_endpoint(settings)}/ping"
    try:
        body = http.get(url, timeout=timeout, limit=4096).body.decode(errors="replace").strip()
    except http.StatusError as e:
        return e.body.decode(errors="replace").strip() or f"{url}: HTTP {e.status}"
    except http.Unreachable as e:
        return f"{url}: {e.reason}"
    return "" if body.partition("\n")[0].strip() == "Ok." else f"{url} answered {body!r}"


#: Unclean exits within this many seconds that make a crash loop.
CRASH_WINDOW_S = 600.0
CRASH_LOOP_EXITS = 3


def exits_file(settings: Settings) -> Path:
    return settings.run_dir / "worker.exits"


def record_exit(settings: Settings, code: int, reason: str) -> None:
    """Note an unclean worker exit (time, code, reason), keeping the last 50."""
    path = exits_file(settings)
    try:
        lines = path.read_text().splitlines()[-49:] if path.exists() else []
        lines.append(f"{time.time():.3f}\t{code}\t{' '.join(reason.split())[:500]}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    except OSError:
        pass  # the exit goes on; status just won't count it


def crash_loop(settings: Settings, now: float | None = None) -> str:
    """"" or a description of a crash loop: CRASH_LOOP_EXITS unclean exits in CRASH_WINDOW_S."""
    now = time.time() if now is None else now
    try:
        lines = exits_file(settings).read_text().splitlines()
    except OSError:
        return ""
    recent = []
    for line in lines:
        t, _, rest = line.partition("\t")
        try:
            if now - float(t) <= CRASH_WINDOW_S:
                recent.append(rest)
        except ValueError:
            continue
    if len(recent) < CRASH_LOOP_EXITS:
        return ""
    code, _, reason = recent[-1].partition("\t")
    return (f"crash loop: {len(recent)} unclean exits in the last {CRASH_WINDOW_S / 60:.0f} "
            f"min; the last (exit {code}): {reason}")


def ping_notes(settings: Settings) -> list[str]:
    """What the worker's /ping adds under its first line (streams/sql_endpoint.py): a crash
    loop of its predecessors, reported without failing the check of a worker that is itself
    healthy now (`rankwatch up` would otherwise refuse a recovered worker for
    CRASH_WINDOW_S)."""
    loop = crash_loop(settings)
    return [loop] if loop else []


# ---------------------------------------------------------------------------------------------


def up(settings: Settings, progress: Progress = print, *, worker: bool = True,
       timeout: float = 180.0, workers: int = 1) -> dict[str, Any]:
    """Start whatever is not running (idempotent) and return `status`. Raises StackError or
    BrokerError with the end of the failing part's log. With `workers` > 1 a store process owns
    the embedded database and serves it to the workers (`start_workers`). A part that fails
    leaves the others running for `down` (and a worker still starting is not killed: see
    `_await_worker`); but a call interrupted part-way (Ctrl-C, or a SIGTERM its command raises
    as SystemExit) on a stack that was not running stops what it started before it unwinds:
    its caller's `finally` has no stack to stop yet, and an eval stopped while its broker was
    starting left a JVM nobody owned."""
    fresh = not _anything_running(settings)
    try:
        return _up(settings, progress, worker=worker, timeout=timeout, workers=workers)
    except (KeyboardInterrupt, SystemExit):
        if fresh:
            with contextlib.suppress(Exception):
                down(settings, progress)
        raise


def _anything_running(settings: Settings) -> bool:
    """Whether any process of this stack (a local broker, a worker, the store, the notifier)
    runs."""
    if not settings.kafka_bootstrap and any(b.pid() is not None
                                            for b in local_nodes(settings)):
        return True
    return any(d.pid() is not None for d in [*worker_daemons(settings), store_daemon(settings),
                                              notify_service.daemon(settings)])


def _up(settings: Settings, progress: Progress, *, worker: bool, timeout: float,
        workers: int) -> dict[str, Any]:
    if settings.kafka_bootstrap:
        why = probe(settings.bootstrap)
        if why:
            raise StackError(f"kafka: the cluster at {settings.bootstrap} does not answer: {why}")
        progress(f"kafka: using {settings.bootstrap}")
    else:
        running = local_nodes(settings)
        if len(running) > settings.kafka_brokers:  # started with --brokers N: keep using it
            settings = settings.model_copy(update={"kafka_brokers": len(running)})
            progress(f"kafka: using the {len(running)}-node cluster started here with "
                     f"--brokers {len(running)}")
        c = KafkaCluster(settings)
        pids = c.pids()
        if None not in pids and not probe(c.bootstrap, brokers=len(pids)):
            progress(f"kafka: already running (pid {', '.join(map(str, pids))}) at "
                     f"{c.bootstrap}")
        else:
            c.lib = ensure_jars(settings, progress)
            c.start(timeout=timeout, progress=progress)
    specs = settings.topics.specs(settings.kafka_partitions)
    # a local cluster started here has its size known: its topics wait for every node
    created = ensure_topics(bootstrap(settings), specs,
                            brokers=1 if settings.kafka_bootstrap else settings.kafka_brokers)
    progress(f"topics: created {len(created)} of {len(specs)}" if created
             else f"topics: all {len(specs)} present")
    if worker and workers > 1:
        start_workers(settings, workers, progress, timeout)
    elif worker:
        _start_worker(settings, progress, timeout)
    if worker:
        try:
            notify_service.start(settings, child_env(settings), progress)
        except RuntimeError as e:
            raise StackError(str(e)) from None
    return status(settings)


def _store_token(settings: Settings) -> Settings:
    """`settings` with the stack's store token: the configured one, else the one this stack
    made (kept in the run directory, readable by its owner only), else a new random one."""
    if settings.store_token.get_secret_value():
        return settings
    path = settings.run_dir / "store.token"
    try:
        token = path.read_text().strip()
    except OSError:
        token = ""
    if not token:
        token = secrets.token_urlsafe(24)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    return settings.model_copy(update={"store_token": SecretStr(token)})


def start_workers(settings: Settings, n: int, progress: Progress, timeout: float,
                  metrics_ports: Sequence[int] = ()) -> None:
    """The store (it owns the embedded database, serves it to the workers on loopback and SQL on
    `sql_port`), then `n` workers that reach ClickHouse through it. `metrics_ports`: each
    worker's /metrics port (`rankwatch bench scale` reads every worker's); by default worker 1
    serves the stack's and the others none."""
    from streams.db import parse_url  # the worker's dependencies: only where workers start

    if parse_url(settings.clickhouse).embedded:
        settings = _store_token(settings)
        d = store_daemon(settings)
        pid = d.pid()
        if pid is None:
            for port in (settings.store_port, settings.sql_port):
                if port_open(settings.bind_host, port) or port_open("127.0.0.1", port):
                    raise StackError(f"store: port {port} is in use by another program; stop "
                                     "it or choose another (RANKWATCH_STORE_PORT, "
                                     "RANKWATCH_SQL_PORT)")
            pid = d.start(store_command(settings), env=child_env(settings), cwd=settings.home)
            progress(f"store: starting (pid {pid}), log {d.log_file}…")
        t0 = time.monotonic()
        while ping_store(settings) or ping_worker(settings):
            if d.exited() is not None or d.pid() != pid:
                d.stop(5)
                raise StackError(f"store: exited while starting; the end of {d.log_file}:\n"
                                 f"{tail(d.log_file)}")
            if time.monotonic() - t0 > timeout:
                raise StackError(f"store: not ready within {timeout:.0f} s; the end of "
                                 f"{d.log_file}:\n{tail(d.log_file)}")
            time.sleep(0.25)
        progress(f"store: ready; SQL at {sql_endpoint(settings)}")
        base = settings
        settings_of = [worker_settings(base, i, free_port()) for i in range(1, n + 1)]
    else:  # a ClickHouse server: every worker connects to it directly
        settings_of = [settings.model_copy(update={
            "sql_port": settings.sql_port if i == 1 else free_port(),
            "worker_id": f"worker-{i}", **({} if i == 1 else {"metrics_port": 0,
                                                          "page_port": 0})})
            for i in range(1, n + 1)]
    # started together, then awaited: each spends most of its start joining the group
    if metrics_ports:
        settings_of = [ws.model_copy(update={"metrics_port": port})
                       for ws, port in zip(settings_of, metrics_ports, strict=True)]
    pids = [_launch_worker(ws, progress, i, several=True) for i, ws in enumerate(settings_of, 1)]
    for i, (ws, pid) in enumerate(zip(settings_of, pids, strict=True), 1):
        if pid is not None:
            _await_worker(ws, progress, timeout, i, pid)


def _start_worker(settings: Settings, progress: Progress, timeout: float) -> None:
    pid = _launch_worker(settings, progress)
    if pid is not None:
        _await_worker(settings, progress, timeout, 1, pid)


def _launch_worker(settings: Settings, progress: Progress, index: int = 1,
                   several: bool = False) -> int | None:
    """Start worker `index` unless it runs; its pid to wait for, None when it was running."""
    d = worker_daemon(settings, index)
    pid = d.pid()
    if pid is not None and (several or not ping_worker(settings)):
        where = "" if several else f"; SQL at {sql_endpoint(settings)}"
        progress(f"{d.name}: already running (pid {pid}){where}")
        return None
    if pid is None:
        if port_open(settings.bind_host, settings.sql_port):
            raise StackError(f"worker: port {settings.sql_port} is in use by another program; "
                             f"stop it or choose another (RANKWATCH_SQL_PORT)")
        pid = d.start(worker_command(settings), env=child_env(settings), cwd=settings.home)
        progress(f"{d.name}: starting (pid {pid}), log {d.log_file}…")
        if several:  # where `status` finds its health (/ping on its own SQL port)
            _port_file(settings, index).write_text(f"{settings.sql_port}\n")
    return pid


def _port_file(settings: Settings, index: int) -> Path:
    return settings.run_dir / f"{worker_daemon(settings, index).name}.port"


def several_status(settings: Settings) -> dict[str, Any] | None:
    """The store and every worker of `up --workers N` (None when no store runs): each worker's
    health from /ping on its own SQL port."""
    store = store_daemon(settings)
    spid = store.pid()
    if spid is None:
        return None
    why = ping_store(settings)
    workers = []
    for i, d in enumerate(worker_daemons(settings), 1):
        pid = d.pid()
        try:
            port = int(_port_file(settings, i).read_text().strip())
        except (OSError, ValueError):
            port = 0
        wwhy = "not running" if pid is None else (
            ping_worker(settings.model_copy(update={"sql_port": port})) if port
            else "its SQL port is unknown")
        workers.append({"name": d.name, "running": pid is not None, "healthy": not wwhy,
                        "pid": pid, "detail": wwhy or "ok", "log": str(d.log_file)})
    return {"store": {"running": True, "healthy": not why, "pid": spid, "detail": why or "ok",
                      "log": str(store.log_file)},
            "workers": workers}


def _await_worker(settings: Settings, progress: Progress, timeout: float, index: int,
                  pid: int) -> None:
    d = worker_daemon(settings, index)
    t0 = time.monotonic()
    why = ""
    while time.monotonic() - t0 < timeout:
        if d.exited() is not None or d.pid() != pid:
            d.stop(5)
            raise StackError(f"{d.name}: exited while starting; the end of {d.log_file}:\n"
                             f"{tail(d.log_file)}")
        why = ping_worker(settings)
        if not why and _stays_up(d, pid, settings):
            progress(f"{d.name}: ready in {time.monotonic() - t0:.1f} s; SQL at "
                     f"{sql_endpoint(settings)}, ClickHouse {display_url(settings.clickhouse)}")
            return
        time.sleep(0.25)
    # a worker still starting (rejoining its consumer group after an unclean stop takes up to
    # the group's session timeout) is left to finish: killing it would only start that over
    raise StackError(f"{d.name}: not ready within {timeout:.0f} s ({why}); it is still running "
                     f"(pid {pid}) and was not stopped: `rankwatch status` tells when it is "
                     f"ready, `rankwatch down` stops everything. The end of {d.log_file}:\n"
                     f"{tail(d.log_file)}")


#: After the first good /ping, how long the worker must stay up before `up` calls it ready (a
#: worker that dies on the first message it consumes dies within this).
SETTLE_S = 2.0


def _stays_up(d: Daemon, pid: int, settings: Settings) -> bool:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if d.exited() is not None or d.pid() != pid:
            return False
        time.sleep(0.25)
    return not ping_worker(settings)


def worker_daemons(settings: Settings) -> list[Daemon]:
    """Every worker's daemon: the first, and those of `up --workers N`."""
    found = {1}
    for p in settings.run_dir.glob("worker-*.pid"):
        with contextlib.suppress(ValueError):
            found.add(int(p.stem.removeprefix("worker-")))
    return [worker_daemon(settings, i) for i in sorted(found)]


def down(settings: Settings, progress: Progress = print) -> bool:
    """Stop the workers, then the store, then the broker. Returns whether anything was
    running."""
    stopped = notify_service.stop(settings, progress)
    for d in [*worker_daemons(settings), store_daemon(settings)]:
        pid = d.pid()
        if pid is not None:
            progress(f"{d.name}: stopping (pid {pid})…")
            stopped = d.stop(WORKER_STOP_TIMEOUT) or stopped
    if not settings.kafka_bootstrap:
        # a cluster started with --brokers N, whatever N is now
        nodes = [b for b in local_nodes(settings) if b.pid() is not None]
        if nodes:
            progress(f"kafka: stopping {len(nodes)} broker(s) (pid "
                     f"{', '.join(str(b.pid()) for b in nodes)})…")
            with ThreadPoolExecutor(len(nodes)) as pool:  # together: see KafkaCluster.stop
                stopped = any(list(pool.map(lambda b: b.stop(), nodes))) or stopped
    progress("stopped" if stopped else "nothing was running")
    return stopped


def status(settings: Settings) -> dict[str, Any]:
    """Each part's state, as JSON-ready values; ``healthy`` is true when every part answers."""
    if settings.kafka_bootstrap:
        why = probe(settings.bootstrap)
        kafka: dict[str, Any] = {"managed": False, "running": not why, "healthy": not why,
                                 "pid": None, "detail": why or "ok"}
    else:
        nodes = local_nodes(settings)  # a cluster started with --brokers N, whatever N is now
        hs = [b.health() for b in nodes]
        kafka = {"managed": True, "running": any(h.running for h in hs),
                 "healthy": all(h.healthy for h in hs), "pid": hs[0].pid,
                 "detail": "; ".join(f"{h.bootstrap}: {h.detail}" for h in hs) if len(hs) > 1
                 else hs[0].detail, "log": str(nodes[0].log_file)}
        if len(hs) > 1:
            kafka["brokers"] = [{"node": b.node, "bootstrap": h.bootstrap, "pid": h.pid,
                                 "running": h.running, "healthy": h.healthy, "detail": h.detail}
                                for b, h in zip(nodes, hs, strict=True)]
    kafka["bootstrap"] = (",".join(b["bootstrap"] for b in kafka["brokers"])
                          if "brokers" in kafka else bootstrap(settings))
    d = worker_daemon(settings)
    pid = d.pid()
    why = ping_worker(settings) if pid is not None else "not running"
    loop = crash_loop(settings)
    if loop:
        why = f"{why}; {loop}" if why else loop
    worker = {"running": pid is not None, "healthy": not why, "pid": pid, "detail": why or "ok",
              "sql_endpoint": sql_endpoint(settings), "log": str(d.log_file)}
    several = several_status(settings)
    if several is not None:  # `up --workers N`: the SQL endpoint is the store's
        first = several["workers"][0]
        worker.update({k: first[k] for k in ("running", "healthy", "pid", "detail")})
        healthy = bool(kafka["healthy"] and several["store"]["healthy"]
                       and all(w["healthy"] for w in several["workers"]))
    else:
        healthy = bool(kafka["healthy"] and worker["healthy"])
    return {
        "healthy": healthy,
        **(several or {}),
        "home": str(settings.home),
        "kafka": kafka,
        "worker": worker,
        "clickhouse": {"url": display_url(settings.clickhouse),
                       "database": settings.clickhouse_database},
        "notify": notify_service.status(settings),
    }
