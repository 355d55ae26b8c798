"""One relay for every tenant of a multi-tenant outbox: fair turns within a connection budget.

A multi-tenant outbox keeps each tenant's outbox table in the tenant's own database (or
schema). Rather than a relay and a pool per tenant, `TenantRelay` runs
workers (half of ``tenant_connection_budget``) that take *turns*: a turn is one tenant and one
broker — one claim and, when it found rows, one publish and one mark, by the same code as
a table relay's worker (`TableRelay`, one per tenant and
broker, whose own loop never runs here).

- **Fair.** Turns are handed out round-robin: a tenant whose claim came back with rows
  goes to the back of the queue, so a quiet tenant's message waits at most one batch of
  each busier tenant ahead of it, never their whole backlog; a tenant is never in the
  queue twice.
- **Idle tenants cost a probe per poll interval.** A tenant whose claim came back empty
  is looked at again after ``poll_interval_seconds`` (or when a commit of this process
  wakes it, or a delayed message of it is due); it holds no connection meanwhile.
- **Connections are bounded.** ``tenant_connection_budget`` is shared: half of it are
  the workers (turns at once, a connection each), the other half the tenants with the
  most recent turns, whose pools stay open between turns; the others' idle connections
  are closed after their turn. The relay holds at most the budget.
- **A tenant's failure is its own.** A claim or a mark that fails (the database down,
  slow, or without its tables) pauses that tenant alone with exponential backoff; its
  state (``database_ok``, ``last_error``) is what the health endpoint reports for it.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from itertools import count
from typing import Any

import anyio

from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.log import safe_error
from fastapi_outbox.relay.loop import DB_BACKOFF_MAX_SECONDS, DB_BACKOFF_MIN_SECONDS
from fastapi_outbox.relay.table import TableRelay
from fastapi_outbox.relay.wakeups import Wakeup
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.claims import Claims

__all__ = ["TenantRelay", "TenantTurns"]

logger = logging.getLogger("fastapi_outbox.relay")

#: One turn in this many is an idle tenant's probe when turns with work are waiting.
PROBE_EVERY = 4

#: A turn's key: (tenant, broker).
Key = tuple[str, str]


class _TurnWakeup(Wakeup):
    """A commit of this process woke one tenant's relay: its turn is queued at once."""

    def __init__(self, wake: Callable[[], None]) -> None:
        super().__init__()
        self._wake = wake

    @property
    def idle_waiters(self) -> int:
        return 1  # the turn is queued now: the commit needs no NOTIFY for this process

    def set(self) -> bool:
        self._wake()
        return True


class TenantTurns(TableRelay):
    """One tenant's relay to one broker, run a turn at a time by `TenantRelay`
    (never by its own workers)."""

    def __init__(self, relay: TenantRelay, tenant: str, **options: Any) -> None:
        super().__init__(**options)
        self.tenant = tenant
        self._relay = relay
        self.wakeup = _TurnWakeup(lambda: relay.wake(tenant, self.broker_name))
        #: When the next turn may run (monotonic); None: whenever it is queued.
        self.next_turn: float | None = None
        self.db_delay = DB_BACKOFF_MIN_SECONDS
        self.claim_size = self.settings.batch_size
        #: Waiting in the relay's queue of turns with work (woken, or rows left) / of
        #: idle probes.
        self.in_ready = False
        self.in_probes = False
        self.in_flight = False
        #: A commit woke it while its turn ran (that claim may have missed its rows): it
        #: goes back to the queue of work when the turn ends.
        self.rewake = False
        #: The last turn's failure (the database down, or a statement failing on it: a
        #: missing table), None once a claim answers again.
        self.failing: str | None = None

    def __repr__(self) -> str:
        return f"TenantTurns(tenant={self.tenant!r}, broker={self.broker_name!r})"

    def _adapt_claim(self, got: int, asked: int) -> None:
        """A tenant's turn always claims ``batch_size``: its turns are one at a time, so
        a small claim would only cost it more turns (and connections) for its rows."""
        self.claim_size = self.settings.batch_size

    @property
    def stopping(self) -> bool:
        return self._relay.stopping

    def schedule(self, delay_seconds: float) -> None:
        due = time.monotonic() + delay_seconds
        if self.next_turn is None or due < self.next_turn:
            self.next_turn = due
        self._relay.signal()


