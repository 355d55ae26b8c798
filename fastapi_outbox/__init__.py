"""fastapi-outbox: an asyncio-native transactional outbox for FastAPI.

A route handler changes business data and raises domain events; ``Depends(unit_of_work)``
commits both in one transaction before the response is sent, and relays started by
the app's lifespan move the events to Redis Streams or NATS JetStream.
"""

from __future__ import annotations

from fastapi_outbox.aggregates import AggregateRoot
from fastapi_outbox.consume.subscriber import BatchUnitOfWork
from fastapi_outbox.events import Envelope, Event, Message, MessageStatus, uuid7
from fastapi_outbox.exceptions import (
    AuthenticationFailed,
    BrokerRefusing,
    BrokerUnavailable,
    ConfigurationError,
    EventDefinitionError,
    MessageRejected,
    OutboxError,
    PayloadTooLarge,
    PublishError,
    SerializationError,
    UnitOfWorkError,
    UnknownBroker,
    UnknownTenant,
)
from fastapi_outbox.log import JsonFormatter, TextFormatter
from fastapi_outbox.ops.metrics import PrometheusInstrumentation, metrics_router, mount_metrics
from fastapi_outbox.outbox import Outbox
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.schema import build_archive_table, build_table, metadata, outbox_table
from fastapi_outbox.write.unit_of_work import UnitOfWork, UnitOfWorkDep, unit_of_work

__version__ = "0.1.0"

__all__ = [
    "AggregateRoot",
    "AuthenticationFailed",
    "BatchUnitOfWork",
    "BrokerRefusing",
    "BrokerUnavailable",
    "ConfigurationError",
    "Envelope",
    "Event",
    "EventDefinitionError",
    "JsonFormatter",
    "Message",
    "MessageRejected",
    "MessageStatus",
    "Outbox",
    "OutboxError",
    "OutboxSettings",
    "PayloadTooLarge",
    "PrometheusInstrumentation",
    "PublishError",
    "SerializationError",
    "TextFormatter",
    "UnitOfWork",
    "UnitOfWorkDep",
    "UnitOfWorkError",
    "UnknownBroker",
    "UnknownTenant",
    "__version__",
    "build_archive_table",
    "build_table",
    "metadata",
    "metrics_router",
    "mount_metrics",
    "outbox_table",
    "unit_of_work",
    "uuid7",
]
