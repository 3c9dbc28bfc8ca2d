"""A real single-node Apache Kafka broker (KRaft, no ZooKeeper, no Docker) for the local stack.

Three parts:

- `ensure_jars` fetches Kafka's jars from Maven Central once (through `mvn`) into the cache dir;
- `Broker` runs one combined broker+controller JVM from those jars, with its state under
  ``<home>/kafka`` and its log in ``<home>/logs/kafka.log``;
- `KafkaCluster` runs `settings.kafka_brokers` such nodes as one KRaft cluster (every node a
  broker and a voter of the controller quorum), node i under ``<home>/kafka-cluster/node-<i>``
  on the configured ports + 100·(i-1) (`node_ports`); with one node it is the `Broker` above;
- `ensure_topics` / `delete_topics` shape the topics with the confluent-kafka admin client:
  replication factor 3 and ``min.insync.replicas=2`` on a cluster of three or more brokers.

`Daemon` (a process in its own session, tracked by a pid file) is shared with the stack launcher.

Kafka 3.9.x is pinned on purpose: aiokafka (Faust's transport) still speaks request versions that
Kafka 4 removed, and confluent-kafka 2.x speaks to both.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # the class confluent_kafka.admin re-exports

from ingest.topics import MAX_MESSAGE_BYTES, TopicSpec
from rankwatch.settings import KAFKA_NODE_PORT_STRIDE, Settings

Progress = Callable[[str], None]

#: What `ensure_jars` asks Maven for; the slf4j binding makes the broker log through log4j 1.
SLF4J_BINDING = ("org.slf4j", "slf4j-reload4j", "1.7.36")
JARS_MARKER = ".complete"

#: librdkafka logs every refused connection; the probes below expect refusals while starting.
_rdkafka_log = logging.getLogger("rankwatch.kafka_broker.librdkafka")
_rdkafka_log.addHandler(logging.NullHandler())
_rdkafka_log.propagate = False


class BrokerError(RuntimeError):
    """The broker (or its jars) could not be set up; the message says what to do."""


# ---------------------------------------------------------------------------------------------
# Jars


def _pom(version: str) -> str:
    deps = [("org.apache.kafka", "kafka_2.13", version), SLF4J_BINDING]
    body = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>"
        for g, a, v in deps
    )
    return f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <!-- Written by rankwatch: the jars of an Apache Kafka {version} broker. -->
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.rankwatch</groupId>
  <artifactId>kafka-broker-jars</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
{body}
  </dependencies>
</project>
"""


def jars_dir(settings: Settings) -> Path:
    """Where the jars of `settings.kafka_version` live (``<cache>/kafka-<version>/lib``)."""
    return settings.cache_dir / f"kafka-{settings.kafka_version}" / "lib"


def require_java() -> str:
    """The path of `java`, or a BrokerError saying what to install."""
    java = shutil.which("java")
    if not java:
        raise BrokerError(
            "`java` not found: the local Kafka broker needs a Java 17+ runtime "
            "(Debian/Ubuntu: apt install openjdk-17-jre-headless; macOS: brew install openjdk@17)"
        )
    return java


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_jars(settings: Settings, progress: Progress = print) -> Path:
    """Fetch the broker's jars from Maven Central on first use; return the directory holding them.

    Instant once done (a marker file records completion). A failed or partial fetch leaves no
    marker and is redone next time. A file lock makes concurrent callers wait for one fetch.
    """
    version = settings.kafka_version
    if not re.fullmatch(r"3\.\d+\.\d+", version):
        raise BrokerError(f"kafka_version={version!r}: expected a Kafka 3.x release such as "
                          "3.9.1 (Kafka 4 dropped protocol versions that aiokafka uses)")
    root = settings.cache_dir / f"kafka-{version}"
    lib = root / "lib"
    if (root / JARS_MARKER).exists():
        return lib
    require_java()
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            "`mvn` not found: rankwatch fetches the Kafka broker's jars from Maven Central with "
            "Apache Maven (Debian/Ubuntu: apt install maven; macOS: brew install maven)"
        )
    with _file_lock(settings.cache_dir / f"kafka-{version}.lock"):
        if (root / JARS_MARKER).exists():  # another process fetched them while we waited
            return lib
        progress(f"fetching Kafka {version} jars from Maven Central (first use only)…")
        t0 = time.monotonic()
        partial = root / "lib.partial"
        shutil.rmtree(partial, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        (root / "pom.xml").write_text(_pom(version))
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(root / "pom.xml"),
               "dependency:copy-dependencies", f"-DoutputDirectory={partial}"]
        try:
            res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            raise BrokerError("mvn took more than 30 minutes fetching the Kafka jars") from None
        jars = sorted(p.name for p in partial.glob("*.jar")) if partial.is_dir() else []
        if res.returncode != 0 or not any(j.startswith("kafka_2.13-") for j in jars):
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-20:])
            raise BrokerError(
                f"fetching Kafka {version} jars with Maven failed (exit {res.returncode}); "
                f"is Maven Central reachable?\n{tail}"
            )
        shutil.rmtree(lib, ignore_errors=True)
        partial.rename(lib)
        (root / JARS_MARKER).write_text("\n".join(jars) + "\n")
        progress(f"done: {len(jars)} jars in {time.monotonic() - t0:.1f} s ({lib})")
    return lib


