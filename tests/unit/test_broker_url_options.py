"""Broker options in a broker URL's query (``OUTBOX_BROKER_URL``, ``--broker-url``):
``?envelope=cloudevents``, ``?cloudevents_mode=…``, ``?cloudevents_source=…`` on every
broker, ``?replicas=N`` on NATS; other parameters stay in the URL for the client library;
a bad value names the option. No server is contacted."""

from __future__ import annotations

import pytest

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import (
    MemoryBroker,
    NatsJetStreamBroker,
    RedisStreamsBroker,
    broker_from_url,
    url_options,
)


def test_options_are_taken_out_and_the_rest_stays() -> None:
    url, options = url_options(
        "redis://127.0.0.1:6379/0?socket_timeout=5&envelope=cloudevents&cloudevents_mode=structured"
    )
    assert url == "redis://127.0.0.1:6379/0?socket_timeout=5"
    assert options == {"envelope": "cloudevents", "cloudevents_mode": "structured"}
    assert url_options("nats://a:4222,nats://b:4223?replicas=3") == (
        "nats://a:4222,nats://b:4223",
        {"replicas": 3},
    )
    assert url_options("memory://") == ("memory://", {})


def test_nats_url_sets_replicas_and_envelope() -> None:
    broker = broker_from_url(
        "nats://127.0.0.1:4222,nats://127.0.0.1:4223?replicas=3&envelope=cloudevents"
        "&cloudevents_source=/orders"
    )
    assert isinstance(broker, NatsJetStreamBroker)
    assert broker.connection.replicas == 3
    assert broker.envelope_format.enabled
    assert broker.envelope_format.source == "/orders"
    assert broker.connection.new_stream_config(dead_letter=False)["num_replicas"] == 3


def test_nats_url_sets_the_ping_policy() -> None:
    broker = broker_from_url(
        "nats://127.0.0.1:4222?ping_interval_seconds=0.5&max_outstanding_pings=4"
        "&connect_timeout_seconds=7"
    )
    assert isinstance(broker, NatsJetStreamBroker)
    assert broker.connection.ping_interval_seconds == 0.5
    assert broker.connection.max_outstanding_pings == 4
    assert broker.connection.connect_timeout_seconds == 7
    with pytest.raises(exceptions.ConfigurationError, match="ping_interval_seconds must be > 0"):
        broker_from_url("nats://127.0.0.1:4222?ping_interval_seconds=0")
    with pytest.raises(exceptions.ConfigurationError, match="'ping_interval_seconds' is for"):
        broker_from_url("redis://127.0.0.1:6379?ping_interval_seconds=1")


def test_redis_and_memory_urls_set_the_envelope() -> None:
    redis = broker_from_url("redis://127.0.0.1:6379/0?envelope=cloudevents")
    assert isinstance(redis, RedisStreamsBroker)
    assert redis.envelope_format.enabled
    assert "envelope" not in redis.url
    memory = broker_from_url("memory://?envelope=cloudevents&cloudevents_mode=structured")
    assert isinstance(memory, MemoryBroker)
    assert memory.envelope_format.mode == "structured"


def test_keyword_options_win_over_the_query() -> None:
    broker = broker_from_url("nats://127.0.0.1:4222?replicas=3", replicas=1)
    assert isinstance(broker, NatsJetStreamBroker)
    assert broker.connection.replicas == 1


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("nats://127.0.0.1:4222?replicas=three", ["replicas='three'", "integer"]),
        ("nats://127.0.0.1:4222?replicas=9", ["replicas", "1 to 5"]),
        ("redis://127.0.0.1:6379?replicas=3", ["'replicas'", "nats://"]),
        ("memory://?envelope=xml", ["envelope", "'xml'"]),
        ("redis://:secret@127.0.0.1:6379?replicas=1&replicas=2", ["'replicas'"]),
        ("nats://127.0.0.1:4222?replicas=1&replicas=2", ["given twice"]),
    ],
)
def test_a_bad_option_is_named(url: str, words: list[str]) -> None:
    with pytest.raises(exceptions.ConfigurationError) as caught:
        broker_from_url(url)
    for word in words:
        assert word in str(caught.value)
    assert "secret" not in str(caught.value)


def test_a_cluster_url_takes_the_envelope_and_keeps_its_nodes() -> None:
    broker = broker_from_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001?envelope=cloudevents")
    assert isinstance(broker, RedisStreamsBroker)
    assert broker.envelope_format.enabled
    assert "envelope" not in broker.url and "7001" in broker.url
