"""The CloudEvents mapping (fastapi_outbox.brokers.cloudevents) checked against the
``cloudevents`` SDK's own parser and writer: what we encode the SDK reads, what the SDK
writes we decode, in binary and structured mode."""

from __future__ import annotations

import json

import pytest
from cloudevents.v1.conversion import to_binary, to_structured
from cloudevents.v1.http import CloudEvent, from_http

from fastapi_outbox.brokers import cloudevents as ce
from fastapi_outbox.events import Envelope
from fastapi_outbox.exceptions import ConfigurationError

HEADERS = {
    "message-id": "0191e7a4-0000-7000-8000-000000000001",
    "type": "OrderPlaced",
    "occurred-at": "2026-11-25T17:00:00.123456+00:00",
    "correlation-id": "corr-1",
    "causation-id": "cause-1",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "x-tenant": "acme",
}


def _envelope() -> Envelope:
    return Envelope(
        id="row-1",
        stream="orders",
        type="OrderPlaced",
        key="order-42",
        payload=b'{"order_id":42,"total":"9.90"}',
        headers=dict(HEADERS),
    )


def _check_sdk_event(event: CloudEvent) -> None:
    assert event["specversion"] == "1.0"
    assert event["id"] == HEADERS["message-id"]
    assert event["type"] == "OrderPlaced"
    assert event["source"] == "/orders-service"
    assert event["subject"] == "orders"
    assert event["time"] == HEADERS["occurred-at"]
    assert event["correlationid"] == "corr-1"
    assert event["causationid"] == "cause-1"
    assert event["traceparent"] == HEADERS["traceparent"]
    assert event["partitionkey"] == "order-42"
    assert event["xtenant"] == "acme"
    assert event.data == {"order_id": 42, "total": "9.90"}


@pytest.mark.parametrize("mode", ["binary", "structured"])
def test_the_sdk_parses_what_we_encode(mode: ce.CloudEventsMode) -> None:
    headers, body = ce.encode(_envelope(), "/orders-service", mode)
    _check_sdk_event(from_http(headers, body))


def test_binary_mode_headers_and_body() -> None:
    headers, body = ce.encode(_envelope(), "/orders-service", "binary")
    assert headers["ce-specversion"] == "1.0"
    assert headers["content-type"] == "application/json"
    assert "ce-datacontenttype" not in headers
    assert body == _envelope().payload


def test_structured_mode_is_one_json_document() -> None:
    headers, body = ce.encode(_envelope(), "/s", "structured")
    assert headers == {"content-type": "application/cloudevents+json"}
    document = json.loads(body)
    assert document["data"] == {"order_id": 42, "total": "9.90"}
    assert document["datacontenttype"] == "application/json"


def test_the_amqp_prefix() -> None:
    headers, _ = ce.encode(_envelope(), "/s", "binary", prefix=ce.AMQP_BINARY_PREFIX)
    assert headers["cloudEvents_id"] == HEADERS["message-id"]
    assert ce.is_cloudevent(headers)
    decoded = ce.decode(headers, _envelope().payload)
    assert decoded is not None and decoded.message_id == HEADERS["message-id"]


@pytest.mark.parametrize("mode", ["binary", "structured"])
def test_round_trip_gives_the_outbox_headers_back(mode: ce.CloudEventsMode) -> None:
    headers, body = ce.encode(_envelope(), "/orders-service", mode)
    assert ce.is_cloudevent(headers)
    event = ce.decode(headers, body)
    assert event is not None
    assert event.message_id == HEADERS["message-id"]
    assert event.type == "OrderPlaced"
    assert event.key == "order-42"
    assert json.loads(event.payload) == {"order_id": 42, "total": "9.90"}
    for name in ("message-id", "type", "occurred-at", "correlation-id", "causation-id"):
        assert event.headers[name] == HEADERS[name]
    assert event.headers["traceparent"] == HEADERS["traceparent"]
    assert event.headers["ce-source"] == "/orders-service"
    assert event.headers["ce-subject"] == "orders"
    assert event.headers["ce-xtenant"] == "acme"


def _foreign() -> CloudEvent:
    return CloudEvent(
        {
            "type": "com.example.invoice.paid",
            "source": "https://billing.example.com",
            "id": "inv-7",
            "time": "2026-11-25T12:00:00Z",
            "subject": "invoices",
            "correlationid": "c-9",
        },
        {"invoice": 7},
    )