# ---------------------------------------------------------------------------------------------
# Processes with pid files


def _proc_state(pid: int) -> tuple[str, str] | None:
    """(state letter, command line) from /proc, or None where /proc does not have it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0], cmdline


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file ("" if there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Daemon:
    """A long-running child process in its own session, tracked by a pid file.

    `marker` is a string its command line contains: a pid file whose process is gone, or whose
    pid now belongs to some other program, counts as stale and is removed.
    """

    name: str
    pid_file: Path
    log_file: Path
    marker: str
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def pid(self) -> int | None:
        """The live process's pid, or None (removing a stale pid file)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if self.is_alive(pid):
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def is_alive(self, pid: int) -> bool:
        """Whether `pid` runs (not a zombie) and its command line contains the marker."""
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our exited child
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, someone else's
        state = _proc_state(pid)
        if state is None:  # no /proc (macOS): trust kill(0)
            return True
        letter, cmdline = state
        # An empty command line: a process caught inside exec (just started), not yet readable.
        return letter not in ("Z", "X") and (not cmdline or self.marker in cmdline)

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> int:
        """Start `argv` detached (new session), output appended to the log; return its pid."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            log.write(f"\n--- {time.strftime('%F %T')} starting {self.name}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=cwd, start_new_session=True,
            )
        self.pid_file.write_text(f"{self._proc.pid}\n")
        return self._proc.pid

    def exited(self) -> int | None:
        """The exit status of a process this object started and that has ended, else None."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM, wait up to `timeout` s, then SIGKILL. Returns whether a process was stopped."""
        pid = self.pid()
        if pid is None and self._proc is not None and self._proc.poll() is None:
            pid = self._proc.pid  # ours, whatever its pid file says
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        self._signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.is_alive(pid):
            time.sleep(0.1)
        if self.is_alive(pid):
            self._signal(pid, signal.SIGKILL)
            for _ in range(50):
                if not self.is_alive(pid):
                    break
                time.sleep(0.1)
        if self._proc is not None and self._proc.pid == pid:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1)
            self._proc = None
        self.pid_file.unlink(missing_ok=True)
        return True

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        """Signal the process group it leads (started with a new session), else the process."""
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)


def connect_host(bind_host: str) -> str:
    """The address to reach a service bound to `bind_host` from this machine."""
    wildcard = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
    return wildcard.get(bind_host, bind_host)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((connect_host(host), port), timeout=timeout):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# The broker


def _kafka_uuid() -> str:
    """A cluster id as Kafka writes them: 16 random bytes, URL-safe base64 without padding.

    One in 64 starts with "-", which is why it is passed as `--cluster-id=<id>`, never as a
    separate argument that the tool's option parser would take for a flag."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


@dataclass(frozen=True)
class BrokerHealth:
    running: bool
    healthy: bool
    pid: int | None
    bootstrap: str
    detail: str = ""


def replication(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for a cluster of `brokers` brokers: three
    copies and two in sync where there are three brokers or more, so one broker may be lost
    without losing an acknowledged record or refusing a write; else every broker has a copy."""
    factor = min(3, max(1, brokers))
    return factor, max(1, factor - 1)


def node_ports(settings: Settings, node: int) -> tuple[int, int]:
    """(client port, controller port) of local node `node` (1-based)."""
    shift = KAFKA_NODE_PORT_STRIDE * (node - 1)
    return settings.kafka_port + shift, settings.kafka_controller_port + shift


def cluster_dir(settings: Settings) -> Path:
    """Where a local cluster of several nodes keeps its nodes' state (``node-<i>/``)."""
    return settings.home / "kafka-cluster"


