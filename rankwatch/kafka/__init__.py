"""The local Kafka: a real KRaft cluster from Apache Kafka's jars (no ZooKeeper, no Docker).

- `jars`: fetches Kafka's jars from Maven Central once (through `mvn`) into the cache dir;
- `broker`: `Broker` runs one combined broker+controller JVM from those jars; `KafkaCluster`
  runs `settings.kafka_brokers` such nodes as one KRaft cluster (every node a broker and a voter
  of the controller quorum); with one node it is the single `Broker`;
- `admin`: probes a cluster and shapes its topics with the confluent-kafka admin client
  (replication factor 3 and ``min.insync.replicas=2`` on a cluster of three or more brokers).

The processes themselves are `rankwatch.daemon.Daemon`s, as the stack's other services are.

Kafka 3.9.x is pinned on purpose: aiokafka (Faust's transport) still speaks request versions that
Kafka 4 removed, and confluent-kafka 2.x speaks to both.
"""


class BrokerError(RuntimeError):
    """The broker (or its jars) could not be set up; the message says what to do."""
