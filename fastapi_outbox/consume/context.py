"""The context a subscriber works in: the small port ``consume/`` sees instead of ``Outbox``.

A subscriber needs the database (engine, session factory, the inbox), the settings, the
brokers it may consume from, this process's instance id, a way to give its handlers a unit
of work, and the after-commit wake-up of the relays. :class:`ConsumeContext` names exactly
that; :class:`~fastapi_outbox.outbox.Outbox` satisfies it structurally (checked by
``tests/unit/test_consume_context.py``), and nothing in ``consume/`` imports ``Outbox``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.payloads import Payloads
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.inbox import Inbox
from fastapi_outbox.write.unit_of_work import UnitOfWork

__all__ = ["AfterCommit", "ConsumeContext", "UnitOfWorkT"]

#: The class of unit of work a handler receives (``UnitOfWork`` or ``BatchUnitOfWork``).
UnitOfWorkT = TypeVar("UnitOfWorkT", bound=UnitOfWork)


class AfterCommit(Protocol):
    """What a subscriber tells after its commit: the relays of the outbox whose rows the
    handlers wrote wake up (one NOTIFY for other processes when this one runs none)."""

    async def notify_after_commit(self) -> None: ...


class ConsumeContext(AfterCommit, Protocol):
    """Everything a subscriber uses of the outbox it belongs to."""

    @property
    def engine(self) -> AsyncEngine:
        """The outbox's database: handler transactions and outage checks."""

    @property
    def session_factory(self) -> async_sessionmaker[AsyncSession]:
        """Makes the handler's session, bound to the subscriber's connection."""

    @property
    def settings(self) -> OutboxSettings:
        """The ``consumer_*`` defaults and ``shutdown_timeout_seconds``."""

    @property
    def payloads(self) -> Payloads:
        """The payload stages a delivery is restored through before it is decoded."""

    @property
    def inbox(self) -> Inbox:
        """The consumers' inbox table: which message ids each group handled."""

    @property
    def instance(self) -> str:
        """This process's id: the broker-side consumer name."""

    @property
    def brokers(self) -> Mapping[str, Broker]:
        """The brokers subscribers may consume from, by name."""

    @property
    def default_broker(self) -> str:
        """The broker of a subscriber that names none."""

    @property
    def subscribers(self) -> list[Any]:
        """The subscribers registered so far (``register`` appends; ``Any``: the list
        holds :class:`~fastapi_outbox.consume.subscriber.Subscriber`, which this module
        below it cannot name)."""

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
