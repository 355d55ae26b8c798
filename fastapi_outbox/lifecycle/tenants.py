"""The tenants of a multi-tenant outbox: who they are, and their outboxes in this process.

``Outbox(..., tenants=...)`` takes a mapping from tenant id to the tenant's database URL
(a database per tenant) or schema (a schema per tenant of the outbox's database), or a
callable — sync or async — returning that mapping. `Tenants` builds a tenant's
outbox (engine, tables, write side: an ``Outbox`` of its own that runs nothing) when the
tenant first appears, hands its outbox table to the one
`TenantRelay`, and, for a callable, reads it again
every ``tenant_refresh_seconds`` (`run`): a new tenant is served and relayed
from that read on, a removed one is no longer served and its engine is closed.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.lifecycle.retention import Cleaner
from fastapi_outbox.log import safe_error
from fastapi_outbox.relay.relays import Relays
from fastapi_outbox.relay.table import TableRelay
from fastapi_outbox.relay.tenants import TenantRelay
from fastapi_outbox.storage.claims import Claims
from fastapi_outbox.storage.tenant_schema import close_idle

__all__ = ["TenantCleaner", "TenantOutbox", "TenantRelays", "TenantSource", "Tenants"]

logger = logging.getLogger("fastapi_outbox.lifecycle")

#: What ``Outbox(tenants=...)`` takes: tenant id → database URL or schema, or a callable
#: (sync or async) returning that mapping.
TenantSource = (
    Mapping[str, str] | Callable[[], Mapping[str, str]] | Callable[[], Awaitable[Mapping[str, str]]]
)


class _Store(Protocol):
    @property
    def claims(self) -> Claims: ...


class _Relays(Protocol):
    tables: dict[str, TableRelay]


class TenantOutbox(Protocol):
    """What `Tenants` needs of a tenant's outbox (an ``Outbox`` that runs nothing)."""

    @property
    def store(self) -> _Store: ...

    @property
    def relays(self) -> _Relays: ...

    async def aclose(self) -> None: ...


