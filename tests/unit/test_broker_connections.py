"""Each broker's connection object without a server: what its publisher and consumers
share (stream keys, stream settings, the message log) and how it turns a client failure
into an outage that names the server without its credentials."""

from __future__ import annotations

import pytest
import redis.exceptions as rexc

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import MemoryBroker, NatsJetStreamBroker, RedisStreamsBroker
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.memory.connection import MemoryConnection
from fastapi_outbox.brokers.nats.connection import NatsConnection
from fastapi_outbox.brokers.redis.connection import RedisConnection
from fastapi_outbox.brokers.redis.wire import is_unreachable
from fastapi_outbox.events import Envelope

CONFIG = ConsumerConfig("orders", "billing", "c1", "orders.billing.dlq", 30.0, 5)


def test_broker_publisher_and_consumer_share_one_connection() -> None:
    for broker in (
        RedisStreamsBroker("redis://127.0.0.1:1/0"),
        NatsJetStreamBroker("nats://127.0.0.1:1"),
        MemoryBroker(),
    ):
        assert broker.consumer(CONFIG).connection is broker.connection


def test_redis_stream_keys_and_not_connected() -> None:
    connection = RedisConnection("redis://u:secret@h:6379/0", stream_prefix="app:")
    assert connection.stream_key("orders") == "app:orders"
    assert not connection.connected
    with pytest.raises(exceptions.BrokerUnavailable, match="not connected") as caught:
        connection.client  # noqa: B018
    assert "secret" not in str(caught.value)


def test_redis_outages_name_the_server_without_credentials() -> None:
    connection = RedisConnection("redis://u:secret@h:6379/0")
    down = connection.unavailable(rexc.ConnectionError("refused"))
    slow = connection.unavailable(rexc.TimeoutError("no reply"))
    refusing = connection.refusing("READONLY", "You can't write against a read only replica")
    assert type(down) is exceptions.BrokerUnavailable
    assert isinstance(slow, exceptions.BrokerTimeout)
    assert isinstance(refusing, exceptions.BrokerRefusing)
    for error in (down, slow, refusing):
        assert "secret" not in str(error) and "u:***@h:6379" in str(error)
    assert "READONLY" in str(refusing)


def test_redis_unreachable_is_told_from_a_reply() -> None:
    assert is_unreachable(rexc.ConnectionError("x"))
    assert is_unreachable(rexc.TimeoutError("x"))
    assert is_unreachable(OSError("x"))
    assert not is_unreachable(rexc.ResponseError("WRONGTYPE"))


def test_redis_broker_options_reach_its_parts() -> None:
    broker = RedisStreamsBroker(
        "redis://h/0", stream_prefix="p:", socket_timeout=1.5, dead_letter_maxlen=10
    )
    assert broker.connection.socket_timeout == 1.5
    consumer = broker.consumer(CONFIG)
    assert (consumer.key, consumer.dead_key) == ("p:orders", "p:orders.billing.dlq")
    assert consumer.dead_letter_maxlen == 10
    with pytest.raises(exceptions.ConfigurationError, match="dead_letter_maxlen"):
        RedisStreamsBroker("redis://h/0", dead_letter_maxlen=0)


def test_nats_stream_settings() -> None:
    connection = NatsConnection(
        "nats://h:4222",
        dedup_window_seconds=120.0,
        stream_max_age_seconds=60.0,
        stream_max_bytes=1000,
        stream_config={"num_replicas": 3},
    )
    assert connection.new_stream_config() == {
        "duplicate_window": 60.0,  # never longer than the max age
        "max_age": 60.0,
        "max_bytes": 1000,
        "num_replicas": 3,
    }
    # Dead letters keep no limits unless asked; the other settings apply.
    assert connection.new_stream_config(dead_letter=True) == {
        "duplicate_window": 120.0,
        "num_replicas": 3,
    }
    connection.configure(dedup_window_seconds=999.0)  # the broker's own window wins
    assert connection.dedup_window_seconds == 120.0


def test_nats_refuses_bad_limits_naming_the_option() -> None:
    with pytest.raises(exceptions.ConfigurationError, match="stream_max_bytes"):
        NatsConnection("nats://h", stream_max_bytes=0)


def test_nats_outages_name_the_server_without_credentials() -> None:
    connection = NatsConnection("nats://u:secret@h:4222")
    with pytest.raises(exceptions.BrokerUnavailable, match="not connected") as caught:
        connection.jetstream  # noqa: B018
    refusing = connection.refusing("JetStream 503/10039: unavailable")
    for error in (caught.value, connection.unavailable(OSError("reset")), refusing):
        assert "secret" not in str(error) and "h:4222" in str(error)
    assert isinstance(refusing, exceptions.BrokerRefusing)


def test_nats_create_streams_is_the_connections() -> None:
    broker = NatsJetStreamBroker("nats://h", create_streams=False)
    assert broker.connection.create_streams is False
    broker.create_streams = True
    assert broker.connection.create_streams is True


async def test_memory_log_deduplicates_and_goes_down() -> None:
    connection = MemoryConnection()
    e = Envelope("id-1", "orders", "T", None, b"{}", {})
    connection.store([e, e])
    assert connection.messages == [e] and connection.duplicates == 1
    assert connection.on_stream("orders") == [e] and connection.on_stream("other") == []
    connection.available = False
    with pytest.raises(exceptions.BrokerUnavailable):
        await connection.ping()
    connection.clear()
    assert connection.messages == [] and connection.duplicates == 0
