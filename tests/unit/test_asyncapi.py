"""``outbox.asyncapi()``: an AsyncAPI 3.1 document valid against the official JSON Schema
(``data/asyncapi-3.1.0.schema.json``, the AsyncAPI Initiative's ``3.1.0-without-$id.json``
from the npm package ``@asyncapi/specs``, Apache-2.0), whose references all resolve; served
guarded and printed by the CLI; each broker's wire (headers, envelope, sealed and
claim-checked payloads) and bindings. The official parser runs in
``tests/acceptance/test_asyncapi_parser.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from fastapi_outbox import ConfigurationError, Event, Message, Outbox, UnitOfWork
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.cli import main
from fastapi_outbox.ops.asyncapi import build_asyncapi

SCHEMA = json.loads((Path(__file__).parent / "data" / "asyncapi-3.1.0.schema.json").read_text())
VALIDATOR = jsonschema.Draft7Validator(
    SCHEMA, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
)


class Address(Event, abstract=True):
    street: str


class Line(Event, abstract=True):
    sku: str
    quantity: int


class ParcelShipped(Event, stream="parcels.shipped", key="parcel_id", external=True):
    """A parcel left the warehouse."""

    parcel_id: int
    lines: list[Line]
    carrier: str | None = None


class ParcelLost(Event, stream="parcels.shipped", type_name="parcel-lost/v2"):
    parcel_id: int


class ReturnLost(Event, stream="returns", type_name="return-lost/v1"):
    parcel_id: int


def _resolve(document: dict[str, Any], pointer: str) -> Any:
    assert pointer.startswith("#/"), pointer
    node: Any = document
    for part in pointer[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def assert_valid(document: dict[str, Any]) -> None:
    errors = [
        f"{list(e.absolute_path)}: {e.message[:200]}" for e in VALIDATOR.iter_errors(document)
    ]
    assert errors == []
    for ref in _refs(document):
        _resolve(document, ref)  # KeyError: a reference that points nowhere
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        assert schema != {"$ref": f"#/components/schemas/{name}"}, f"{name} refers to itself"


def _outbox() -> Outbox:
    outbox = Outbox(
        "sqlite+aiosqlite:///:memory:",
        brokers={"default": RedisStreamsBroker("redis://user:s3cret@cache.internal:6380/0")},
        external_brokers={"partner": MemoryBroker()},
        dashboard_dependencies=[],
    )

    @outbox.subscriber("parcels.shipped", group="tracking")
    async def track(event: ParcelShipped | ParcelLost, uow: UnitOfWork) -> None:
        """Tracking: follow every parcel."""

    @outbox.subscriber("parcels.shipped", group="audit")
    async def audit(message: Message) -> None: ...

    @outbox.subscriber("returns", group="tracking")
    async def returns(events: list[ReturnLost], uow: UnitOfWork) -> None: ...

    return outbox


def test_the_document_is_valid_asyncapi_3_and_every_reference_resolves() -> None:
    document = _outbox().asyncapi(title="parcels", version="2.1.0")
    assert_valid(document)
    assert document["asyncapi"] == "3.1.0"
    assert document["info"] == {"title": "parcels", "version": "2.1.0"}


def test_the_checker_refuses_an_invalid_document() -> None:
    # The schema really is applied: a wrong action and a missing info are errors.
    document = _outbox().asyncapi()
    document["operations"]["publish.parcels.shipped"]["action"] = "publish"
    del document["info"]
    assert len(list(VALIDATOR.iter_errors(document))) >= 2


def test_streams_events_keys_headers_and_groups_are_described() -> None:
    document = _outbox().asyncapi(events=[ParcelShipped, ParcelLost])
    channels = document["channels"]
    assert {c["address"] for c in channels.values()} == {"parcels.shipped", "returns"}
    shipped = channels["parcels.shipped"]
    # The external event goes to the external broker too, as a message of its own there
    # (no internal headers, the memory broker's wire).
    assert set(shipped["messages"]) == {
        "ParcelShipped",
        "ParcelShipped.partner",
        "parcel-lost_v2",
        "RawMessage",
    }
    # An external event's channel names the external broker's server too.
    assert shipped["servers"] == [{"$ref": "#/servers/default"}, {"$ref": "#/servers/partner"}]

    messages = document["components"]["messages"]
    placed = messages["ParcelShipped"]
    assert placed["name"] == "ParcelShipped" and placed["x-key"] == "parcel_id"
    assert placed["x-external"] is True and placed["summary"] == "A parcel left the warehouse."
    assert messages["parcel-lost_v2"]["name"] == "parcel-lost/v2"
    headers = placed["headers"]
    assert headers["required"] == ["message-id", "type", "occurred-at", "correlation-id"]
    assert headers["properties"]["type"]["const"] == "ParcelShipped"
    assert {"correlation-id", "causation-id", "traceparent"} <= set(headers["properties"])
    assert placed["correlationId"]["location"] == "$message.header#/correlation-id"
    partner = messages["ParcelShipped.partner"]
    assert partner["payload"] == placed["payload"]
    assert "correlation-id" not in partner["headers"]["properties"]
    assert "correlationId" not in partner

    # The payload schema is pydantic's, nested models hoisted into components.schemas.
    schemas = document["components"]["schemas"]
    payload = _resolve(document, placed["payload"]["$ref"])
    assert payload == schemas["ParcelShipped"]
    assert payload["required"] == ["parcel_id", "lines"]
    assert payload["properties"]["lines"]["items"] == {"$ref": "#/components/schemas/Line"}
    assert schemas["Line"]["properties"]["quantity"]["type"] == "integer"

    operations = document["operations"]
    tracking = operations["consume.parcels.shipped.tracking"]
    assert tracking["action"] == "receive" and tracking["x-group"] == "tracking"
    assert tracking["x-dead-letter"] == "parcels.shipped.tracking.dlq"
    assert tracking["description"] == "Tracking: follow every parcel."
    assert [m["$ref"].rsplit("/", 1)[1] for m in tracking["messages"]] == [
        "ParcelShipped",
        "parcel-lost_v2",
    ]
    audit = operations["consume.parcels.shipped.audit"]
    assert audit["messages"] == [{"$ref": "#/channels/parcels.shipped/messages/RawMessage"}]
    batch = operations["consume.returns.tracking"]
    assert batch["messages"] == [{"$ref": "#/channels/returns/messages/return-lost_v1"}]
    sends = {k: v for k, v in operations.items() if v["action"] == "send"}
    assert set(sends) == {"publish.parcels.shipped"}


def test_servers_name_host_and_protocol_never_credentials() -> None:
    document = _outbox().asyncapi(events=[])
    assert document["servers"] == {
        "default": {"host": "cache.internal:6380", "protocol": "redis"},
        "partner": {"host": "in-process", "protocol": "memory"},
    }
    assert "s3cret" not in json.dumps(document) and "user" not in json.dumps(document["servers"])


def test_default_events_are_every_concrete_event_class_of_the_process() -> None:
    document = build_asyncapi(_outbox())
    names = set(document["components"]["messages"])
    assert {"ParcelShipped", "parcel-lost_v2"} <= names
    assert "Address" not in names and "Line" not in names  # abstract bases are not events


async def test_the_router_serves_it_behind_the_dashboard_guard() -> None:
    from examples.orders.app import DASHBOARD_TOKEN, app

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        refused = await client.get("/outbox/asyncapi.json")
        served = await client.get(
            "/outbox/asyncapi.json", headers={"Authorization": f"Bearer {DASHBOARD_TOKEN}"}
        )
    assert refused.status_code == 401
    assert served.status_code == 200
    document = served.json()
    assert_valid(document)
    assert {"OrderPlaced", "OrderCancelled", "InvoiceIssued"} <= set(
        document["components"]["messages"]
    )
    assert document["operations"]["consume.orders.billing"]["x-group"] == "billing"


def test_the_router_is_refused_without_a_guard() -> None:
    outbox = Outbox("sqlite+aiosqlite:///:memory:", brokers={"default": MemoryBroker()})
    with pytest.raises(ConfigurationError, match="dashboard_dependencies"):
        outbox.asyncapi_router  # noqa: B018


def test_the_cli_prints_the_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["asyncapi", "--app", "examples.orders.app:outbox", "--title", "orders"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert_valid(document)
    assert document["info"]["title"] == "orders"
    assert document["channels"]["orders"]["address"] == "orders"


def test_a_rabbitmq_server_is_amqp_without_its_password() -> None:
    from fastapi_outbox.brokers import RabbitMQBroker

    outbox = Outbox(
        "sqlite+aiosqlite:///:memory:",
        brokers={"default": RabbitMQBroker("amqp://guest:pa55@rabbit.internal:5672/")},
    )
    document = outbox.asyncapi(events=[])
    assert document["servers"] == {"default": {"host": "rabbit.internal:5672", "protocol": "amqp"}}
    assert "pa55" not in json.dumps(document)
    assert_valid(document)


# -- the wire, per broker ------------------------------------------------------------------


def _zoo(name: str) -> dict[str, Any]:
    from tests.asyncapi_documents import DOCUMENTS

    document = DOCUMENTS[name]()
    assert_valid(document)
    return document


def _message(document: dict[str, Any], name: str = "Everything") -> dict[str, Any]:
    return dict(document["components"]["messages"][name])


def test_cloudevents_binary_headers_are_described_as_sent() -> None:
    message = _message(_zoo("nats-binary"))
    headers = message["headers"]
    properties = headers["properties"]
    assert properties["ce-specversion"]["const"] == "1.0"
    assert properties["ce-type"]["const"] == "Everything"
    assert properties["ce-subject"]["const"] == "zoo.everything"
    assert properties["ce-id"]["format"] == "uuid"
    assert properties["content-type"]["const"] == "application/json"
    # NATS's own headers: the ordering key and JetStream's de-duplication id.
    assert {"key", "Nats-Msg-Id", "ce-partitionkey", "ce-time"} <= set(headers["required"])
    assert "message-id" not in properties  # carried as ce-id, not twice
    assert message["correlationId"]["location"] == "$message.header#/ce-correlationid"
    assert message["payload"] == {"$ref": "#/components/schemas/Everything"}


def test_cloudevents_structured_puts_the_envelope_in_the_payload() -> None:
    message = _message(_zoo("amqp-structured"))
    assert message["contentType"] == "application/cloudevents+json"
    envelope = message["payload"]
    assert envelope["properties"]["data"] == {"$ref": "#/components/schemas/Everything"}
    assert envelope["properties"]["specversion"]["const"] == "1.0"
    assert envelope["properties"]["datacontenttype"]["const"] == "application/json"
    assert {"specversion", "id", "source", "type", "data"} <= set(envelope["required"])
    assert message["correlationId"]["location"] == "$message.payload#/correlationid"
    assert message["headers"]["properties"]["content_type"]["const"] == (
        "application/cloudevents+json"
    )
    assert message["bindings"]["amqp"]["messageType"] == "Everything"


def test_an_encrypted_and_claim_checked_payload_is_described_sealed_or_as_a_stub() -> None:
    message = _message(_zoo("amqp-sealed"))
    sealed, stub = message["payload"]["oneOf"]
    assert sealed["type"] == "string" and sealed["contentEncoding"] == "base64"
    assert sealed["x-plaintext"] == {"$ref": "#/components/schemas/Everything"}
    assert stub["maxProperties"] == 0 and stub["x-over-bytes"] == 1024
    headers = message["headers"]
    assert "encryption-key-id" in headers["required"]
    assert {"encrypted-headers", "outbox-claim-check", "outbox-claim-check-size"} <= set(
        headers["properties"]
    )
    assert "outbox-claim-check" not in headers["required"]
    # As CloudEvents extensions on Redis, in the headers field's JSON object.
    redis = _message(_zoo("redis-sealed"))
    assert "ce-encryptionkeyid" in redis["headers"]["required"]
    assert "ce-outboxclaimcheck" in redis["headers"]["properties"]
    # CloudEvents structured: the sealed string is the data.
    structured = _message(_zoo("nats-structured-sealed"))
    data = structured["payload"]["properties"]["data"]
    assert data["oneOf"][0]["type"] == "string"


def test_each_broker_s_bindings() -> None:
    redis = _zoo("redis-native")
    channel = redis["channels"]["zoo.everything"]
    assert channel["bindings"]["redis"]["x-stream-key"] == "app:zoo.everything"
    receive = redis["operations"]["consume.zoo.everything.auditors"]["bindings"]["redis"]
    assert receive["x-consumer-group"] == "auditors"
    assert _message(redis)["bindings"]["redis"]["x-fields"] == [
        "id",
        "type",
        "key",
        "headers",
        "payload",
    ]

    nats = _zoo("nats-binary")
    assert nats["channels"]["zoo.everything"]["bindings"]["nats"]["x-jetstream-stream"] == (
        "zoo_everything"
    )
    durable = nats["operations"]["consume.zoo.threads.archive"]["bindings"]["nats"]
    assert durable["x-durable"].startswith("archive_") and durable["x-ack-policy"] == "explicit"

    amqp = _zoo("amqp-structured")
    exchange = amqp["channels"]["zoo.threads"]["bindings"]["amqp"]
    assert exchange["is"] == "routingKey"
    assert exchange["exchange"]["type"] == "topic" and exchange["exchange"]["vhost"] == "shop"
    queue = amqp["operations"]["consume.zoo.threads.archive"]["bindings"]["amqp"]
    assert queue["ack"] is True and queue["x-queue"]["name"] == "zoo.threads.archive"
    assert amqp["operations"]["publish.zoo.threads"]["bindings"]["amqp"]["deliveryMode"] == 2


def test_every_schema_pydantic_makes_is_an_asyncapi_schema() -> None:
    schemas = _zoo("redis-native")["components"]["schemas"]
    pet = schemas["Everything"]["properties"]["pet"]
    assert pet["discriminator"] == "kind"  # pydantic's object, as AsyncAPI's string
    assert schemas["Node"]["properties"]["children"]["items"] == {
        "$ref": "#/components/schemas/Node"
    }
    assert schemas["Thread"]["properties"]["replies"]["items"] == {
        "$ref": "#/components/schemas/Thread"
    }
    assert schemas["Everything"]["properties"]["blob"]["format"] == "base64url" or (
        schemas["Everything"]["properties"]["blob"]["format"] == "binary"
    )


def test_a_kafka_url_gets_topic_group_and_key_bindings_and_ce_underscore_headers() -> None:
    document = _zoo("kafka-binary")
    assert document["servers"]["default"] == {"host": "k1:9092", "protocol": "kafka"}
    assert "pw" not in json.dumps(document)
    channel = document["channels"]["zoo.everything"]
    # The broker's own topic and group templates (topic_name, group_id).
    assert channel["bindings"]["kafka"] == {
        "topic": "app.zoo.everything",
        "bindingVersion": "0.5.0",
    }
    receive = document["operations"]["consume.zoo.everything.auditors"]["bindings"]["kafka"]
    assert receive["groupId"] == {"type": "string", "enum": ["app.zoo.everything.auditors"]}
    message = _message(document)
    assert message["bindings"]["kafka"]["key"]["type"] == "string"
    assert {"ce_id", "ce_type", "ce_partitionkey"} <= set(message["headers"]["required"])
