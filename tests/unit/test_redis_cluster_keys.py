"""Redis Cluster: the keys that go with a stream hash to its slot (de-duplication keys,
dead-letter streams), the single-node names stay as they were, a ``redis+cluster://``
URL names its startup nodes, and the cluster client's failures are outages
(docs/how-to/redis-cluster.md)."""

from __future__ import annotations

import pytest
import redis.exceptions as rexc
from redis._parsers.base import BaseParser
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import RedisStreamsBroker, broker_from_url
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.redis.connection import cluster_startup_nodes, is_cluster_url
from fastapi_outbox.brokers.redis.wire import (
    dead_letter_key,
    dedup_key,
    hashed_part,
    is_unreachable,
    refusal_code,
    slot_tag,
)


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


@pytest.mark.parametrize(
    ("key", "part"),
    [
        ("orders", "orders"),
        ("{orders}.v1", "orders"),
        ("app:{orders}:x", "orders"),
        ("a{}b", "a{}b"),  # an empty tag: the whole key is hashed
        ("a{b", "a{b"),
        ("a}b{c}", "c"),
        ("{a}{b}", "a"),
    ],
)
def test_hashed_part_follows_the_redis_cluster_rule(key: str, part: str) -> None:
    assert hashed_part(key) == part
    assert slot(key) == slot(part)


@pytest.mark.parametrize(
    "stream", ["orders", "app:orders", "{orders}.v1", "a{b", "tenant-{42}-orders", "x.y-z_1"]
)
def test_cluster_keys_share_the_stream_slot(stream: str) -> None:
    dedup = dedup_key(stream, "0193-id", cluster=True)
    dead = dead_letter_key(f"{stream}.billing.dlq", stream, cluster=True)
    shared = dead_letter_key("dead-letters", stream, cluster=True)
    assert slot(dedup) == slot(stream)
    assert slot(dead) == slot(stream)
    assert slot(shared) == slot(stream)
    assert dead.endswith(f"{stream}.billing.dlq")  # the name is still in the key


def test_single_node_names_are_unchanged() -> None:
    assert dedup_key("orders", "m1", cluster=False) == "outbox:dedup:{orders}:m1"
    assert dedup_key("a}b", "m1", cluster=False) == "outbox:dedup:{a}b}:m1"
    assert dead_letter_key("orders.g.dlq", "orders", cluster=False) == "orders.g.dlq"
    assert dead_letter_key("dead", "a}b", cluster=False) == "dead"


def test_cluster_names_of_a_plain_stream() -> None:
    # The de-duplication key is the single-node one: a relay moving to a cluster
    # with its data keeps de-duplicating.
    assert dedup_key("orders", "m1", cluster=True) == "outbox:dedup:{orders}:m1"
    assert dead_letter_key("orders.g.dlq", "orders", cluster=True) == "{orders}:orders.g.dlq"
    # A dead-letter name that already carries the stream's tag is kept as it is.
    assert dead_letter_key("{orders}.g.dlq", "orders", cluster=True) == "{orders}.g.dlq"
    assert dead_letter_key("{orders}.g.dlq", "{orders}.v1", cluster=True) == "{orders}.g.dlq"
    assert dedup_key("{orders}.v1", "m1", cluster=True) == "outbox:dedup:{orders}:m1"


@pytest.mark.parametrize("stream", ["a}b", "a{}b", "x}"])
def test_a_stream_no_tag_can_follow_is_refused_on_a_cluster(stream: str) -> None:
    with pytest.raises(ValueError, match="hash tag"):
        slot_tag(stream)
    with pytest.raises(ValueError, match=stream.replace("{", r"\{").replace("}", r"\}")):
        dedup_key(stream, "m1", cluster=True)
    broker = RedisStreamsBroker("redis+cluster://127.0.0.1:7000")
    config = ConsumerConfig(
        stream=stream,
        group="g",
        consumer_name="c",
        dead_letter=f"{stream}.g.dlq",
        claim_idle_seconds=1,
        max_attempts=3,
    )
    with pytest.raises(exceptions.ConfigurationError, match="group 'g'"):
        broker.consumer(config)


def test_the_consumer_keys_on_a_cluster_and_on_a_single_node() -> None:
    config = ConsumerConfig(
        stream="orders",
        group="billing",
        consumer_name="c",
        dead_letter="orders.billing.dlq",
        claim_idle_seconds=1,
        max_attempts=3,
    )
    single = RedisStreamsBroker("redis://127.0.0.1:6379/0", stream_prefix="app:")
    assert single.consumer(config).dead_key == "app:orders.billing.dlq"
    cluster = RedisStreamsBroker("redis+cluster://127.0.0.1:7000", stream_prefix="app:")
    consumer = cluster.consumer(config)
    assert consumer.key == "app:orders"
    assert consumer.dead_key == "{app:orders}:app:orders.billing.dlq"
    assert slot(consumer.dead_key) == slot(consumer.key)


