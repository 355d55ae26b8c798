"""The context a subscriber works in: what ``consume/`` uses of the outbox it belongs to.

A subscriber needs the database (engine, the session factory, the inbox), the settings,
the payload stages, the brokers it may consume from, this process's instance id, and the
outbox's write side (`Producer`), through which its
handlers' units of work publish and whose relays their commits wake.
`ConsumeContext` holds exactly that; the composition root builds one per outbox.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.brokers.setup import BrokerSetup
from fastapi_outbox.payloads import Payloads
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.inbox import Inbox
from fastapi_outbox.write.producer import Producer
from fastapi_outbox.write.unit_of_work import UnitOfWork

__all__ = ["ConsumeContext", "UnitOfWorkT"]

#: The class of unit of work a handler receives (``UnitOfWork`` or ``BatchUnitOfWork``).
UnitOfWorkT = TypeVar("UnitOfWorkT", bound=UnitOfWork)


class ConsumeContext:
    """Everything a subscriber uses of the outbox it belongs to (module docstring)."""

    def __init__(
        self,
        *,
        producer: Producer,
        inbox: Inbox,
        instance: str,
        brokers: BrokerSetup,
        subscribers: list[Any],
    ) -> None:
        #: The outbox's write side: the handlers' units of work publish through it.
        self.producer = producer
        #: The consumers' inbox table: which message ids each group handled.
        self.inbox = inbox
        #: This process's id: the broker-side consumer name.
        self.instance = instance
        self._brokers = brokers
        #: The subscribers registered so far (``register`` appends; ``Any``: the list holds
        #: `Subscriber`, which this module below
        #: it cannot name).
        self.subscribers = subscribers

    @property
    def engine(self) -> AsyncEngine:
        """The outbox's database: handler transactions and outage checks."""
        return self.producer.engine

    @property
    def session_factory(self) -> async_sessionmaker[AsyncSession]:
        """Makes the handler's session, bound to the subscriber's connection."""
        return self.producer.session_factory

    @property
    def settings(self) -> OutboxSettings:
        """The ``consumer_*`` defaults and ``shutdown_timeout_seconds``."""
        return self.producer.settings

    @property
    def payloads(self) -> Payloads:
        """The payload stages a delivery is restored through before it is decoded."""
        return self.producer.payloads

    @property
    def brokers(self) -> Mapping[str, Broker]:
        """The brokers subscribers may consume from, by name (read when a run starts: a
        test harness may swap them)."""
        return self._brokers.brokers

    @property
    def default_broker(self) -> str:
        """The broker of a subscriber that names none."""
        return self._brokers.default_broker

    def make_unit_of_work(
        self,
        cls: type[UnitOfWorkT],
        session: AsyncSession,
        *,
        correlation_id: str | None,
        causation_id: str | None,
        traceparent: str | None,
    ) -> UnitOfWorkT:
        """A unit of work of class ``cls`` (``UnitOfWork`` or ``BatchUnitOfWork``) on the
        handler's ``session``, publishing through this outbox."""
        return cls(
            self.producer,
            session,
            correlation_id=correlation_id,
            causation_id=causation_id,
            traceparent=traceparent,
        )