@pytest.mark.parametrize("writer", [to_binary, to_structured])
def test_we_decode_what_the_sdk_writes(writer: object) -> None:
    headers, body = writer(_foreign())  # type: ignore[operator]
    assert ce.is_cloudevent(headers)
    event = ce.decode(headers, body)
    assert event is not None
    assert event.message_id == "inv-7"
    assert event.type == "com.example.invoice.paid"
    assert event.key is None
    assert json.loads(event.payload) == {"invoice": 7}
    assert event.headers["occurred-at"] == "2026-11-25T12:00:00Z"
    assert event.headers["correlation-id"] == "c-9"
    assert event.headers["ce-source"] == "https://billing.example.com"


def test_structured_base64_data() -> None:
    body = json.dumps(
        {"specversion": "1.0", "id": "b", "type": "t", "source": "/s", "data_base64": "aGk="}
    ).encode()
    event = ce.decode({"Content-Type": "application/cloudevents+json; charset=utf-8"}, body)
    assert event is not None and event.payload == b"hi"


def test_not_a_cloudevent() -> None:
    assert not ce.is_cloudevent({"message-id": "m", "type": "t"})
    assert ce.decode({"message-id": "m"}, b"{}") is None


def test_an_event_without_id_is_refused() -> None:
    with pytest.raises(ValueError, match="id or type"):
        ce.decode({"ce-specversion": "1.0", "ce-type": "t"}, b"{}")


def test_a_structured_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        ce.decode({"content-type": "application/cloudevents+json"}, b"[1]")


@pytest.mark.parametrize(
    "kwargs",
    [{"envelope": "xml"}, {"mode": "batched"}, {"source": ""}],
)
def test_options_are_checked(kwargs: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError):
        ce.CloudEventsOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", ["ce_", "cloudEvents:"])
def test_other_binary_prefixes_are_read(prefix: str) -> None:
    headers = {prefix + "specversion": "1.0", prefix + "id": "i", prefix + "type": "t"}
    event = ce.decode(headers, b"{}")
    assert event is not None and (event.message_id, event.type) == ("i", "t")


@pytest.mark.parametrize("mode", ["binary", "structured"])
def test_a_redis_entry_carries_the_message_id_not_the_row_id(mode: ce.CloudEventsMode) -> None:
    from fastapi_outbox.brokers.redis.wire import PUBLISHED_FIELDS, decode_entry, entry_values

    options = ce.CloudEventsOptions("cloudevents", mode, "/s")
    values = entry_values(_envelope(), options)
    assert values[0] == HEADERS["message-id"]
    raw = [
        part if isinstance(part, bytes) else part.encode()
        for pair in zip(PUBLISHED_FIELDS, values, strict=True)
        for part in pair
    ]
    delivery = decode_entry("orders", b"1-0", raw, 1)
    assert delivery.message_id == HEADERS["message-id"]
    assert delivery.key == "order-42"
    assert json.loads(delivery.payload) == {"order_id": 42, "total": "9.90"}
    assert delivery.headers["correlation-id"] == "corr-1"


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"ce-specversion": "1.0", "ce-type": "t"}, b"{}"),
        ({"content-type": "application/cloudevents+json"}, b"not json"),
        (
            {"content-type": "application/cloudevents+json"},
            b'{"id": "i", "type": "t", "data_base64": "!"}',
        ),
    ],
)
def test_a_malformed_cloudevent_is_delivered_as_native(
    headers: dict[str, str], body: bytes
) -> None:
    assert ce.as_delivery(headers, body, stream="s", entry_id="1", attempt=1) is None


def test_as_delivery_maps_a_cloudevent() -> None:
    headers, body = ce.encode(_envelope(), "/s", "binary")
    d = ce.as_delivery(headers, body, stream="orders", entry_id="7", attempt=2, handle="h")
    assert d is not None
    assert (d.stream, d.entry_id, d.attempt, d.handle) == ("orders", "7", 2, "h")
    assert (d.message_id, d.type, d.key) == (HEADERS["message-id"], "OrderPlaced", "order-42")
    assert d.headers["occurred-at"] == HEADERS["occurred-at"]