def test_cluster_url_lists_its_startup_nodes() -> None:
    nodes, node_url = cluster_startup_nodes(
        "redis+cluster://user:s%40cret@10.0.0.1:7000,10.0.0.2,[::1]:7002/0?client_name=x"
    )
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002)]
    assert node_url == "redis://user:s%40cret@10.0.0.1:7000/0?client_name=x"
    nodes, node_url = cluster_startup_nodes("rediss+cluster://h:7000")
    assert (nodes, node_url) == ([("h", 7000)], "rediss://h:7000")
    assert is_cluster_url("REDIS+CLUSTER://h:1") and not is_cluster_url("redis://h:1")


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",
        "redis+cluster://:secret@h:7000/1",  # cluster mode has database 0 only
        "redis+cluster://h:port",
        "redis+cluster://:secret@,/",
    ],
)
def test_a_bad_cluster_url_is_refused_at_once(url: str) -> None:
    with pytest.raises(exceptions.ConfigurationError, match="redis\\+cluster://") as info:
        RedisStreamsBroker(url)
    assert "secret" not in str(info.value)


def test_broker_from_url_makes_a_cluster_broker() -> None:
    broker = broker_from_url("redis+cluster://:secret@127.0.0.1:7000,127.0.0.1:7001", maxlen=5)
    assert isinstance(broker, RedisStreamsBroker)
    assert broker.connection.cluster is True
    assert broker.maxlen == 5
    assert "secret" not in repr(broker)
    client = broker.connection._make_client()
    assert isinstance(client, RedisCluster)
    assert [(n.host, n.port) for n in client.startup_nodes] == [
        ("127.0.0.1", 7000),
        ("127.0.0.1", 7001),
    ]
    assert client.get_connection_kwargs()["password"] == "secret"
    assert client.get_connection_kwargs()["socket_timeout"] == broker.connection.socket_timeout


def test_a_ready_cluster_client_makes_a_cluster_broker() -> None:
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", 7000)])
    for broker in (RedisStreamsBroker(client), RedisStreamsBroker(client=client)):
        assert broker.connection.cluster is True
        assert broker.url == "redis+cluster://127.0.0.1:7000"
        assert broker.connection.client is client
    assert RedisStreamsBroker("redis://127.0.0.1:6379/0").connection.cluster is False


@pytest.mark.parametrize(
    "reply",
    [
        "CLUSTERDOWN The cluster is down",
        "CLUSTERDOWN Hash slot not served",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "MOVED 3999 127.0.0.1:6381",
        "ASK 3999 127.0.0.1:6381",
    ],
)
def test_cluster_replies_are_refusals(reply: str) -> None:
    error = BaseParser.parse_error(reply)  # as redis-py makes it from the server's reply
    assert refusal_code(error) == reply.split()[0]
    assert not is_unreachable(error)


@pytest.mark.parametrize(
    "error",
    [
        rexc.ClusterError("TTL exhausted."),
        rexc.SlotNotCoveredError('Slot "42" is not covered by the cluster.'),
        rexc.RedisClusterException(
            "Redis Cluster cannot be connected. Please provide at least one reachable node: x"
        ),
        rexc.RedisClusterException("All slots are not covered after query all startup_nodes."),
        rexc.ConnectionError("Error 111 connecting to 127.0.0.1:7001. Connection refused."),
        rexc.MaxConnectionsError("Too many connections"),
        # A blocked XREADGROUP the server ended: its slot left the node, or the node
        # became a replica (a failover), or the key was deleted.
        BaseParser.parse_error("UNBLOCKED the stream key no longer exists"),
        BaseParser.parse_error(
            "UNBLOCKED force unblock from blocking operation, instance state changed "
            "(master -> replica?)"
        ),
    ],
)
def test_cluster_failures_to_reach_a_node_are_outages(error: BaseException) -> None:
    assert is_unreachable(error)


@pytest.mark.parametrize(
    "error",
    [
        rexc.RedisClusterException("XADD - all keys must map to the same key slot"),
        rexc.CrossSlotTransactionError("Cross slot keys in a transaction"),
        BaseParser.parse_error("CROSSSLOT Keys in request don't hash to the same slot"),
    ],
)
def test_a_cross_slot_command_is_no_outage(error: BaseException) -> None:
    assert not is_unreachable(error)
    assert refusal_code(error) is None


def test_outbox_broker_url_may_name_a_cluster() -> None:
    """``OUTBOX_BROKER_URL`` (``settings.broker_url``; ``--broker-url`` goes the same way)."""
    from fastapi_outbox import OutboxSettings
    from fastapi_outbox.brokers.setup import setup_brokers

    settings = OutboxSettings(broker_url="redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
    broker = setup_brokers(None, None, settings).brokers["default"]
    assert isinstance(broker, RedisStreamsBroker)
    assert broker.connection.cluster is True


def test_a_list_of_startup_nodes_makes_a_cluster_broker() -> None:
    broker = RedisStreamsBroker(["redis://:secret@10.0.0.1:7000/0", "10.0.0.2:7001"])
    assert broker.connection.cluster is True
    assert broker.url == "redis+cluster://:secret@10.0.0.1:7000,10.0.0.2:7001/0"
    assert "secret" not in repr(broker)
    nodes, _ = cluster_startup_nodes(broker.url)
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert RedisStreamsBroker(("rediss://h:7000",)).url == "rediss+cluster://h:7000"
    for bad in ([], ["nats://h:4222"], [""]):
        with pytest.raises(exceptions.ConfigurationError, match="RedisStreamsBroker"):
            RedisStreamsBroker(bad)
