"""RabbitMQ's wire rules without a server: how an envelope becomes AMQP headers and
properties, how a delivery is read back, and the one place where RabbitMQ errors are told
apart (an outage of the broker versus a fault of one message)."""

from __future__ import annotations

import datetime as dt

import aiormq.exceptions as amqp
import pytest

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.rabbitmq.wire import (
    delivery_attempt,
    header_problem,
    message_headers,
    message_identity,
    outage,
    queue_name,
    user_headers,
)
from fastapi_outbox.events import Envelope

URL = "amqp://guest:secret@127.0.0.1:5672/"


def test_envelope_becomes_headers_and_properties() -> None:
    e = Envelope(
        "row-1",
        "orders",
        "OrderPlaced",
        "k1",
        b"{}",
        {
            "message-id": "m-1",
            "type": "OrderPlaced",
            "occurred-at": "2026-01-02T03:04:05+00:00",
            "correlation-id": "c-1",
            "x-tenant": "acme",
            "key": "a user header named key loses to the ordering key",
        },
    )
    headers, properties = message_headers(e)
    assert headers["key"] == "k1" and headers["x-tenant"] == "acme"
    assert properties == {
        "message_id": "m-1",
        "message_type": "OrderPlaced",
        "timestamp": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "correlation_id": "c-1",
    }
    bare = Envelope("row-2", "orders", "T", None, b"{}", {"occurred-at": "not a time"})
    headers, properties = message_headers(bare)
    assert "key" not in headers and properties["timestamp"] is None
    assert properties["message_id"] == "row-2"  # no message-id header: the row id


def test_delivery_read_back() -> None:
    raw = {"message-id": b"m-1", "type": "T", "key": "k", "x-delivery-count": 2, "x-death": []}
    assert user_headers(raw) == {"message-id": "m-1", "type": "T"}
    assert delivery_attempt(raw) == 3
    assert delivery_attempt({}) == 1 and delivery_attempt({"x-delivery-count": "junk"}) == 1
    assert message_identity(raw, "amqp-id") == ("m-1", "T")
    assert message_identity({}, "amqp-id") == ("amqp-id", "")


def test_what_amqp_cannot_carry_is_named() -> None:
    assert header_problem({"ok": "1"}, "orders") is None
    assert "routing key" in (header_problem({}, "s" * 256) or "")
    assert "header name" in (header_problem({"h" * 256: "1"}, "orders") or "")
    assert queue_name("{stream}.{group}", "orders", "billing") == "orders.billing"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (amqp.AMQPConnectionError("Server connection reset"), exceptions.BrokerUnavailable),
        (amqp.ConnectionClosed(320, "CONNECTION_FORCED - shutdown"), exceptions.BrokerUnavailable),
        (amqp.ChannelNotFoundEntity("NOT_FOUND - no exchange"), exceptions.BrokerUnavailable),
        (amqp.ChannelInvalidStateError("closed"), exceptions.BrokerUnavailable),
        (ConnectionRefusedError(111, "refused"), exceptions.BrokerUnavailable),
        (TimeoutError(), exceptions.BrokerTimeout),
    ],
)
def test_outages(error: BaseException, kind: type[Exception]) -> None:
    found = outage(error, URL)
    assert type(found) is kind
    assert "secret" not in str(found)


def test_a_blocked_connection_is_a_refusal_whatever_the_error() -> None:
    found = outage(TimeoutError(), URL, blocked="memory or disk alarm")
    assert isinstance(found, exceptions.BrokerRefusing)
    assert "alarm" in str(found)


def test_a_fault_of_one_message_is_not_an_outage() -> None:
    assert outage(ValueError("bad header value"), URL) is None


def test_publisher_and_consumers_have_a_connection_each() -> None:
    """RabbitMQ blocks a connection that publishes during an alarm: the consumers (acks,
    dead letters) use a connection of their own, to the same server and exchange."""
    from fastapi_outbox.brokers import RabbitMQBroker
    from fastapi_outbox.brokers.consumer import ConsumerConfig

    broker = RabbitMQBroker(URL, exchange="events", queue_prefix="svc.")
    consumer = broker.consumer(
        ConsumerConfig("orders", "billing", "c1", "orders.billing.dlq", 30.0, 5)
    )
    assert consumer.connection is broker.consumer_connection
    assert consumer.connection is not broker.connection
    assert consumer.connection.url == broker.connection.url == URL
    assert consumer.connection.exchange == "events"
    assert (consumer.queue, consumer.dead_letter_queue) == (
        "svc.orders.billing",
        "svc.orders.billing.dlq",
    )
    assert "secret" not in repr(broker) and "secret" not in repr(broker.connection)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"exchange": ""}, "exchange"),
        ({"queue_name": "{stream}"}, "queue_name"),
        ({"confirm_timeout_seconds": 0}, "confirm_timeout_seconds"),
    ],
)
def test_options_are_checked(options: dict[str, object], named: str) -> None:
    from fastapi_outbox.brokers import RabbitMQBroker

    with pytest.raises(exceptions.ConfigurationError, match=named):
        RabbitMQBroker(URL, **options)  # type: ignore[arg-type]
