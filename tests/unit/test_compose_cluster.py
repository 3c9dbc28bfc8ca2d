"""docker-compose.cluster.yml and its ClickHouse configs (deploy/clickhouse/) stay valid and agree
with each other and with rankwatch. No Docker engine here: this reads the files; the engine's
view of the same XML is in tests/integration/test_clickhouse_cluster.py."""

from __future__ import annotations

import base64
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import yaml

from rankwatch.settings import Settings
from tests.unit.test_compose import cli_commands

ROOT = Path(__file__).resolve().parents[2]
KAFKA = ("kafka-1", "kafka-2", "kafka-3")
CLICKHOUSE = ("clickhouse-1", "clickhouse-2", "clickhouse-3", "clickhouse-4")


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.cluster.yml").read_text())
    return doc


def services() -> dict[str, Any]:
    svcs: dict[str, Any] = compose()["services"]
    return svcs


def bind_mounts(svc: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of each ./ volume of a service."""
    out = []
    for v in svc.get("volumes", []):
        src, dst = str(v).split(":")[:2]
        if src.startswith("./"):
            out.append((ROOT / src, dst))
    return out


def xml(path: Path) -> ET.Element:
    return ET.parse(path).getroot()


def test_every_part_is_there() -> None:
    names = set(services())
    assert {*KAFKA, *CLICKHOUSE, "clickhouse-keeper", "migrate", "topics", "worker"} <= names
    assert str(services()["worker"]["deploy"]["replicas"]).startswith("${RANKWATCH_WORKERS")


def test_references_name_services_and_files_that_exist() -> None:
    svcs, volumes = services(), set(compose().get("volumes") or {})
    for name, svc in svcs.items():
        for dep in svc.get("depends_on", {}):
            assert dep in svcs, f"{name} depends on unknown service {dep}"
        for src, _ in bind_mounts(svc):
            assert src.is_file(), f"{name} mounts {src}, which does not exist"
        for v in svc.get("volumes", []):
            vol = str(v).split(":")[0]
            if not vol.startswith(("./", "/", "$")):
                assert vol in volumes, f"{name} uses undeclared volume {vol}"
        if "hostname" in svc:
            assert svc["hostname"] == name
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_kafka_is_a_three_node_kraft_cluster_with_two_in_sync() -> None:
    svcs = services()
    ids, voters, cluster_ids = [], set(), set()
    for name in KAFKA:
        env = svcs[name]["environment"]
        ids.append(int(env["KAFKA_NODE_ID"]))
        voters.add(env["KAFKA_CONTROLLER_QUORUM_VOTERS"])
        cluster_ids.add(env["CLUSTER_ID"])
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092"
        assert int(env["KAFKA_DEFAULT_REPLICATION_FACTOR"]) == 3
        assert int(env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == 3
        assert int(env["KAFKA_MIN_INSYNC_REPLICAS"]) == 2
        assert svcs[name]["image"] == f"apache/kafka:{Settings.load({}).kafka_version}"
    assert sorted(ids) == [1, 2, 3] and len(voters) == 1 and len(cluster_ids) == 1
    assert voters.pop().split(",") == [f"{i}@kafka-{i}:9093" for i in (1, 2, 3)]
    # Kafka's cluster ids are 16 bytes, URL-safe base64 without padding
    default = re.fullmatch(r"\$\{\w+:-(.+)\}", cluster_ids.pop())
    assert default and len(base64.urlsafe_b64decode(default.group(1) + "==")) == 16
    env = svcs["worker"]["environment"]
    assert env["RANKWATCH_KAFKA_BOOTSTRAP"].split(",") == [f"{k}:9092" for k in KAFKA]


def test_clickhouse_is_two_shards_of_two_replicas_on_keeper() -> None:
    svcs = services()
    cluster_file = macros_of = None
    shards: list[list[str]] = []
    for name in CLICKHOUSE:
        mounts = {dst: src for src, dst in bind_mounts(svcs[name])}
        cluster_file = mounts["/etc/clickhouse-server/config.d/cluster.xml"]
        macros_of = mounts["/etc/clickhouse-server/config.d/macros.xml"]
        macros = xml(macros_of).find("macros")
        assert macros is not None
        shard, replica = macros.findtext("shard"), macros.findtext("replica")
        assert replica == name
        shards.append([str(shard), name])
    assert cluster_file is not None
    root = xml(cluster_file)
    cluster = root.find("remote_servers/rankwatch")
    assert cluster is not None
    layout = [[r.findtext("host") for r in s.findall("replica")] for s in cluster.findall("shard")]
    assert layout == [["clickhouse-1", "clickhouse-2"], ["clickhouse-3", "clickhouse-4"]]
    for i, s in enumerate(cluster.findall("shard"), 1):
        assert s.findtext("internal_replication") == "true"
        for host in (r.findtext("host") for r in s.findall("replica")):
            assert [f"0{i}", host] in shards  # the macros name the shard the host is in
    keeper = root.find("zookeeper/node")
    assert keeper is not None and keeper.findtext("host") == "clickhouse-keeper"
    keeper_conf = xml(dict((d, s) for s, d in bind_mounts(svcs["clickhouse-keeper"]))[
        "/etc/clickhouse-keeper/keeper_config.xml"])
    assert keeper_conf.findtext("keeper_server/tcp_port") == keeper.findtext("port")
    assert root.findtext("distributed_ddl/path")
    # the workers and the migration name this cluster
    for name in ("worker", "migrate"):
        env = svcs[name]["environment"]
        assert env["RANKWATCH_CLICKHOUSE_CLUSTER"] == cluster.tag
        assert "@clickhouse-1:8123" in env["RANKWATCH_CLICKHOUSE_URL"]


def test_rankwatch_commands_and_settings_are_real() -> None:
    commands = cli_commands()
    for name, svc in services().items():
        cmd = svc.get("command")
        if cmd and cmd[0] == "rankwatch":
            parser = commands.get(cmd[1])
            assert parser is not None, f"{name}: `rankwatch {cmd[1]}` is not a CLI command"
            parser.parse_args(cmd[2:])
    env = {k: re.sub(r"\$\{[^}]*\}", "secret", str(v))
           for k, v in services()["worker"]["environment"].items()}
    Settings.load(env)  # a valid setting each, the cluster with a server URL
    assert all(not k.startswith("RANKWATCH_") or k[10:].lower() in Settings.model_fields
               for k in env)
