"""``UnitOfWork.publish`` without a database: the rows it queues, the headers it sets, and
the errors it raises where the caller made the mistake (nothing is queued then)."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import pytest
from pydantic import ConfigDict

from fastapi_outbox import (
    ConfigurationError,
    Event,
    EventDefinitionError,
    Message,
    Outbox,
    OutboxSettings,
    PayloadTooLarge,
    PublishError,
    SerializationError,
    UnitOfWork,
    UnitOfWorkError,
    UnknownBroker,
)
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.write.unit_of_work import close, correlation_from_headers


class OrderPlaced(Event, stream="orders", key="order_id"):
    order_id: int
    total: float


class PartnerNotified(Event, stream="partner.orders", external=True):
    order_id: int


class Base(Event, abstract=True):
    pass


@pytest.fixture
def outbox() -> Outbox:
    """No connection is ever opened: publish() only queues rows."""
    return Outbox(
        "sqlite+aiosqlite://",
        brokers={"default": MemoryBroker(), "audit": MemoryBroker()},
        external_brokers={"partner": MemoryBroker()},
        settings=OutboxSettings(max_payload_bytes=1000),
    )


def make_uow(outbox: Outbox, **kwargs: Any) -> UnitOfWork:
    return UnitOfWork(outbox._producer, outbox.session_factory(), **kwargs)


def rows(uow: UnitOfWork) -> list[dict[str, Any]]:
    return uow.queued


def test_event_becomes_one_row_with_the_contract_headers(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    before = dt.datetime.now(dt.UTC)
    message_id = uow.publish(OrderPlaced(order_id=7, total=1.5))
    after = dt.datetime.now(dt.UTC)
    [row] = rows(uow)
    assert row["id"] == message_id and message_id.version == 7
    assert (row["broker"], row["stream"], row["type"], row["key"]) == (
        "default",
        "orders",
        "OrderPlaced",
        "7",
    )
    assert json.loads(row["payload"]) == {"order_id": 7, "total": 1.5}
    headers = json.loads(row["headers"])
    assert headers["message-id"] == str(message_id)
    assert headers["type"] == "OrderPlaced"
    occurred = dt.datetime.fromisoformat(headers["occurred-at"])
    assert occurred.utcoffset() == dt.timedelta(0)
    assert before <= occurred <= after
    # a new correlation id when the caller gave none: a UUID
    assert uuid.UUID(headers["correlation-id"])
    assert "causation-id" not in headers


def test_explicit_message_with_key_headers_and_broker(outbox: Outbox) -> None:
    uow = make_uow(outbox, correlation_id="corr-1", causation_id="cause-1")
    message = Message(
        stream="audit.log", type="Audited", payload={"who": "ada"}, key="k0", headers={"a": "1"}
    )
    uow.publish(message, key="k1", headers={"b": "2"}, broker="audit")
    [row] = rows(uow)
    assert (row["broker"], row["stream"], row["type"], row["key"]) == (
        "audit",
        "audit.log",
        "Audited",
        "k1",
    )
    headers = json.loads(row["headers"])
    assert headers["a"] == "1" and headers["b"] == "2"
    assert headers["correlation-id"] == "corr-1"
    assert headers["causation-id"] == "cause-1"


def test_key_keyword_overrides_the_event_key(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    uow.publish(OrderPlaced(order_id=7, total=1), key="customer-9")
    assert rows(uow)[0]["key"] == "customer-9"


def test_external_event_gets_one_row_per_external_broker_without_internal_headers(
    outbox: Outbox,
) -> None:
    uow = make_uow(outbox, correlation_id="c1", traceparent=None)
    message_id = uow.publish(PartnerNotified(order_id=1))
    internal, external = rows(uow)
    assert internal["id"] == message_id and internal["broker"] == "default"
    assert external["broker"] == "partner" and external["id"] != message_id
    assert "correlation-id" in json.loads(internal["headers"])
    public = json.loads(external["headers"])
    assert "correlation-id" not in public and public["type"] == "PartnerNotified"


def test_unknown_broker_names_it_and_the_configured_ones(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    with pytest.raises(UnknownBroker) as info:
        uow.publish(OrderPlaced(order_id=1, total=1), broker="kafka")
    text = str(info.value)
    assert "'kafka'" in text and "default" in text and "audit" in text
    assert rows(uow) == []


def test_external_broker_name_is_not_a_publish_target(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    with pytest.raises(UnknownBroker, match="external=True"):
        uow.publish(OrderPlaced(order_id=1, total=1), broker="partner")


@pytest.mark.parametrize(
    ("value", "type_name"),
    [({1, 2}, "set"), (dt.datetime(2024, 1, 1, tzinfo=dt.UTC), "datetime"), (b"x", "bytes")],
)
def test_unserialisable_message_payload_names_type_and_stream(
    outbox: Outbox, value: object, type_name: str
) -> None:
    uow = make_uow(outbox)
    with pytest.raises(SerializationError) as info:
        uow.publish(Message(stream="orders", type="Raw", payload={"v": value}))
    assert type_name in str(info.value) and "'orders'" in str(info.value)
    assert rows(uow) == []


def test_unserialisable_event_field_names_type_and_stream(outbox: Outbox) -> None:
    class Odd(Event, stream="odd.things"):
        model_config = ConfigDict(arbitrary_types_allowed=True)
        thing: Any

    uow = make_uow(outbox)
    with pytest.raises(SerializationError) as info:
        uow.publish(Odd(thing=object()))
    assert "Odd" in str(info.value) and "'odd.things'" in str(info.value)
    assert "object" in str(info.value)
    assert rows(uow) == []


def test_nan_in_payload_is_refused(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    with pytest.raises(SerializationError, match="orders"):
        uow.publish(Message(stream="orders", type="Raw", payload={"v": float("nan")}))


def test_payload_must_be_a_dict(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    with pytest.raises(SerializationError, match="list"):
        uow.publish(Message(stream="orders", type="Raw", payload=[1, 2]))  # type: ignore[arg-type]


def test_payload_over_the_limit_names_size_and_limit(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    payload = {"blob": "x" * 2000}
    size = len(json.dumps(payload, separators=(",", ":")))
    with pytest.raises(PayloadTooLarge) as info:
        uow.publish(Message(stream="orders", type="Big", payload=payload))
    text = str(info.value)
    assert str(size) in text and "max_payload_bytes=1000" in text
    assert rows(uow) == []


def test_reserved_and_malformed_headers_are_refused(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    event = OrderPlaced(order_id=1, total=1)
    with pytest.raises(PublishError, match="message-id"):
        uow.publish(event, headers={"message-id": "mine"})
    with pytest.raises(PublishError, match="newline"):
        uow.publish(event, headers={"x": "a\r\nInjected: yes"})
    with pytest.raises(PublishError, match="strings"):
        uow.publish(event, headers={"x": 1})  # type: ignore[dict-item]
    with pytest.raises(PublishError, match="stream"):
        uow.publish(Message(stream="has space", type="T", payload={}))
    assert rows(uow) == []


def test_abstract_event_and_wrong_type_are_refused(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    with pytest.raises(EventDefinitionError, match="abstract"):
        uow.publish(Base())
    with pytest.raises(TypeError, match="dict"):
        uow.publish({"stream": "orders"})  # type: ignore[arg-type]


def test_invalid_correlation_or_causation_id_is_refused(outbox: Outbox) -> None:
    with pytest.raises(UnitOfWorkError, match="correlation_id"):
        make_uow(outbox, correlation_id="bad id with spaces")
    with pytest.raises(UnitOfWorkError, match="causation_id"):
        make_uow(outbox, causation_id="x" * 200)


def test_publish_after_close_is_refused(outbox: Outbox) -> None:
    uow = make_uow(outbox)
    close(uow)
    with pytest.raises(UnitOfWorkError, match="already committed"):
        uow.publish(OrderPlaced(order_id=1, total=1))


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, (None, None)),
        ({"X-Correlation-ID": "abc-123"}, ("abc-123", None)),
        ({"traceparent": TRACEPARENT}, (TRACE_ID, TRACEPARENT)),
        ({"X-Correlation-ID": "mine", "traceparent": TRACEPARENT}, ("mine", TRACEPARENT)),
        ({"traceparent": "garbage"}, (None, None)),
        ({"X-Correlation-ID": "a" * 128}, ("a" * 128, None)),
    ],
)
def test_correlation_from_request_headers(
    headers: dict[str, str], expected: tuple[str | None, str | None]
) -> None:
    assert correlation_from_headers(headers) == expected


@pytest.mark.parametrize("bad", ["a" * 129, "", "has space", "semi;colon", "new\nline", "ü"])
def test_invalid_correlation_header_names_the_header(bad: str) -> None:
    with pytest.raises(ValueError, match="X-Correlation-ID"):
        correlation_from_headers({"X-Correlation-ID": bad})


def test_broker_names_are_checked_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="broker name"):
        Outbox(
            "sqlite+aiosqlite://", brokers={"bad name": MemoryBroker()}, settings=OutboxSettings()
        )
    with pytest.raises(ConfigurationError, match="internal and external"):
        Outbox(
            "sqlite+aiosqlite://",
            brokers={"x": MemoryBroker()},
            external_brokers={"x": MemoryBroker()},
            settings=OutboxSettings(),
        )