class Broker:
    """One KRaft node that is both broker and controller.

    A single broker (`nodes` 1, the default): state ``<home>/kafka/`` (server.properties,
    log4j.properties, cluster.id, data/); log ``<home>/logs/kafka.log`` (the JVM's own output,
    e.g. a crash, in ``kafka.out``); pid file ``<run_dir>/kafka.pid``; listens on
    `settings.kafka_port`. Node `node` of a cluster of `nodes`: state
    ``<home>/kafka-cluster/node-<node>/``, logs ``kafka-<node>.log`` / ``.out``, pid file
    ``kafka-<node>.pid``, ports from `node_ports`; every node is a voter of the quorum.
    """

    def __init__(self, settings: Settings, lib: Path | None = None, *, node: int = 1,
                 nodes: int = 1) -> None:
        if not 1 <= node <= nodes:
            raise ValueError(f"node {node} of a {nodes}-node cluster")
        self.settings = settings
        self.lib = lib or jars_dir(settings)
        self.node, self.nodes = node, nodes
        self.port, self.controller_port = node_ports(settings, node)
        logs = settings.home / "logs"
        if nodes == 1:
            self.dir, name = settings.home / "kafka", "kafka"
            self.id_file = self.dir / "cluster.id"
        else:
            self.dir, name = cluster_dir(settings) / f"node-{node}", f"kafka-{node}"
            self.id_file = cluster_dir(settings) / "cluster.id"  # one id for every node
        self.data_dir = self.dir / "data"
        self.log_file = logs / f"{name}.log"  # log4j's
        self.daemon = Daemon(name, settings.run_dir / f"{name}.pid", logs / f"{name}.out",
                             marker="kafka.Kafka")

    @property
    def bootstrap(self) -> str:
        return f"{connect_host(self.settings.bind_host)}:{self.port}"

    def pid(self) -> int | None:
        return self.daemon.pid()

    def is_running(self) -> bool:
        return self.daemon.pid() is not None

    def health(self, timeout: float = 3.0) -> BrokerHealth:
        pid = self.daemon.pid()
        if pid is None:
            return BrokerHealth(False, False, None, self.bootstrap, "not running")
        detail = probe(self.bootstrap, timeout)
        return BrokerHealth(True, detail == "", pid, self.bootstrap, detail or "ok")

    # -- configuration ------------------------------------------------------------------------

    def _server_properties(self) -> str:
        s = self.settings
        host = s.bind_host
        advertised = socket.gethostname() if host in ("0.0.0.0", "::") else host
        voters = ",".join(f"{i}@{connect_host(host)}:{node_ports(s, i)[1]}"
                          for i in range(1, self.nodes + 1))
        factor, min_isr = replication(self.nodes)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{host}:{self.port},CONTROLLER://{host}:"
                         f"{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{advertised}:{self.port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": str(s.kafka_partitions),
            "auto.create.topics.enable": "true",  # Faust creates its internal topics this way
            # topics created without a factor (Faust's, auto-created ones) and the internal
            # ones: three copies, two in sync, on a cluster of three (replication())
            "default.replication.factor": str(factor),
            "min.insync.replicas": str(min_isr),
            "offsets.topic.replication.factor": str(factor),
            # 50 partitions each by default; a single node gains nothing from them and the
            # first consumer group would wait for all 50 to be created.
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.num.partitions": "10",
            "transaction.state.log.replication.factor": str(factor),
            "transaction.state.log.min.isr": str(min_isr),
            "group.initial.rebalance.delay.ms": "0",
            # Record batches aim at 64 KiB–1 MiB compressed; headroom as in docker-compose.yml.
            "message.max.bytes": str(MAX_MESSAGE_BYTES),
            "num.network.threads": "2",
            "num.io.threads": "4",
        }
        return "# Written by rankwatch on every start; edit the settings instead.\n" + "".join(
            f"{k}={v}\n" for k, v in props.items()
        )

    def _log4j_properties(self) -> str:
        return f"""# Written by rankwatch on every start.
log4j.rootLogger=INFO, file
log4j.appender.file=org.apache.log4j.RollingFileAppender
log4j.appender.file.File={self.log_file}
log4j.appender.file.MaxFileSize=50MB
log4j.appender.file.MaxBackupIndex=2
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
log4j.logger.kafka.controller=WARN
log4j.logger.org.apache.kafka.controller=WARN
log4j.logger.kafka.log.LogCleaner=WARN
"""

    def _java(self, main: str, *args: str, heap: str | None = None) -> list[str]:
        """The JVM command line; without `heap` a short-lived tool's: the client compiler only
        and the serial collector (formatting took 2.4x longer without them on 2 cores)."""
        java = require_java()
        opts = ([f"-Xmx{heap}", "-XX:+ExitOnOutOfMemoryError"] if heap else
                ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xshare:auto"])
        return [java, *opts, "-Djava.awt.headless=true",
                f"-Dlog4j.configuration=file:{self.dir / 'log4j.properties'}",
                "-cp", f"{self.lib}/*", main, *args]

    def _prepare(self) -> Path:
        """Write the configuration and format the storage once; return server.properties."""
        if not (self.lib / f"kafka_2.13-{self.settings.kafka_version}.jar").exists():
            raise BrokerError(f"no Kafka jars in {self.lib}: run `rankwatch fetch-jars` first")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "server.properties"
        conf.write_text(self._server_properties())
        (self.dir / "log4j.properties").write_text(self._log4j_properties())
        if (self.data_dir / "meta.properties").exists():
            return conf
        id_file = self.id_file
        if not id_file.exists():
            id_file.write_text(_kafka_uuid() + "\n")
        cluster_id = id_file.read_text().strip()
        res = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "--ignore-formatted",
                       f"--cluster-id={cluster_id}", "-c", str(conf)),
            capture_output=True, text=True, timeout=120,
        )
        if res.returncode != 0:
            raise BrokerError(f"formatting Kafka storage in {self.data_dir} failed:\n"
                              f"{(res.stdout + res.stderr).strip()}")
        return conf

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 60.0, progress: Progress = print) -> int:
        """Start the broker (if it is not running) and wait until it answers; return its pid."""
        pid = self.daemon.pid()
        if pid is None:
            pid = self.launch(progress)
        self._wait_ready(pid, timeout, progress)
        return pid

    def launch(self, progress: Progress = print) -> int:
        """Start the JVM (configured and formatted first) without waiting for it; its pid."""
        s = self.settings
        for port, var in ((self.port, "RANKWATCH_KAFKA_PORT"),
                          (self.controller_port, "RANKWATCH_KAFKA_CONTROLLER_PORT")):
            if port_open(s.bind_host, port):
                raise BrokerError(f"port {port} is in use by another program; stop it or "
                                  f"choose another port ({var})")
        conf = self._prepare()
        pid = self.daemon.start(self._java("kafka.Kafka", str(conf), heap=s.kafka_heap),
                                cwd=self.dir)
        what = "broker" if self.nodes == 1 else f"node {self.node} of {self.nodes}"
        progress(f"kafka: starting {what} (pid {pid}) on {self.bootstrap}…")
        return pid

    def log_tail(self, lines: int = 25) -> str:
        """The end of the JVM's output and of the broker's log, without Java stack frames (the
        exception messages and their "Caused by:" lines stay)."""
        parts = []
        for path in (self.daemon.log_file, self.log_file):
            kept = [ln for ln in tail(path, 400).splitlines()
                    if ln.strip() and not ln.startswith(("\tat ", "\t... ", "--- "))]
            if kept:
                parts.append(f"{path}:\n" + "\n".join(kept[-lines:]))
        return "\n".join(parts) or f"(nothing in {self.log_file})"

    def _wait_ready(self, pid: int, timeout: float, progress: Progress,
                    brokers: int = 1, siblings: Sequence[Broker] = ()) -> None:
        """Wait until this node answers a metadata request listing `brokers` brokers. A
        sibling node (of the same cluster) that exits meanwhile ends the wait with its log."""
        t0 = time.monotonic()
        next_note = t0 + 10
        detail = ""
        while time.monotonic() - t0 < timeout:
            if self.daemon.exited() is not None or self.daemon.pid() != pid:
                self.daemon.stop(5)
                raise BrokerError(f"the Kafka broker exited while starting:\n{self.log_tail()}")
            for b in siblings:
                if b.daemon.exited() is not None:
                    raise BrokerError(f"Kafka node {b.node} of {b.nodes} exited while the "
                                      f"cluster was starting:\n{b.log_tail()}")
            detail = probe(self.bootstrap, timeout=2.0, brokers=brokers)
            if not detail:
                progress(f"kafka: ready at {self.bootstrap} in {time.monotonic() - t0:.1f} s")
                return
            if time.monotonic() > next_note:
                progress(f"kafka: still starting ({time.monotonic() - t0:.0f} s: {detail})…")
                next_note += 10
            time.sleep(0.2)
        others = "".join(f"\n{b.log_tail(10)}" for b in siblings)
        raise BrokerError(f"the Kafka broker (pid {pid}) did not answer within {timeout:.0f} s "
                          f"({detail}):\n{self.log_tail()}{others}")

    def stop(self, timeout: float = 20.0) -> bool:
        """Stop the broker: SIGTERM, up to `timeout` s for a clean shutdown, then SIGKILL."""
        return self.daemon.stop(timeout)


