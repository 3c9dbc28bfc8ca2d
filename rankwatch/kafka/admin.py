"""Kafka admin: whether a cluster answers, and its topics (create, list, delete).

Calls go through the confluent-kafka admin client; its failures surface as `BrokerError`
naming the cluster. Topics are replicated according to the cluster's size (`replication`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # the class confluent_kafka.admin re-exports

from ingest.topics import TopicSpec
from rankwatch.daemon import port_open
from rankwatch.kafka import BrokerError

#: librdkafka logs every refused connection; `probe` expects refusals while a cluster starts.
_rdkafka_log = logging.getLogger("rankwatch.kafka.librdkafka")
_rdkafka_log.addHandler(logging.NullHandler())
_rdkafka_log.propagate = False
log = logging.getLogger(__name__)
_T = TypeVar("_T")


def replication(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for a cluster of `brokers` brokers: three
    copies and two in sync where there are three brokers or more, so one broker may be lost
    without losing an acknowledged record or refusing a write; else every broker has a copy."""
    factor = min(3, max(1, brokers))
    return factor, max(1, factor - 1)


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


#: Admin errors that say "this attempt was lost", not "this request is wrong": librdkafka
#: (2.10 and later) decommissions its bootstrap connections once it has learned the cluster's
#: brokers, failing a request in flight on one with _DESTROY_BROKER; a broker that restarts
#: or drops a connection fails it with _TRANSPORT. Sending the request again is correct.
_TRANSIENT = frozenset({"_DESTROY_BROKER", "_TRANSPORT", "_TIMED_OUT", "NOT_CONTROLLER",
                        "REQUEST_TIMED_OUT"})


class _Failed(BrokerError):
    """An admin request with failures; `transient` when every failure may be retried."""

    def __init__(self, errors: list[str], transient: bool) -> None:
        super().__init__("Kafka admin request failed:\n  " + "\n  ".join(errors))
        self.transient = transient


def _wait(futures: dict[str, Any], ignore: Iterable[str]) -> list[str]:
    """Resolve admin futures; return the names that succeeded. Error codes in `ignore` are ok."""
    done, errors, transient = [], [], True
    for name, fut in futures.items():
        try:
            fut.result()
            done.append(name)
        except KafkaException as e:
            err = e.args[0]
            if err.name() not in ignore:
                errors.append(f"{name}: {err.str()}")
                transient &= err.name() in _TRANSIENT or bool(err.retriable())
    if errors:
        raise _Failed(errors, transient)
    return done


def _retrying(bootstrap: str, timeout: float, what: str,
              attempt: Callable[[AdminClient], _T]) -> _T:
    """`attempt(admin)` with a fresh client, again while its request is lost in transit
    (`_Failed.transient`), until `timeout`; any other failure at once."""
    deadline = time.monotonic() + timeout
    while True:
        admin = _admin(bootstrap)  # kept referenced: its futures fail once it is collected
        try:
            return attempt(admin)
        except _Failed as e:
            if not e.transient or time.monotonic() > deadline:
                raise
            log.info("%s again: %s", what, e)
            time.sleep(0.5)


def ensure_topics(bootstrap: str, specs: Sequence[TopicSpec], timeout: float = 30.0,
                  brokers: int = 1) -> list[str]:
    """Create the topics of `specs` that do not exist; return the names created.

    `brokers`: how many brokers the cluster is known to have (a local cluster this command
    started); creation waits up to `timeout` for the metadata to list them, since the factor
    follows the brokers listed and a node that answers first may not list its peers yet (a
    3-node cluster's topics were once created with 2 replicas).

    Idempotent. Existing topics are left as they are (adding partitions would move keys). The
    replication factor and ``min.insync.replicas`` follow the cluster's size (`replication`:
    3 and 2 from three brokers up, so producers with acks=all keep writing and consumers keep
    reading when one broker is lost). A request lost in transit (`_TRANSIENT`) is sent again,
    with a fresh client, until `timeout`; a topic created by a lost attempt then answers
    TOPIC_ALREADY_EXISTS, or is found existing, which counts as done. Returns once the
    broker's metadata lists them.
    """
    tried = False

    def create(admin: AdminClient) -> list[str]:
        nonlocal tried
        md = admin.list_topics(timeout=timeout)
        factor, min_isr = replication(len(md.brokers))
        new = [NewTopic(s.name, num_partitions=s.partitions, replication_factor=factor,
                        config={**_topic_config(s), "min.insync.replicas": str(min_isr)})
               for s in specs if s.name not in md.topics]
        if not new:
            return []
        tried = True
        return _wait(admin.create_topics(new, request_timeout=timeout), {"TOPIC_ALREADY_EXISTS"})

    deadline = time.monotonic() + timeout
    while brokers > 1 and probe(bootstrap, timeout=2.0, brokers=brokers) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    with _admin_errors(bootstrap):
        created = _retrying(bootstrap, timeout, "creating topics", create)
        if tried:
            _await_metadata(_admin(bootstrap), [s.name for s in specs], timeout)
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
    """Delete topics (for test cleanup); names that do not exist are ignored. A request lost
    in transit is sent again until `timeout`, as in `ensure_topics`."""
    left = list(names)
    if not left:
        return []
    with _admin_errors(bootstrap):
        return _retrying(bootstrap, timeout, "deleting topics", lambda admin: _wait(
            admin.delete_topics(left, operation_timeout=timeout, request_timeout=timeout),
            {"UNKNOWN_TOPIC_OR_PART"}))
