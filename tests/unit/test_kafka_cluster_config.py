"""The configuration of a local Kafka cluster's nodes (rankwatch.kafka.broker): pure, nothing
started; tests/integration/test_kafka_cluster.py runs the cluster."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rankwatch.kafka import BrokerError
from rankwatch.kafka.admin import replication
from rankwatch.kafka.broker import Broker, KafkaCluster, cluster_id, local_nodes
from rankwatch.settings import Settings


def settings(tmp_path: Path, brokers: int) -> Settings:
    return Settings.load(env={}, home=tmp_path, kafka_port=21000, kafka_controller_port=21001,
                         kafka_brokers=brokers)


def props(b: Broker) -> dict[str, str]:
    lines = b._server_properties().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


@pytest.mark.parametrize(("brokers", "want"), [(1, (1, 1)), (2, (2, 1)), (3, (3, 2)),
                                                (5, (3, 2))])
def test_three_copies_two_in_sync_from_three_brokers(brokers: int, want: tuple[int, int]) -> None:
    assert replication(brokers) == want


def test_a_single_broker_is_configured_as_before(tmp_path: Path) -> None:
    (b,) = KafkaCluster(settings(tmp_path, 1)).nodes
    p = props(b)
    assert (p["node.id"], p["controller.quorum.voters"]) == ("1", "1@127.0.0.1:21001")
    assert p["listeners"] == "PLAINTEXT://127.0.0.1:21000,CONTROLLER://127.0.0.1:21001"
    assert p["offsets.topic.replication.factor"] == p["min.insync.replicas"] == "1"
    assert b.dir == tmp_path / "kafka" and b.daemon.pid_file.name == "kafka.pid"
    assert KafkaCluster(settings(tmp_path, 1)).bootstrap == "127.0.0.1:21000"


def test_three_nodes_one_quorum_own_ports_and_directories(tmp_path: Path) -> None:
    s = settings(tmp_path, 3)
    c = KafkaCluster(s)
    voters = "1@127.0.0.1:21001,2@127.0.0.1:21101,3@127.0.0.1:21201"
    for i, b in enumerate(c.nodes, 1):
        p = props(b)
        port, ctl = 21000 + 100 * (i - 1), 21001 + 100 * (i - 1)
        assert p["node.id"] == str(i) and p["controller.quorum.voters"] == voters
        assert p["listeners"] == f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{ctl}"
        assert p["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{port}"
        assert p["default.replication.factor"] == p["offsets.topic.replication.factor"] == "3"
        assert p["min.insync.replicas"] == p["transaction.state.log.min.isr"] == "2"
        assert b.dir == tmp_path / "kafka-cluster" / f"node-{i}"
        assert b.id_file == tmp_path / "kafka-cluster" / "cluster.id"  # one cluster id
        assert b.daemon.pid_file.name == f"kafka-{i}.pid" and b.log_file.name == f"kafka-{i}.log"
    assert c.bootstrap == s.bootstrap == "127.0.0.1:21000,127.0.0.1:21100,127.0.0.1:21200"


def test_local_nodes_follow_the_cluster_started_in_the_home(tmp_path: Path) -> None:
    one = settings(tmp_path, 1)
    assert [b.node for b in local_nodes(one)] == [1] and local_nodes(one)[0].nodes == 1
    assert [b.node for b in local_nodes(settings(tmp_path, 3))] == [1, 2, 3]
    for i in (1, 2, 3):  # a cluster's directories, none running: the single broker's view
        (tmp_path / "kafka-cluster" / f"node-{i}").mkdir(parents=True)
    assert [b.nodes for b in local_nodes(one)] == [1]


def test_brokers_is_bounded() -> None:
    from rankwatch.settings import SettingsError

    with pytest.raises(SettingsError, match="RANKWATCH_KAFKA_BROKERS"):
        Settings.load(env={"RANKWATCH_KAFKA_BROKERS": "0"})


def test_up_refuses_a_bad_broker_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rankwatch.cli import build_parser

    args = build_parser().parse_args(["up", "--brokers", "10"])
    assert args.func(args, settings(tmp_path, 1)) == 1
    err = capsys.readouterr().err
    assert "--brokers 10: expected 1 to 9" in err, err
    assert not (tmp_path / "kafka-cluster").exists()  # nothing started


def test_a_cluster_of_another_size_is_refused(tmp_path: Path) -> None:
    from rankwatch.kafka import BrokerError

    for i in (1, 2, 3):
        (tmp_path / "kafka-cluster" / f"node-{i}").mkdir(parents=True)
    with pytest.raises(BrokerError, match="holds a 3-node cluster; start it with --brokers 3"):
        KafkaCluster(settings(tmp_path, 5)).start(timeout=1, progress=lambda _: None)


def test_a_node_that_dies_while_the_cluster_starts_ends_the_wait_with_its_log(
        tmp_path: Path) -> None:
    """Nodes 1 and 3 stand in as live processes (their command lines carry the broker's
    marker); node 2 exits at once. Waiting on node 1 must not run out its timeout: the error
    names node 2 and shows its log."""
    s = settings(tmp_path, 3)
    n1, n2, n3 = KafkaCluster(s).nodes
    live = [sys.executable, "-c", "import time; time.sleep(30)", "kafka.Kafka"]
    pids = [n1.daemon.start(live), n3.daemon.start(live)]
    n2.daemon.start([sys.executable, "-c", "print('bind failed: address in use')"])
    try:
        t0 = time.monotonic()
        with pytest.raises(BrokerError, match="node 2 of 3 exited") as err:
            n1._wait_ready(pids[0], 60, progress=lambda m: None, brokers=3, siblings=[n2, n3])
        assert "bind failed: address in use" in str(err.value)
        assert time.monotonic() - t0 < 30
    finally:
        for b in (n1, n2, n3):
            b.daemon.stop(2)


def test_nodes_formatting_at_once_get_one_cluster_id(tmp_path: Path) -> None:
    """The nodes of a cluster format their storage in parallel threads; every one must read
    the same id, and the file holds it whole (never empty, never two ids)."""
    from concurrent.futures import ThreadPoolExecutor

    for round_ in range(20):
        f = tmp_path / f"c{round_}" / "cluster.id"
        with ThreadPoolExecutor(8) as pool:
            ids = set(pool.map(cluster_id, [f] * 8))
        assert len(ids) == 1 and len(ids.pop()) == 22
        assert f.read_text().strip() and not list(f.parent.glob(".cluster.id.*"))
    assert cluster_id(f) == f.read_text().strip()  # an existing id is kept