# ---------------------------------------------------------------------------------------------
# Admin


@contextlib.contextmanager
def _admin_errors(bootstrap: str) -> Iterator[None]:
    """Admin calls raise BrokerError, naming the cluster, instead of librdkafka's exception."""
    try:
        yield
    except KafkaException as e:
        raise BrokerError(f"Kafka at {bootstrap}: {e.args[0].str() if e.args else e}") from e


def _admin(bootstrap: str) -> AdminClient:
    conf: dict[str, str | int | float | bool] = {
        "bootstrap.servers": bootstrap, "socket.connection.setup.timeout.ms": 2000}
    return AdminClient(conf, logger=_rdkafka_log)


def probe(bootstrap: str, timeout: float = 3.0, brokers: int = 1) -> str:
    """"" if the cluster at `bootstrap` answers a metadata request listing at least `brokers`
    brokers, else why not."""
    first = bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    if not port.isdigit() or not port_open(host.strip("[]"), int(port), min(timeout, 1.0)):
        return f"nothing listens on {first}"
    try:
        md = _admin(bootstrap).list_topics(timeout=timeout)
    except Exception as e:  # KafkaException: the broker is up but not serving yet
        return f"metadata request failed: {e}"
    if len(md.brokers) >= brokers:
        return ""
    return f"{len(md.brokers)} of {brokers} brokers registered" if md.brokers else \
        "no broker registered yet"