class TenantRelay:
    """The relay of every tenant of a multi-tenant outbox (module docstring)."""

    def __init__(
        self,
        *,
        settings: OutboxSettings,
        instance: str,
        instrumentation: Instrumentation,
    ) -> None:
        self.settings = settings
        self.instance = instance
        self.instrumentation = instrumentation
        #: The turns of each (tenant, broker).
        self.turns: dict[Key, TenantTurns] = {}
        #: Each tenant's claims (its outbox table) and what closes its idle connections.
        self._tenants: dict[
            str, tuple[Claims, Callable[[], Awaitable[None]], dict[str, TableRelay]]
        ] = {}
        self._brokers: dict[str, Broker] = {}
        #: Turns with work (a commit woke them, or their last claim came back full) go
        #: before the idle tenants' probes: a probe is taken first only every
        #: ``PROBE_EVERY`` turns, so 200 idle tenants cannot delay a woken one.
        self._ready: collections.deque[Key] = collections.deque()
        self._probes: collections.deque[Key] = collections.deque()
        self._taken = 0
        self._signal = anyio.Event()
        #: Tenants in the order of their last turn (the last: the most recent).
        self._warm: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: Tenants whose pool is being closed: no turn of theirs starts meanwhile (a
        #: connection taken from a pool while it is closed would never be closed).
        self._cooling: set[str] = set()
        self._tokens = count(1)
        self._stopping = False
        self.running = False
        self.stopped: anyio.Event | None = None

    def __repr__(self) -> str:
        return f"TenantRelay(tenants={len(self._tenants)})"

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def workers(self) -> int:
        """Turns at once: half the connection budget (at least one); the other half keeps
        the pools of the most recently active tenants open between their turns."""
        return max(1, self.settings.tenant_connection_budget // 2)

    @property
    def tenants(self) -> list[str]:
        return list(self._tenants)

    # -- tenants -----------------------------------------------------------------------------

    def add_tenant(
        self,
        tenant: str,
        claims: Claims,
        close_idle: Callable[[], Awaitable[None]],
        tables: dict[str, TableRelay],
    ) -> None:
        """Relay ``tenant``'s outbox table from now on. ``tables`` (the tenant's
        ``Relays.tables``) gets its turns by broker: the wake-ups its commits send."""
        self._tenants[tenant] = (claims, close_idle, tables)
        for broker in self._brokers:
            self._turns_for(tenant, broker)

    def remove_tenant(self, tenant: str) -> None:
        """Stop relaying ``tenant`` (a turn in flight finishes)."""
        entry = self._tenants.pop(tenant, None)
        if entry is not None:
            entry[2].clear()
        self._warm.pop(tenant, None)
        for key in [k for k in self.turns if k[0] == tenant]:
            del self.turns[key]

    def _turns_for(self, tenant: str, broker: str) -> TenantTurns:
        key = (tenant, broker)
        turns = self.turns.get(key)
        if turns is None:
            claims, _, tables = self._tenants[tenant]
            turns = TenantTurns(
                self,
                tenant,
                store=claims,
                broker_name=broker,
                broker=self._brokers[broker],
                settings=self.settings,
                instance=self.instance,
                instrumentation=self.instrumentation,
            )
            self.turns[key] = turns
            tables[broker] = turns
            self._queue(key, probe=True)
        return turns

    def wake(self, tenant: str, broker: str) -> None:
        """A commit of this process wrote rows of ``tenant`` for ``broker``."""
        turns = self.turns.get((tenant, broker))
        if turns is not None:
            turns.next_turn = None
            if turns.in_flight:
                turns.rewake = True
            self._queue((tenant, broker))

    def _queue(self, key: Key, *, probe: bool = False) -> None:
        turns = self.turns.get(key)
        if turns is None or turns.in_flight or turns.in_ready:
            return
        if probe:
            if turns.in_probes:
                return
            turns.in_probes = True
            self._probes.append(key)
        else:
            turns.in_ready = True  # a probe queued before stays, and is skipped once taken
            self._ready.append(key)
        self.signal()

    def signal(self) -> None:
        """Wake every idle worker (each looks for a turn again)."""
        signal, self._signal = self._signal, anyio.Event()
        signal.set()

    # -- running -----------------------------------------------------------------------------

    def start_brokers(self, brokers: Mapping[str, Broker]) -> None:
        """Publish with ``brokers`` (every tenant's turns for each)."""
        self._brokers = dict(brokers)
        for tenant in self._tenants:
            for broker in self._brokers:
                self._turns_for(tenant, broker)

    def stop(self) -> None:
        self._stopping = True
        self.signal()

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Run `workers` workers until `stop` (or cancellation)."""
        self.running = True
        self.stopped = anyio.Event()
        self._stopping = False
        self._ready.clear()  # a run before this one may have left turns queued
        self._probes.clear()
        for key, turns in self.turns.items():
            turns.in_ready = turns.in_probes = turns.in_flight = False
            turns.next_turn = None
            self._queue(key, probe=True)
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.workers):
                    tg.start_soon(self._worker)
                task_status.started()
        finally:
            self.running = False
            self.stopped.set()
            logger.info("tenant relay stopped", extra={"action": "relay.stop"})

    async def _next(self) -> TenantTurns | None:
        """The next turn due, in queue order; waits for one (None: stopping)."""
        while not self._stopping:
            signal = self._signal  # before the scan: a wake-up during it is not lost
            now = time.monotonic()
            soonest: float | None = None
            for key, turns in self.turns.items():
                due = turns.next_turn
                if due is None or turns.in_ready or turns.in_probes or turns.in_flight:
                    continue
                if due <= now:
                    turns.next_turn = None
                    self._queue(key, probe=not turns.rewake)
                    turns.rewake = False
                elif soonest is None or due < soonest:
                    soonest = due
            taken = self._take(now)
            if taken is not None:
                return taken
            with anyio.move_on_after(None if soonest is None else soonest - now):
                await signal.wait()
        return None

    def _take(self, now: float) -> TenantTurns | None:
        """The next turn of the queues: work first, a probe every ``PROBE_EVERY`` turns."""
        self._taken += 1
        first, second = self._ready, self._probes
        if self._taken % PROBE_EVERY == 0:
            first, second = second, first
        for queue in (first, second):
            while queue:
                taken = self.turns.get(queue.popleft())
                if taken is None:
                    continue
                if queue is self._ready:
                    if not taken.in_ready:
                        continue
                elif not taken.in_probes or taken.in_ready:
                    continue  # taken already, or waiting in the queue of work
                taken.in_ready = taken.in_probes = False
                if taken.next_turn is not None and taken.next_turn > now:
                    continue  # paused meanwhile (an outage): its time brings it back
                if taken.tenant in self._cooling:
                    # Its turn comes once its pool is closed, in the queue it was in.
                    taken.next_turn = now
                    taken.rewake = taken.rewake or queue is self._ready
                    continue
                taken.in_flight = True
                return taken
        return None

    async def _worker(self) -> None:
        while True:
            turns = await self._next()
            if turns is None:
                return
            try:
                await self._turn(turns)
            finally:
                turns.in_flight = False
                if turns.rewake:
                    turns.rewake = False
                    turns.next_turn = None
                    self._queue((turns.tenant, turns.broker_name))
            await self._cool(turns.tenant)

    async def _turn(self, turns: TenantTurns) -> None:
        """One claim of ``turns``' tenant and broker; its rows published and marked."""
        settings = self.settings
        now = time.monotonic()
        if turns._paused_until > now:  # its broker is down: back when the pause ends
            turns.next_turn = turns._paused_until
            return
        try:
            await turns._ensure_broker()
        except Exception as exc:
            turns._broker_down(turns.broker_name, exc)
            turns.next_turn = turns._paused_until
            return
        token = f"{self.instance}:t:{next(self._tokens)}"
        size = turns.claim_size
        try:
            with anyio.fail_after(turns._db_bound):
                batch = await turns.store.claim(
                    turns.broker_name, size, token, settings.lease_seconds, ordered=settings.ordered
                )
        except Exception as exc:
            turns._database_failed(
                exc,
                turns.store.engine.dialect.name,
                "tenant database unavailable; its relay pauses with backoff",
                action="claim.failed",
                broker=turns.broker_name,
                tenant=turns.tenant,
            )
            turns.failing = safe_error(exc)
            turns.next_turn = time.monotonic() + turns.db_delay
            turns.db_delay = min(turns.db_delay * 2, DB_BACKOFF_MAX_SECONDS)
            return
        turns.db_delay = DB_BACKOFF_MIN_SECONDS
        turns.failing = None
        turns._claimed(len(batch), size)
        if not batch:
            if turns.next_turn is None:
                turns.next_turn = time.monotonic() + settings.poll_interval_seconds
            return
        before = turns.db_delay
        turns.db_delay = await turns._take(batch, token, size, before)
        if turns.db_delay > before:  # the outcome could not be recorded: the tenant pauses
            turns.next_turn = time.monotonic() + turns.db_delay
        elif len(batch) < size:  # drained: looked at again by its probe (or a commit)
            if turns.next_turn is None:
                turns.next_turn = time.monotonic() + settings.poll_interval_seconds
        else:
            turns.next_turn = None
            turns.in_flight = False
            self._queue((turns.tenant, turns.broker_name))  # back of the queue
            turns.in_flight = True

    async def _cool(self, tenant: str) -> None:
        """``tenant`` had a turn: it is the most recent; the pools of tenants beyond the
        connection budget are closed (none of their turns in flight)."""
        if tenant not in self._tenants:
            return
        self._warm[tenant] = None
        self._warm.move_to_end(tenant)
        budget = self.settings.tenant_connection_budget - self.workers
        if len(self._warm) <= budget:
            return
        busy = {key[0] for key, t in self.turns.items() if t.in_flight}
        for name in list(self._warm):
            if len(self._warm) <= budget:
                break
            if name in busy:
                continue
            entry = self._tenants.get(name)
            del self._warm[name]
            if entry is not None:
                self._cooling.add(name)
                try:
                    await entry[1]()
                except Exception:  # closing an idle pool is best effort
                    logger.debug("closing an idle tenant pool failed", exc_info=True)
                finally:
                    self._cooling.discard(name)
                    self.signal()

    # -- health -------------------------------------------------------------------------------

    def status(self, tenant: str) -> dict[str, Any]:
        """What the health endpoint says of ``tenant``'s relay: ``ok``, the database's
        state and its last error, the last claim (wall clock), published counts."""
        turns = [t for key, t in self.turns.items() if key[0] == tenant]
        database_ok = all(t.database_ok and t.failing is None for t in turns)
        broker_ok = all(t.broker_ok for t in turns)
        errors = [t.failing or t.last_error for t in turns if t.failing or t.last_error]
        ticks = [t.last_tick for t in turns if t.last_tick is not None]
        return {
            "ok": database_ok and broker_ok,
            "database_ok": database_ok,
            "broker_ok": broker_ok,
            "last_error": errors[0] if errors and not (database_ok and broker_ok) else None,
            "last_claim": max(ticks) if ticks else None,
            "published_total": sum(t.published_total for t in turns),
        }
