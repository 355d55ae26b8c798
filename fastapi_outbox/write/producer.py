"""The write side of one outbox: what its units of work publish through.

A `Producer` holds what the write path needs and nothing more — the settings, the
payload stages, the session factory, the broker names an event may go to, the capture
that writes rows (with the claim-checked payloads) and the relays its commits wake — so
a request's unit of work goes down only: route → ``write/`` → ``storage``/``relay``. The
composition root ([`fastapi_outbox.outbox.Outbox`][fastapi_outbox.Outbox]) builds one and hands it
to the
request dependency and to the subscribers' handlers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from fastapi_outbox import tracing
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.brokers.setup import BrokerSetup, resolve_broker
from fastapi_outbox.payloads import Payloads
from fastapi_outbox.payloads.claim_check import put_claims
from fastapi_outbox.relay.relays import Relays
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.claim_check import PayloadStore
from fastapi_outbox.write.capture import Capture

__all__ = ["Producer"]


class Producer:
    """The write side of one outbox (module docstring)."""

    __slots__ = (
        "__weakref__",
        "_brokers",
        "capture",
        "claim_check_store",
        "engine",
        "payloads",
        "relays",
        "session_factory",
        "settings",
        "tenant",
    )

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        settings: OutboxSettings,
        payloads: Payloads,
        session_factory: async_sessionmaker[AsyncSession],
        brokers: BrokerSetup,
        capture: Capture,
        claim_check_store: PayloadStore | None,
        relays: Relays,
        tenant: str | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        #: The payload stages (encryption, claim-check) ``publish`` seals messages with.
        self.payloads = payloads
        #: Sessions of the units of work that open their own.
        self.session_factory = session_factory
        #: The outbox's brokers (shared: a test harness may swap them).
        self._brokers = brokers
        self.capture = capture
        self.claim_check_store = claim_check_store
        #: The relays a commit wakes (and the NOTIFY that wakes other processes').
        self.relays = relays
        #: The tenant of a multi-tenant outbox this write side serves (its messages carry
        #: it in the ``tenant`` header), else None.
        self.tenant = tenant

    @property
    def external_brokers(self) -> Mapping[str, Broker]:
        """The external brokers by name: an ``external=True`` event gets a row for each."""
        return self._brokers.external_brokers

    def resolve_broker(self, name: str | None) -> str:
        """The internal broker a message goes to (``None``: the default one);
        [`UnknownBroker`][fastapi_outbox.UnknownBroker] for a name it does not know."""
        brokers = self._brokers
        return resolve_broker(
            name, brokers.brokers, brokers.external_brokers, brokers.default_broker
        )

    def trace_headers(self, traceparent: str | None) -> dict[str, str]:
        """W3C trace context to store with a message: the active OpenTelemetry span's when
        there is one, else the request's ``traceparent``."""
        return tracing.current_trace_headers(traceparent)

    def write_rows(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Record outbox rows on a session's connection, through the capture (called by the
        session's ``before_commit``: `fastapi_outbox.write.session_events`; sync API,
        inside SQLAlchemy's greenlet)."""
        put_claims(self.claim_check_store, connection, rows)
        self.capture.write(connection, rows)
