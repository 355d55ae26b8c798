"""The context a subscriber works in: what ``consume/`` uses of the outbox it belongs to.

A subscriber needs the database (engine, the session factory, the inbox), the settings,
the payload stages, the brokers it may consume from, this process's instance id, and the
outbox's write side (`Producer`), through which its
handlers' units of work publish and whose relays their commits wake.
`ConsumeContext` holds exactly that; the composition root builds one per outbox.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.brokers.setup import BrokerSetup
from fastapi_outbox.events import HEADER_TENANT
from fastapi_outbox.payloads import Payloads
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.inbox import Inbox
from fastapi_outbox.write.producer import Producer
from fastapi_outbox.write.unit_of_work import UnitOfWork

__all__ = [
    "ConsumeContext",
    "MixedTenants",
    "TenantConsumeContext",
    "UnitOfWorkT",
    "current_tenant",
]

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

    def serving(self, deliveries: Sequence[Delivery]) -> contextlib.AbstractContextManager[None]:
        """While it runs, the handling of ``deliveries`` works in their database: this
        outbox's (a multi-tenant outbox's: their tenant's, `TenantConsumeContext`)."""
        return contextlib.nullcontext()

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


#: The tenant's context of the deliveries handled in this context (multi-tenant outboxes).
_SERVING: contextvars.ContextVar[ConsumeContext | None] = contextvars.ContextVar(
    "fastapi_outbox.tenant_serving", default=None
)


def current_tenant() -> str | None:
    """The tenant of the message whose handler runs in this context (None: none, or a
    single-tenant outbox's)."""
    context = _SERVING.get()
    return None if context is None else context.producer.tenant


class MixedTenants(Exception):
    """A batch holds messages of several tenants: it is handled message by message."""


class TenantConsumeContext(ConsumeContext):
    """A multi-tenant outbox's subscribers: each delivery is handled in the database of the
    tenant its ``tenant`` header names (its inbox row, its handler's effects and the events
    it publishes commit there); a delivery naming no tenant this outbox serves raises
    `UnknownTenant` (the subscriber dead-letters it)."""

    def __init__(self, *, resolve: Callable[[str | None], ConsumeContext], **options: Any) -> None:
        self._resolve = resolve
        super().__init__(**options)

    @property
    def producer(self) -> Producer:
        serving = _SERVING.get()
        return self._producer if serving is None else serving.producer

    @producer.setter
    def producer(self, producer: Producer) -> None:
        self._producer = producer

    @property
    def inbox(self) -> Inbox:
        serving = _SERVING.get()
        return self._inbox if serving is None else serving.inbox

    @inbox.setter
    def inbox(self, inbox: Inbox) -> None:
        self._inbox = inbox

    def serving(self, deliveries: Sequence[Delivery]) -> contextlib.AbstractContextManager[None]:
        tenants = {d.headers.get(HEADER_TENANT) for d in deliveries}
        if len(tenants) > 1:
            raise MixedTenants(f"a batch of {len(tenants)} tenants")
        (tenant,) = tenants
        if tenant is None:
            raise exceptions.UnknownTenant(
                "the message names no tenant (no tenant header) and this outbox serves tenants"
            )
        return _serve(self._resolve(tenant))


@contextlib.contextmanager
def _serve(context: ConsumeContext) -> Iterator[None]:
    token = _SERVING.set(context)
    try:
        yield
    finally:
        _SERVING.reset(token)
