"""Outboxes over the zoo's events (``tests/asyncapi_zoo.py``) on every broker and wire form:
native, CloudEvents binary and structured, encrypted, claim-checked; built without
connecting to anything."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import (
    MemoryBroker,
    NatsJetStreamBroker,
    RabbitMQBroker,
    RedisStreamsBroker,
)
from tests import asyncapi_zoo as zoo

ZOO_EVENTS = [zoo.Everything, zoo.Thread, zoo.Ping]
KEY = bytes(range(32))


def zoo_outbox(broker: Any, *, sealed: bool = False, external: Any = None) -> Outbox:
    """An outbox of the zoo on ``broker``; ``sealed``: payloads encrypted (one header
    sealed too) and claim-checked over 1 KiB."""
    settings = OutboxSettings(
        encryption_keys={"k1": KEY} if sealed else None,
        encrypted_headers=["x-secret"] if sealed else [],
        claim_check_bytes=1024 if sealed else None,
    )
    outbox = Outbox(
        "sqlite+aiosqlite:///:memory:",
        brokers={"default": broker},
        external_brokers={"partner": external} if external is not None else None,
        settings=settings,
    )
    zoo.subscribe(outbox)
    return outbox


def zoo_document(broker: Any, **options: Any) -> dict[str, Any]:
    return zoo_outbox(broker, **options).asyncapi(title="zoo", events=ZOO_EVENTS)


#: name → the document, for every broker and wire form.
DOCUMENTS: dict[str, Callable[[], dict[str, Any]]] = {
    "redis-native": lambda: zoo_document(
        RedisStreamsBroker("redis://127.0.0.1:6379/0", stream_prefix="app:"),
        external=MemoryBroker(),
    ),
    "nats-binary": lambda: zoo_document(
        NatsJetStreamBroker("nats://127.0.0.1:4222", envelope="cloudevents")
    ),
    "amqp-structured": lambda: zoo_document(
        RabbitMQBroker(
            "amqp://guest:guest@127.0.0.1:5672/shop",
            envelope="cloudevents",
            cloudevents_mode="structured",
        )
    ),
    "redis-sealed": lambda: zoo_document(
        RedisStreamsBroker("redis://127.0.0.1:6379/0", envelope="cloudevents"), sealed=True
    ),
    "nats-structured-sealed": lambda: zoo_document(
        NatsJetStreamBroker(
            "nats://127.0.0.1:4222", envelope="cloudevents", cloudevents_mode="structured"
        ),
        sealed=True,
    ),
    "amqp-sealed": lambda: zoo_document(
        RabbitMQBroker("amqp://guest:guest@127.0.0.1:5672/"), sealed=True
    ),
}


class KafkaLike:
    """A broker with a ``kafka://`` URL and no ``asyncapi_wire()`` of its own: described by
    its scheme (``BY_SCHEME``). It is never connected."""

    def __init__(self, url: str, envelope_format: Any = None) -> None:
        self.url = url
        self.envelope_format = envelope_format
        self.topic_name = "app.{stream}"
        self.group_id = "{topic}.{group}"

    async def connect(self) -> None: ...

    async def aclose(self) -> None: ...

    async def ping(self) -> None: ...

    async def publish(self, batch: Any) -> list[BaseException | None]:
        return [None for _ in batch]

    def configure(self, *, dedup_window_seconds: float) -> None: ...

    def consumer(self, config: Any) -> Any:
        raise NotImplementedError("never started")


def _kafka() -> dict[str, Any]:
    from fastapi_outbox.brokers.cloudevents import CloudEventsOptions

    return zoo_document(
        KafkaLike("kafka://user:pw@k1:9092,k2:9092", CloudEventsOptions("cloudevents"))
    )


DOCUMENTS["kafka-binary"] = _kafka