def _wait(futures: dict[str, Any], ignore: Iterable[str]) -> list[str]:
    """Resolve admin futures; return the names that succeeded. Error codes in `ignore` are ok."""
    done, errors = [], []
    for name, fut in futures.items():
        try:
            fut.result()
            done.append(name)
        except KafkaException as e:
            err = e.args[0]
            if err.name() not in ignore:
                errors.append(f"{name}: {err.str()}")
    if errors:
        raise BrokerError("Kafka admin request failed:\n  " + "\n  ".join(errors))
    return done


def ensure_topics(bootstrap: str, specs: Sequence[TopicSpec], timeout: float = 30.0) -> list[str]:
    """Create the topics of `specs` that do not exist; return the names created.

    Idempotent. Existing topics are left as they are (adding partitions would move keys). The
    replication factor and ``min.insync.replicas`` follow the cluster's size (`replication`:
    3 and 2 from three brokers up, so producers with acks=all keep writing and consumers keep
    reading when one broker is lost). Returns once the broker's metadata lists them.
    """
    with _admin_errors(bootstrap):
        admin = _admin(bootstrap)
        md = admin.list_topics(timeout=timeout)
        existing = set(md.topics)
        factor, min_isr = replication(len(md.brokers))
        new = [NewTopic(s.name, num_partitions=s.partitions, replication_factor=factor,
                        config={**_topic_config(s), "min.insync.replicas": str(min_isr)})
               for s in specs if s.name not in existing]
        if not new:
            return []
        futures = admin.create_topics(new, request_timeout=timeout)
        created = _wait(futures, {"TOPIC_ALREADY_EXISTS"})
        _await_metadata(admin, [s.name for s in specs], timeout)
    return created


def _topic_config(spec: TopicSpec) -> dict[str, str]:
    config = {"retention.ms": str(spec.retention_ms)}
    if spec.compacted:
        config["cleanup.policy"] = "compact"
    return config


