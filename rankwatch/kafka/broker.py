"""Local Kafka nodes: one KRaft node that is both broker and controller (`Broker`), and a
cluster of several (`KafkaCluster`), run from the jars `rankwatch.kafka.jars` fetches.

A single broker keeps its state under ``<home>/kafka`` and logs to ``<home>/logs/kafka.log``;
node i of a cluster keeps it under ``<home>/kafka-cluster/node-<i>`` and listens on the
configured ports + 100·(i-1) (`node_ports`).
"""

from __future__ import annotations

import base64
import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ingest.topics import MAX_MESSAGE_BYTES
from rankwatch.daemon import Daemon, Progress, connect_host, port_open, tail
from rankwatch.kafka import BrokerError
from rankwatch.kafka.admin import probe, replication
from rankwatch.kafka.jars import jars_dir, require_java
from rankwatch.settings import KAFKA_NODE_PORT_STRIDE, Settings


def _kafka_uuid() -> str:
    """A cluster id as Kafka writes them: 16 random bytes, URL-safe base64 without padding.

    One in 64 starts with "-", which is why it is passed as `--cluster-id=<id>`, never as a
    separate argument that the tool's option parser would take for a flag."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


def cluster_id(id_file: Path) -> str:
    """The id in `id_file`, made once. The nodes of a cluster format their storage in parallel
    and must all get the same id: the file is created whole by a hard link of a written
    temporary file, which fails if another node linked its own first (then that one is read).
    A check-then-write let two nodes each write an id, and the cluster split on
    INCONSISTENT_CLUSTER_ID."""
    id_file.parent.mkdir(parents=True, exist_ok=True)
    if not id_file.exists():
        tmp = id_file.with_name(f".{id_file.name}.{uuid.uuid4().hex}")
        tmp.write_text(_kafka_uuid() + "\n")
        try:
            os.link(tmp, id_file)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return id_file.read_text().strip()


@dataclass(frozen=True)
class BrokerHealth:
    running: bool
    healthy: bool
    pid: int | None
    bootstrap: str
    detail: str = ""


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
            # The log cleaner (compacted topics: consumer offsets, Faust changelogs, all small
            # key sets) allocates its dedupe buffer at start, 128 MiB by default: one
            # contiguous block that a small heap (RANKWATCH_KAFKA_HEAP=256m) cannot always
            # place, and the node dies of "Java heap space". 16 MiB holds ~700 k keys.
            "log.cleaner.dedupe.buffer.size": str(16 << 20),
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
        res = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "--ignore-formatted",
                       f"--cluster-id={cluster_id(self.id_file)}", "-c", str(conf)),
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
