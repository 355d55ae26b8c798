"""The read/act port of ``ops/``: what operations, health, metrics and the dashboard read
from an outbox and do to it, and nothing more.

``ops/`` never sees [`Outbox`][fastapi_outbox.Outbox]; it is typed against
`OutboxPort`, which has two sides, each satisfying it structurally (no inheritance, no
registration): ``Outbox`` itself, and `TenantOutbox`, the outbox of the tenant a
multi-tenant dashboard serves in this context (every page and action on that tenant's
database only). ``ops/`` is below the composition root, so the port names which of the
outbox's attributes it reads, each by the concrete type of the part below ``ops/`` that
holds it. Conformance is checked by ``mypy --strict`` wherever typed code hands either side
to ``ops/`` (``Outbox.health_router``, ``Outbox.dashboard_router``, ``Outbox.cancel``, the
CLI, the tenant dashboard).

What the port holds, by what ``ops/`` does with it:

* reads: the settings, the brokers' names, whether the relays run here
  (`Lifecycle`), the relays' state and the
  LISTEN connection (`Relays`), the replication slot,
  the subscribers, the instrumentation (metrics) and the dashboard's guard (health's
  detail) — the parts below ``ops/`` by their own types;
* the storage itself, by its own types (each has one implementation, so no protocol
  restates it): the outbox table's operator reads and actions
  (`Messages`, as ``store.messages``) and retention
  (``store.retention``), the archive table of ``archive=True``
  (`Archive`) and the inbox's per-group figures
  (`Inbox`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from fastapi_outbox.consume.subscriber import Subscriber
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.lifecycle.supervisor import Lifecycle
from fastapi_outbox.lifecycle.tenants import Tenants
from fastapi_outbox.payloads import Payloads
from fastapi_outbox.relay.relays import Relays
from fastapi_outbox.relay.table import TableRelay
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.archive import Archive
from fastapi_outbox.storage.inbox import Inbox
from fastapi_outbox.storage.probe import DatabaseProbe
from fastapi_outbox.storage.store import Store
from fastapi_outbox.storage.wal_slot import WalSlot


@runtime_checkable
class OutboxPort(Protocol):
    """An outbox as ``ops/`` sees it: ``Outbox`` satisfies it structurally."""

    @property
    def settings(self) -> OutboxSettings: ...
    @property
    def store(self) -> Store:
        """The outbox table: ``ops/`` reads and acts through ``store.messages``."""
        ...

    @property
    def payloads(self) -> Payloads:
        """The payload stages: what ``show`` can read of an encrypted payload."""
        ...

    @property
    def inbox(self) -> Inbox: ...
    @property
    def archive(self) -> Archive | None:
        """The archive table (``archive=True``), else None."""
        ...

    @property
    def all_brokers(self) -> Mapping[str, object]:
        """Every broker by name, internal and external, in the order configured."""
        ...

    @property
    def external_brokers(self) -> Mapping[str, object]: ...
    @property
    def lifecycle(self) -> Lifecycle:
        """``lifecycle.started``: the relays and subscribers run in this process."""
        ...

    @property
    def relays(self) -> Relays:
        """The relays of this process: the table relays by broker (``tables``), the WAL
        relay, the LISTEN connection."""
        ...

    @property
    def wal_slot(self) -> WalSlot | None: ...

    @property
    def tenants(self) -> Tenants | None:
        """A multi-tenant outbox's tenants (their outboxes, the relay of all), else None."""
        ...

    @property
    def subscribers(self) -> Sequence[Subscriber]: ...
    @property
    def instrumentation(self) -> Instrumentation: ...
    @property
    def dashboard_dependencies(self) -> Sequence[Any] | None:
        """The dashboard's guard (None: none given; ``[]``: unguarded on purpose)."""
        ...

    @property
    def database_probe(self) -> DatabaseProbe:
        """Health's own connection to the database and its look at the application's pool."""
        ...


class TenantOutbox:
    """The port's other side: the outbox of the tenant chosen for this context (the
    dashboard's ``/t/{tenant}`` pages, by a context variable), so every read and action of
    ``ops/`` goes to that tenant's database only. The settings are the multi-tenant
    outbox's own (the dashboard's options); a tenant's view has no tenants of its own."""

    def __init__(
        self, tenants: Tenants, settings: OutboxSettings, tenant: Callable[[], str | None]
    ) -> None:
        self._tenants = tenants
        self._settings = settings
        self._tenant = tenant

    def _current(self) -> OutboxPort:
        outbox: OutboxPort = self._tenants.get(self._tenant())
        return outbox

    @property
    def settings(self) -> OutboxSettings:
        return self._settings

    @property
    def store(self) -> Store:
        return self._current().store

    @property
    def payloads(self) -> Payloads:
        return self._current().payloads

    @property
    def inbox(self) -> Inbox:
        return self._current().inbox

    @property
    def archive(self) -> Archive | None:
        return self._current().archive

    @property
    def all_brokers(self) -> Mapping[str, object]:
        return self._current().all_brokers

    @property
    def external_brokers(self) -> Mapping[str, object]:
        return self._current().external_brokers

    @property
    def lifecycle(self) -> Lifecycle:
        return self._current().lifecycle

    @property
    def relays(self) -> Relays:
        return self._current().relays

    @property
    def wal_slot(self) -> WalSlot | None:
        return self._current().wal_slot

    @property
    def tenants(self) -> Tenants | None:
        return None

    @property
    def subscribers(self) -> Sequence[Subscriber]:
        return self._current().subscribers

    @property
    def instrumentation(self) -> Instrumentation:
        return self._current().instrumentation

    @property
    def dashboard_dependencies(self) -> Sequence[Any] | None:
        return self._current().dashboard_dependencies

    @property
    def database_probe(self) -> DatabaseProbe:
        return self._current().database_probe


def relay_here(outbox: OutboxPort, broker: str) -> TableRelay | None:
    """The table relay of ``broker`` in this process (None when the relays do not run
    here, or when it has none)."""
    return outbox.relays.tables.get(broker) if outbox.lifecycle.started else None


def wall_time(seconds: float | None) -> dt.datetime | None:
    """A state's wall-clock time (``time.time()`` seconds) as a UTC datetime."""
    return None if seconds is None else dt.datetime.fromtimestamp(seconds, dt.UTC)


def tenants_of(outbox: OutboxPort) -> Tenants | None:
    """A multi-tenant outbox's tenants, else None (an object standing in for an outbox
    that does not say is a single-tenant one)."""
    tenants: Tenants | None = getattr(outbox, "tenants", None)
    return tenants