def _await_metadata(admin: AdminClient, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        missing = [n for n in names
                   if n not in topics or topics[n].error is not None or not topics[n].partitions]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise BrokerError(f"topics not visible after {timeout:.0f} s: {missing}")
        time.sleep(0.05)


def list_topics(bootstrap: str, timeout: float = 10.0) -> dict[str, int]:
    """Every topic of the cluster with its partition count."""
    with _admin_errors(bootstrap):
        topics = _admin(bootstrap).list_topics(timeout=timeout).topics
    return {name: len(t.partitions) for name, t in topics.items()}


def delete_topics(bootstrap: str, names: Iterable[str], timeout: float = 30.0) -> list[str]:
    """Delete topics (for test cleanup); names that do not exist are ignored."""
    names = list(names)
    if not names:
        return []
    with _admin_errors(bootstrap):
        admin = _admin(bootstrap)  # kept referenced: its futures fail once it is collected
        futures = admin.delete_topics(names, operation_timeout=timeout, request_timeout=timeout)
        return _wait(futures, {"UNKNOWN_TOPIC_OR_PART"})



# ---------------------------------------------------------------------------------------------
# A local cluster


class KafkaCluster:
    """`settings.kafka_brokers` local nodes as one KRaft cluster (see `Broker` for where each
    keeps its state). Every node is a broker and a voter of the controller quorum, so with three
    the cluster keeps a quorum, a leader for every partition and its consumer groups when one
    node is lost. With one node this is exactly the single `Broker`."""

    def __init__(self, settings: Settings, lib: Path | None = None) -> None:
        n = settings.kafka_brokers
        self.settings = settings
        self.nodes = [Broker(settings, lib, node=i, nodes=n) for i in range(1, n + 1)]

    @property
    def lib(self) -> Path:
        return self.nodes[0].lib

    @lib.setter
    def lib(self, lib: Path) -> None:
        for b in self.nodes:
            b.lib = lib

    @property
    def bootstrap(self) -> str:
        """Every node's address, comma-separated (clients need one that answers)."""
        return ",".join(b.bootstrap for b in self.nodes)

    def pids(self) -> list[int | None]:
        return [b.pid() for b in self.nodes]

    def is_running(self) -> bool:
        return any(p is not None for p in self.pids())

    def start(self, timeout: float = 60.0, progress: Progress = print) -> list[int]:
        """Start the nodes not running, all before waiting (a node answers only once a majority
        of the quorum is up), then wait until each answers with every broker registered."""
        if len(self.nodes) > 1:
            made = sorted(d.name for d in cluster_dir(self.settings).glob("node-*"))
            if made and len(made) != len(self.nodes):
                raise BrokerError(
                    f"{cluster_dir(self.settings)} holds a {len(made)}-node cluster; start it "
                    f"with --brokers {len(made)}, or stop it and remove that directory for a "
                    f"new {len(self.nodes)}-node one (its topics and records go with it)")
            single = Broker(self.settings)
            if single.pid() is not None:
                raise BrokerError(
                    f"a single Kafka broker (pid {single.pid()}) runs in {self.settings.home}; "
                    "stop it (`rankwatch down`) before starting a cluster there")
        with ThreadPoolExecutor(len(self.nodes)) as pool:  # formatting takes a JVM each
            pids = list(pool.map(lambda b: b.pid() or b.launch(progress), self.nodes))
        for b, pid in zip(self.nodes, pids, strict=True):
            try:
                b._wait_ready(pid, timeout, progress, brokers=len(self.nodes),
                              siblings=[o for o in self.nodes if o is not b])
            except BrokerError:
                self.stop(5)
                raise
        return pids

    def stop(self, timeout: float = 20.0) -> bool:
        """Stop every node at once (one at a time, the last ones would wait for a quorum that is
        gone): SIGTERM, up to `timeout` s, then SIGKILL. Whether any node was stopped."""
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            return any(list(pool.map(lambda b: b.stop(timeout), self.nodes)))

    def health(self, timeout: float = 3.0) -> list[BrokerHealth]:
        return [b.health(timeout) for b in self.nodes]


def local_nodes(settings: Settings) -> list[Broker]:
    """The nodes of the home's local Kafka, running or not: the cluster's when `settings` ask
    for one (`kafka_brokers` > 1) or one started here with ``--brokers`` still runs (its node
    directories say how many), else the single broker. What `down` stops and `status` shows."""
    if settings.kafka_brokers > 1:
        return KafkaCluster(settings).nodes
    ids = [int(m.group(1)) for d in cluster_dir(settings).glob("node-*")
           if (m := re.fullmatch(r"node-(\d+)", d.name))]
    n = max(ids, default=0)
    nodes = [Broker(settings, node=i, nodes=n) for i in range(1, n + 1)]
    if n > 1 and any(b.pid() is not None for b in nodes):
        return nodes
    return [Broker(settings)]