class Tenants:
    """The tenants of one multi-tenant outbox (module docstring)."""

    def __init__(
        self,
        source: TenantSource,
        *,
        build: Callable[[str, str], Any],
        relay: TenantRelay,
        refresh_seconds: float,
    ) -> None:
        self._source = source
        self._build = build
        self.relay = relay
        self.refresh_seconds = refresh_seconds
        #: Each tenant's target (URL or schema) and outbox.
        self.targets: dict[str, str] = {}
        self.outboxes: dict[str, Any] = {}
        self.loaded = False
        #: The last read of the callable that failed (None: the last one answered).
        self.last_error: str | None = None
        self._stopping = anyio.Event()
        self.running = False
        self.stopped: anyio.Event | None = None
        if isinstance(source, Mapping):
            self.apply(source)
        elif not inspect.iscoroutinefunction(source):
            self.apply(self._checked(source()))

    def __len__(self) -> int:
        return len(self.outboxes)

    @property
    def names(self) -> list[str]:
        return sorted(self.outboxes)

    def get(self, tenant: str | None) -> Any:
        """The outbox of ``tenant``; `UnknownTenant` for
        a tenant this outbox does not serve (or none)."""
        if tenant is None:
            raise exceptions.UnknownTenant(
                "this outbox serves tenants: name one (outbox.unit_of_work(tenant=...), "
                "the tenant dependency of a request, --tenant on the command line)"
            )
        outbox = self.outboxes.get(tenant)
        if outbox is None:
            raise exceptions.UnknownTenant(f"unknown tenant {tenant!r}")
        return outbox

    # -- reading the tenants -------------------------------------------------------------------

    @staticmethod
    def _checked(mapping: Any) -> dict[str, str]:
        if not isinstance(mapping, Mapping):
            raise exceptions.ConfigurationError(
                f"tenants: expected a mapping of tenant id to URL or schema, got "
                f"{type(mapping).__name__}"
            )
        checked: dict[str, str] = {}
        for name, target in mapping.items():
            if not isinstance(name, str) or not name or not isinstance(target, str):
                raise exceptions.ConfigurationError(
                    f"tenants: {name!r} → {type(target).__name__}: tenant ids and their "
                    "database URL or schema are non-empty strings"
                )
            checked[name] = target
        return checked

    def apply(self, mapping: Mapping[str, str]) -> tuple[list[str], list[Any]]:
        """Serve exactly the tenants of ``mapping``: build the new ones (and a tenant whose
        target changed); returns the tenants added and the outboxes no longer served (for
        the caller to close)."""
        added: list[str] = []
        gone: list[Any] = []
        for name in list(self.outboxes):
            if mapping.get(name) != self.targets[name]:
                self.relay.remove_tenant(name)
                gone.append(self.outboxes.pop(name))
                del self.targets[name]
        for name, target in mapping.items():
            if name in self.outboxes:
                continue
            outbox = self._build(name, target)
            self.outboxes[name] = outbox
            self.targets[name] = target
            self.relay.add_tenant(
                name,
                outbox.store.claims,
                functools.partial(close_idle, outbox.engine),
                outbox.relays.tables,
            )
            added.append(name)
        self.loaded = True
        return added, gone

    async def refresh(self) -> list[str]:
        """Read the tenants again (a callable source); returns the tenants added. A read
        that fails keeps the tenants as they were (logged, and kept for health)."""
        source = self._source
        if isinstance(source, Mapping):
            return []
        try:
            result = source()
            if inspect.isawaitable(result):
                result = await result
            mapping = self._checked(result)
        except Exception as exc:
            self.last_error = f"reading the tenants failed: {safe_error(exc)}"
            logger.warning(
                "reading the tenants failed; keeping the last ones",
                extra={"action": "tenants.refresh_failed", "error": self.last_error},
            )
            if not self.loaded:
                raise
            return []
        self.last_error = None
        added, gone = self.apply(mapping)
        for outbox in gone:
            await self._close(outbox)
        if added or gone:
            logger.info(
                "tenants changed",
                extra={"action": "tenants.changed", "added": added, "removed": len(gone)},
            )
        return added

    async def ensure_loaded(self) -> None:
        """An async callable is read the first time the tenants are needed."""
        if not self.loaded:
            await self.refresh()

    async def rest(self, name: str) -> None:
        """Close the idle connections of ``name``'s pool (after an operation that went
        through every tenant: 200 tenants must not keep 200 connections)."""
        outbox = self.outboxes.get(name)
        if outbox is not None:
            await close_idle(outbox.engine)

    async def _close(self, outbox: Any) -> None:
        try:
            await outbox.aclose()
        except Exception:
            logger.warning("closing a removed tenant failed", exc_info=True)

    async def aclose(self) -> None:
        for outbox in self.outboxes.values():
            await self._close(outbox)

    # -- the refresh loop (a service of the lifecycle) -----------------------------------------

    def stop(self) -> None:
        self._stopping.set()

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Read a callable source every ``refresh_seconds`` until stopped."""
        self.running = True
        self.stopped = anyio.Event()
        task_status.started()
        try:
            if isinstance(self._source, Mapping):
                await self._stopping.wait()
                return
            while not self._stopping.is_set():
                with anyio.move_on_after(self.refresh_seconds):
                    await self._stopping.wait()
                if not self._stopping.is_set():
                    await self.refresh()
        finally:
            self.running = False
            self.stopped.set()


class TenantRelays(Relays):
    """What a multi-tenant outbox's lifecycle starts in place of a relay per broker: the
    tenants' refresh loop and the one `TenantRelay`
    of every tenant (no NOTIFY/LISTEN: commits of this process wake their tenant's turn,
    other processes' commits are found by the poll)."""

    def __init__(self, tenants: Tenants, **options: Any) -> None:
        super().__init__(**options)
        self.tenants = tenants

    @property
    def _notifies(self) -> bool:
        return False

    async def start(
        self, start: Callable[[Any], Awaitable[None]], brokers: Callable[[], Awaitable[Any]]
    ) -> None:
        await self.tenants.ensure_loaded()
        publishing = await brokers()
        relay = self.tenants.relay
        relay.start_brokers(publishing)
        await start(self.tenants)
        await start(relay)


class TenantCleaner(Cleaner):
    """Retention of a multi-tenant outbox: each sweep runs every tenant's own cleaner
    (its outbox table, inbox, archive and partitions, in its database); a tenant whose
    database fails is logged and skipped, the others are swept."""

    def __init__(self, tenants: Tenants, like: Cleaner) -> None:
        super().__init__(
            like.store,
            like.settings,
            like.partitions,
            inbox=like.inbox,
            archive=like.archive,
            subscribers=like.subscribers,
        )
        self.tenants = tenants

    async def run_once(self) -> int:
        deleted = 0
        for name, outbox in list(self.tenants.outboxes.items()):
            try:
                deleted += await outbox.cleaner.run_once()
                await self.tenants.rest(name)
            except Exception as exc:
                logger.warning(
                    "retention cleanup failed for a tenant",
                    extra={"action": "retention.failed", "tenant": name, "error": safe_error(exc)},
                )
        self.deleted_total += deleted
        self.last_run = anyio.current_time()
        return deleted
