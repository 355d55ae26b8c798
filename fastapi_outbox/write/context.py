"""What a unit of work sees of its outbox: a small port, never the ``Outbox`` itself.

:class:`WriteContext` is everything :class:`~fastapi_outbox.write.unit_of_work.UnitOfWork`
and the request dependency use: the settings, the session factory, the broker names, the
trace headers, the unit-of-work context manager, and — as the session's
:class:`~fastapi_outbox.write.session_events.Sink` — writing rows and the after-commit
wake-up hook. The composition root (:class:`fastapi_outbox.outbox.Outbox`) implements it;
``tests/unit/test_write_context.py`` checks that it does.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fastapi_outbox.payloads import Payloads
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.write.session_events import Sink

__all__ = ["WriteContext"]


class WriteContext(Sink, Protocol):
    """The outbox as the write path sees it."""

    @property
    def settings(self) -> OutboxSettings:
        """Payload and delay limits (``max_payload_bytes``, ``max_delay_seconds``)."""

    @property
    def payloads(self) -> Payloads:
        """The payload stages (encryption, claim-check) ``publish`` seals messages with."""

    @property
    def session_factory(self) -> async_sessionmaker[AsyncSession]:
        """Sessions of the units of work that open their own."""

    @property
    def external_brokers(self) -> Mapping[str, Any]:
        """The external brokers by name: an ``external=True`` event gets a row for each."""

    def resolve_broker(self, name: str | None) -> str:
        """The internal broker a message goes to (``None``: the default one);
        :class:`~fastapi_outbox.exceptions.UnknownBroker` for a name it does not know."""

    def trace_headers(self, traceparent: str | None) -> dict[str, str]:
        """W3C trace context to store with a message."""

    def unit_of_work(
        self,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        traceparent: str | None = None,
        session: AsyncSession | None = None,
    ) -> AbstractAsyncContextManager[Any]:
        """``async with context.unit_of_work() as uow`` (the request dependency's)."""
