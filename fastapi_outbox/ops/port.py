"""The read/act port of ``ops/``: what operations, health, metrics and the dashboard read
from an outbox and do to it, and nothing more.

``ops/`` never sees :class:`~fastapi_outbox.outbox.Outbox`; it is typed against
:class:`OutboxPort`, which ``Outbox`` satisfies structurally (no inheritance, no
registration). Each member is a read-only property here, so the composition root may hold a
richer object (``dict[str, Processor]`` for ``Mapping[str, RelayState]``). Conformance is
checked twice: by ``mypy --strict`` wherever typed code hands an ``Outbox`` to ``ops/``
(``Outbox.health_router``, ``Outbox.dashboard_router``, ``Outbox.cancel``, the CLI), and at
run time by ``tests/unit/test_ops_port.py``, which holds each member of every protocol here
against the objects the outbox really builds (as pgqueuer's ``test_port_conformance.py``
does for its repository port).

What the port holds, by what ``ops/`` does with it:

* reads: the settings, the brokers' names, whether the dispatchers run here, each
  relay's state (:class:`RelayState`, :class:`WalRelayState`), the replication slot
  (:class:`SlotView`), the LISTEN connection (:class:`ListenerState`), each subscriber's
  state (:class:`SubscriberView`), the instrumentation (metrics) and the dashboard's guard
  (health's detail);
* the storage itself, by its own types (each has one implementation, so no protocol
  restates it): the outbox table's operator reads and actions
  (:class:`~fastapi_outbox.storage.messages.Messages`, as ``store.messages``) and retention
  (``store.retention``), the archive table of ``archive=True``
  (:class:`~fastapi_outbox.storage.archive.Archive`) and the inbox's per-group figures
  (:class:`~fastapi_outbox.storage.inbox.Inbox`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from fastapi_outbox.brokers.consumer import Consumer
from fastapi_outbox.consume.subscriber import SubscriberStats
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.payloads import Payloads
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.archive import Archive
from fastapi_outbox.storage.inbox import Inbox
from fastapi_outbox.storage.probe import DatabaseProbe
from fastapi_outbox.storage.store import Store
from fastapi_outbox.storage.wal_slot import SlotStats, Undecodable


class RelayState(Protocol):
    """A table relay (a ``Processor``) of this process, as health, metrics and the
    overview show it."""

    @property
    def running(self) -> bool: ...
    @property
    def broker_ok(self) -> bool: ...
    @property
    def broker_refusing(self) -> bool: ...
    @property
    def broker_authentication_failed(self) -> bool: ...
    @property
    def broker_down_since(self) -> float | None: ...
    @property
    def last_tick(self) -> float | None: ...
    @property
    def last_error(self) -> str | None: ...


class WalRelayState(Protocol):
    """The WAL relay of this process (``capture="wal"``), as health and metrics show it."""

    @property
    def running(self) -> bool: ...
    @property
    def leader(self) -> bool: ...
    @property
    def broker_ok(self) -> bool: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def last_relayed_at(self) -> float | None: ...
    @property
    def undecodable(self) -> Undecodable | None: ...
    @property
    def lag_seconds(self) -> float: ...
    @property
    def no_progress_seconds(self) -> float | None: ...
    @property
    def read_window_bytes(self) -> int: ...


class SlotView(Protocol):
    """The replication slot (``capture="wal"``): its name and ``pg_replication_slots``."""

    @property
    def name(self) -> str: ...

    async def stats(self) -> SlotStats | None: ...


class ListenerState(Protocol):
    """The LISTEN connection of this process's dispatchers."""

    @property
    def listening(self) -> bool: ...


class SubscriberView(Protocol):
    """A declared ``@outbox.subscriber``: what it consumes, its state in this process, and
    its consumer (for lag and dead letters, made on demand when it does not run here)."""

    @property
    def stream(self) -> str: ...
    @property
    def group(self) -> str: ...
    @property
    def broker_name(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def dead_letter(self) -> str: ...
    @property
    def running(self) -> bool: ...
    @property
    def broker_ok(self) -> bool | None: ...
    @property
    def stats(self) -> SubscriberStats: ...
    @property
    def dead_letters_unwritten(self) -> int: ...
    @property
    def consumer(self) -> Consumer | None: ...

    def make_consumer(self) -> Consumer: ...


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
    def started(self) -> bool:
        """The dispatchers (relays, subscribers) run in this process."""
        ...

    @property
    def processors(self) -> Mapping[str, RelayState]:
        """The table relays of this process by broker (while ``started``)."""
        ...

    @property
    def wal_slot(self) -> SlotView | None: ...
    @property
    def wal_relay(self) -> WalRelayState | None: ...
    @property
    def listener(self) -> ListenerState | None: ...
    @property
    def subscribers(self) -> Sequence[SubscriberView]: ...
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


def relay_here(outbox: OutboxPort, broker: str) -> RelayState | None:
    """The table relay of ``broker`` in this process (None when the dispatchers do not run
    here, or when it has none)."""
    return outbox.processors.get(broker) if outbox.started else None


def wall_time(seconds: float | None) -> dt.datetime | None:
    """A state's wall-clock time (``time.time()`` seconds) as a UTC datetime."""
    return None if seconds is None else dt.datetime.fromtimestamp(seconds, dt.UTC)
