"""Kafka's wire rules without a server: bootstrap servers from URLs, topic names, record
headers and their decoding, and the one outage classifier."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
from aiokafka import errors

from fastapi_outbox import Message, Outbox, exceptions
from fastapi_outbox.brokers import KafkaBroker, url_options
from fastapi_outbox.brokers.kafka.wire import (
    bootstrap_servers,
    decode_record,
    invalid_topic,
    outage,
    record_headers,
    too_large,
)
from fastapi_outbox.events import Envelope


class Record(NamedTuple):
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


@pytest.mark.parametrize(
    ("url", "servers"),
    [
        ("kafka://a:9092", ["a:9092"]),
        ("kafka://a:9092,b:9093", ["a:9092", "b:9093"]),
        ("kafka://a:9092,kafka://b:9093/", ["a:9092", "b:9093"]),
        ("kafka://u:secret@a", ["a:9092"]),
    ],
)
def test_bootstrap_servers_from_a_url(url: str, servers: list[str]) -> None:
    assert bootstrap_servers(url) == servers


def test_a_url_of_another_scheme_is_refused_without_its_password() -> None:
    with pytest.raises(exceptions.ConfigurationError) as info:
        bootstrap_servers("redis://u:secret@a:6379")
    assert "secret" not in str(info.value)


def test_kafka_url_options_belong_to_kafka() -> None:
    assert url_options("kafka://a:9092?session_timeout_seconds=2&topic_partitions=6")[1] == {
        "session_timeout_seconds": 2.0,
        "topic_partitions": 6,
    }
    with pytest.raises(exceptions.ConfigurationError, match="kafka://"):
        url_options("redis://a:6379?session_timeout_seconds=2")


@pytest.mark.parametrize(
    ("topic", "bad"),
    [
        ("orders", False),
        ("orders.billing.dlq", False),
        ("a/b", True),
        ("", True),
        ("x" * 250, True),
    ],
)
def test_topic_names(topic: str, bad: bool) -> None:
    assert (invalid_topic(topic) is not None) is bad


def test_record_headers_and_their_decoding() -> None:
    e = Envelope(
        "m1",
        "orders",
        "OrderPlaced",
        "k1",
        json.dumps({"n": 1}).encode(),
        {"message-id": "m1", "type": "OrderPlaced", "correlation-id": "c1", "x-note": "é"},
    )
    headers = record_headers(e)
    assert dict(headers) == {
        "message-id": b"m1",
        "type": b"OrderPlaced",
        "correlation-id": b"c1",
        "x-note": "é".encode(),
    }
    d = decode_record("orders", Record("orders", 2, 7, b"k1", e.payload, headers), epoch=1)
    assert (d.message_id, d.type, d.key, d.entry_id, d.attempt) == (
        "m1",
        "OrderPlaced",
        "k1",
        "2:7",
        1,
    )
    assert d.headers["correlation-id"] == "c1" and d.headers["x-note"] == "é"
    assert d.json() == {"n": 1}


def test_a_foreign_cloudevent_record_is_read_as_one() -> None:
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", b"ev-1"),
        ("ce_type", b"OrderPlaced"),
        ("ce_source", b"/elsewhere"),
        ("content-type", b"application/json"),
    ]
    d = decode_record("orders", Record("orders", 0, 0, None, b'{"n": 2}', headers), epoch=1)
    assert (d.message_id, d.type) == ("ev-1", "OrderPlaced")


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (errors.KafkaConnectionError("down"), exceptions.BrokerUnavailable),
        (errors.LeaderNotAvailableError(), exceptions.BrokerUnavailable),
        (errors.NotEnoughReplicasError(), exceptions.BrokerUnavailable),
        (errors.RequestTimedOutError(), exceptions.BrokerTimeout),
        (errors.KafkaTimeoutError(), exceptions.BrokerTimeout),
        (errors.SaslAuthenticationFailed(), exceptions.AuthenticationFailed),
        (errors.MessageSizeTooLargeError(), None),
        (errors.InvalidTopicError(), None),
    ],
)
def test_one_classifier_for_outages(error: BaseException, expected: type | None) -> None:
    found = outage(error, "kafka://u:secret@a:9092")
    if expected is None:
        assert found is None
    else:
        assert type(found) is expected
        assert "secret" not in str(found)


def test_size_limit_errors() -> None:
    assert too_large(errors.MessageSizeTooLargeError())
    assert too_large(errors.RecordListTooLargeError())
    assert not too_large(errors.KafkaConnectionError())


def test_the_asyncapi_document_describes_the_brokers_own_topics_and_groups() -> None:
    broker = KafkaBroker("kafka://u:pw@k1:9092", topic_name="app.{stream}")
    outbox = Outbox("sqlite+aiosqlite:///:memory:", brokers={"default": broker})

    @outbox.subscriber("orders", group="billing")
    async def bill(message: Message) -> None:
        pass

    document = outbox.asyncapi()
    assert document["channels"]["orders"]["bindings"]["kafka"]["topic"] == "app.orders"
    [receive] = [op for op in document["operations"].values() if op["action"] == "receive"]
    assert receive["bindings"]["kafka"]["groupId"]["enum"] == ["app.orders.billing"]
    assert "pw" not in json.dumps(document, default=str)
