"""``GET /outbox/health``: is the outbox moving?

The body says ``ok``, ``degraded`` or ``down`` and, per relay, whether it runs, when it
last claimed, its counts and how long the longest-waiting due message has waited. HTTP 503
when ``down`` — only for what a restart of *this* process can cure: the database cannot be
reached, a relay of this process has died, or a due message has waited longer than
``health_max_pending_age_seconds`` for a relay of this process that could take it (its
broker reachable). ``degraded`` (HTTP 200): a broker is unreachable or refusing messages
(with how long), messages are failing or abandoned, or messages wait too long in a process
that runs no relay for them (an API-only process: restarting it would cure nothing).
Counts come from the partial indexes and are cached for ``health_cache_seconds``; when
the database cannot be reached they are
``null`` (unknown), and the check gives up after ``HEALTH_TIMEOUT_SECONDS`` so a database
that hangs makes the endpoint answer 503, not hang. The body holds no payloads and no
credentials: errors are reduced to their type or passed through ``log.safe_error``.

Public body and detail: ``GET /outbox/health`` answers anyone, so its body
says the status and why in words that name no host, port, user name or credential: the
``last_error`` texts (a driver's error names the server it could not reach) and the
handlers' names are ``null`` there. ``GET /outbox/health/detail`` has them, behind the
dashboard's guard (``Outbox(..., dashboard_dependencies=[...])``); without a guard it is
refused (403). ``health_public_detail=True`` (``OUTBOX_HEALTH_PUBLIC_DETAIL``) puts the
detail in the public body, for a deployment whose health port only the operators reach.

Under load: one computation at a time per process, shared by every concurrent caller
(single flight) and kept for ``health_cache_seconds``, so a flood of anonymous requests
costs one set of queries per period. The counts are read on health's own connection
(`fastapi_outbox.storage.probe`), never queued behind the application's requests; a
pool whose connections are all held is reported ``database: "busy"`` (degraded, with the
wait), never ``down``.

Probes: ``GET /outbox/health/live`` (liveness) answers 503 only when this process cannot
make progress — a table relay, subscriber or WAL relay that should run here has stopped —
and does no I/O; ``GET /outbox/health/ready`` (readiness) is ``/outbox/health``: 503 when
the outbox is down, including an app that never entered ``outbox.lifespan`` while
``run_relays`` is on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Response
from pydantic import BaseModel, Field

from fastapi_outbox.consume.subscriber import ConsumerStatus
from fastapi_outbox.lifecycle.tenants import Tenants
from fastapi_outbox.ops import operations
from fastapi_outbox.ops.port import OutboxPort, relay_here, tenants_of, wall_time
from fastapi_outbox.redaction import redact
from fastapi_outbox.relay.wal import WalRelay
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage import clock
from fastapi_outbox.storage.db_outage import describe as describe_database_error
from fastapi_outbox.storage.probe import POOL_PROBE_SECONDS, DatabaseProbe, PoolUsage
from fastapi_outbox.storage.store import BrokerStats
from fastapi_outbox.storage.wal_slot import SlotStats, WalSlot, format_lsn

Status = Literal["ok", "degraded", "down"]

#: The counts are given up after this long: the endpoint then reports the database down.
#: They are read on health's own connection, so this never counts a wait for the pool.
HEALTH_TIMEOUT_SECONDS = 5.0

#: Why an outbox whose relays should run here is down when they were never started.
NOT_STARTED = (
    "the outbox was never started in this process: its relays and subscribers do "
    "not run. Start the app with FastAPI(lifespan=outbox.lifespan) or "
    "app.include_router(outbox.router); if they run in a separate `fastapi-outbox "
    "dispatch` process, set run_relays=False (OUTBOX_RUN_RELAYS=false) here"
)


class RelayHealth(BaseModel):
    """One (database, broker) relay."""

    broker: str
    external: bool = Field(description="Publishes to an external broker.")
    running: bool = Field(description="Its workers run in this process.")
    broker_available: bool | None = Field(description="None when not running here.")
    broker_down_since: dt.datetime | None = Field(
        default=None,
        description="Start of the current broker outage (unreachable or refusing), UTC.",
    )
    broker_down_seconds: float | None = Field(
        default=None, description="How long the broker has been down; None when it is up."
    )
    last_tick: dt.datetime | None = Field(description="Last successful claim (UTC).")
    pending: int | None = Field(description="None when the database cannot be reached.")
    processing: int | None
    failed: int | None
    abandoned: int | None
    oldest_pending_age_seconds: float | None = Field(
        description="How long the longest-waiting due pending message has waited for a "
        "relay (from its commit, or from when it was given back); None when none waits."
    )
    published_last_minute: int | None
    last_error: str | None = Field(
        default=None,
        description="Last error, without data or credentials; null in the public body "
        "(it can name a host): see /outbox/health/detail.",
    )


class WalHealth(BaseModel):
    """``capture="wal"``: the replication slot and its relay."""

    slot: str
    exists: bool | None = Field(description="None when the database cannot be reached.")
    wal_status: str | None = Field(
        default=None,
        description="pg_replication_slots.wal_status: reserved, extended, unreserved, or "
        "lost (invalidated by max_slot_wal_keep_size: messages were lost).",
    )
    lag_bytes: int | None = Field(
        default=None, description="WAL written since the slot's confirmed position."
    )
    retained_bytes: int | None = Field(
        default=None, description="WAL the slot keeps the server from recycling."
    )
    safe_wal_size: int | None = Field(
        default=None, description="Bytes of WAL left before max_slot_wal_keep_size bites."
    )
    relay_running: bool = Field(description="A WAL relay runs in this process.")
    reader_here: bool = Field(description="This process's relay holds the slot.")
    lag_seconds: float | None = Field(
        default=None,
        description="Age of the oldest message read from the slot and not yet confirmed "
        "(0 when caught up); None when the reader is in another process.",
    )
    last_relayed_at: dt.datetime | None = None
    broker_available: bool | None = None
    last_error: str | None = Field(
        default=None, description="Null in the public body: see /outbox/health/detail."
    )
    no_progress_seconds: float | None = Field(
        default=None,
        description="How long the reader here has neither moved the slot nor found it "
        "caught up; None when the reader is in another process.",
    )
    read_window_bytes: int | None = Field(
        default=None, description="WAL past the confirmed position the next read decodes."
    )
    undecodable_lsn: str | None = Field(
        default=None,
        description="LSN of a message of the outbox's prefix the reader cannot decode: it "
        "stopped there and relays nothing after it.",
    )
    undecodable_skip_to: str | None = Field(
        default=None,
        description="The end of that message's transaction: advancing the slot there skips "
        "it (its messages are dropped).",
    )


class PoolHealth(BaseModel):
    """The application's connection pool (health reads the counts on its own connection)."""

    in_use: int | None = Field(description="Connections of the pool checked out now.")
    capacity: int | None = Field(description="pool_size + max_overflow (None: unbounded).")
    wait_seconds: float | None = Field(
        description="How long health waited for a connection of the pool; None when none "
        "came within the bound (the pool is busy: requests queue for connections)."
    )


class TenantHealth(BaseModel):
    """One tenant of a multi-tenant outbox, as the relay of this process last found it."""

    tenant: str
    status: Literal["ok", "down", "unknown"] = Field(
        description="down: its database failed the relay's last claim (down, slow, or "
        "without its tables); unknown: no relay runs here."
    )
    last_claim: float | None = Field(
        default=None, description="Wall clock of the relay's last claim that answered."
    )
    published_total: int = 0
    last_error: str | None = None


class OutboxHealth(BaseModel):
    """Overall outbox health."""

    status: Status
    database: Literal["ok", "busy", "down"] = Field(
        description="down: health's own connection cannot reach it; busy: it answers, but "
        "the application's pool had no connection free (degraded, never down)."
    )
    pool: PoolHealth | None = Field(default=None, description="The application's pool.")
    relays_running: bool = Field(description="Relays run in this process.")
    reasons: list[str] = Field(default_factory=list, description="Why the status is not ok.")
    relays: list[RelayHealth] = Field(default_factory=list)
    wal: WalHealth | None = Field(default=None, description='capture="wal" only.')
    consumers: list[ConsumerStatus] = Field(
        default_factory=list, description="The subscribers' consumer groups."
    )
    listening: bool | None = Field(
        default=None,
        description="The relays of this process get other processes' commits by "
        "LISTEN (False: they poll every poll_interval_seconds until it is back, after a "
        "lost or silent connection); None when none listens here (no relays, SQLite, "
        "notify=False).",
    )
    tenants: list[TenantHealth] | None = Field(
        default=None, description="A multi-tenant outbox: each tenant (None: not one)."
    )

    def public(self) -> OutboxHealth:
        """This report without what may name a host, port, user or code path: every
        ``last_error`` and the handlers' names (the reasons never name them)."""
        wal = self.wal
        return self.model_copy(
            update={
                "relays": [p.model_copy(update={"last_error": None}) for p in self.relays],
                "wal": None if wal is None else wal.model_copy(update={"last_error": None}),
                "consumers": [
                    c.model_copy(update={"handler": None, "last_error": None})
                    for c in self.consumers
                ],
                "tenants": None
                if self.tenants is None
                else [t.model_copy(update={"last_error": None}) for t in self.tenants],
            }
        )


@dataclasses.dataclass(slots=True)
class _Findings:
    """What the checks found: the reasons, in the order found, and whether one makes the
    outbox down (503) or degraded."""

    reasons: list[str] = dataclasses.field(default_factory=list)
    down: bool = False
    degraded: bool = False

    def is_down(self, reason: str) -> None:
        self.down = True
        self.reasons.append(reason)

    def is_degraded(self, reason: str) -> None:
        self.degraded = True
        self.reasons.append(reason)

    @property
    def status(self) -> Status:
        return "down" if self.down else "degraded" if self.degraded else "ok"


async def compute_health(outbox: OutboxPort) -> OutboxHealth:
    tenants = tenants_of(outbox)
    if tenants is not None:
        return await _tenants_health(outbox, tenants)
    found = _Findings()
    if not outbox.lifecycle.started and outbox.settings.run_relays:
        found.is_down(NOT_STARTED)
    stats: dict[str, BrokerStats] = {}
    probe = outbox.database_probe
    try:
        with anyio.fail_after(HEALTH_TIMEOUT_SECONDS):
            stats = await probe.stats(outbox.all_brokers, ordered=outbox.settings.ordered)
        database_ok = True
    except Exception as exc:
        # The cause in our words only: a driver's message can quote the URL.
        found.is_down(describe_database_error(exc, outbox.store.engine.dialect.name))
        database_ok = False
    pool = await _pool_health(probe, found) if database_ok else None
    relays = [
        _processor_health(outbox, name, stats.get(name), found) for name in outbox.all_brokers
    ]
    wal = None
    if outbox.wal_slot is not None:
        wal = await _wal_health(outbox, outbox.wal_slot, found, database_ok)
    consumers = await _consumers_health(outbox, found)
    return OutboxHealth(
        consumers=consumers,
        status=found.status,
        database="down" if not database_ok else "busy" if pool is not None and pool.busy else "ok",
        pool=None
        if pool is None
        else PoolHealth(in_use=pool.in_use, capacity=pool.capacity, wait_seconds=pool.wait_seconds),
        relays_running=outbox.lifecycle.started,
        reasons=found.reasons,
        relays=relays,
        wal=wal,
        listening=None if outbox.relays.listener is None else outbox.relays.listener.listening,
    )


async def _tenants_health(outbox: OutboxPort, tenants: Tenants) -> OutboxHealth:
    """A multi-tenant outbox: each tenant as the relay found it. A tenant whose database
    fails is named and makes the outbox degraded (the others are relayed); every tenant
    failing makes it down."""
    found = _Findings()
    started = outbox.lifecycle.started
    if not started and outbox.settings.run_relays:
        found.is_down(NOT_STARTED)
    relay = tenants.relay
    if started and not relay.running:
        found.is_down("the tenant relay is not running")
    report = []
    for name in tenants.names:
        state = relay.status(name) if started else None
        status: Literal["ok", "down", "unknown"] = "unknown"
        if state is not None:
            status = "ok" if state["ok"] else "down"
        report.append(
            TenantHealth(
                tenant=name,
                status=status,
                last_claim=None if state is None else state["last_claim"],
                published_total=0 if state is None else state["published_total"],
                last_error=None if state is None else _redacted(state["last_error"]),
            )
        )
    down = [t.tenant for t in report if t.status == "down"]
    if down and len(down) == len(report):
        found.is_down(f"every tenant's database is failing ({len(down)})")
    elif down:
        found.is_degraded(f"tenants whose database is failing: {', '.join(down)}")
    if tenants.last_error is not None:
        found.is_degraded("the last read of the tenants failed (the previous ones are kept)")
    consumers = await _consumers_health(outbox, found)
    return OutboxHealth(
        status=found.status,
        database="down" if down and len(down) == len(report) else "ok",
        relays_running=started,
        reasons=found.reasons,
        consumers=consumers,
        tenants=report,
    )


async def _pool_health(probe: DatabaseProbe, found: _Findings) -> PoolUsage | None:
    """The application's pool: busy (degraded) when no connection came within the bound.
    None when the look itself failed (the counts were read: the database answers)."""
    try:
        usage = await probe.pool_usage()
    except Exception:
        return None
    if usage.busy:
        held = "" if usage.in_use is None else f"{usage.in_use} of {usage.capacity} in use; "
        found.is_degraded(
            f"database connection pool busy ({held}no connection free within "
            f"{POOL_PROBE_SECONDS:g}s): requests wait for connections; the database itself "
            "answers. Raise engine_options pool_size/max_overflow or shorten transactions"
        )
    return usage


def _processor_health(
    outbox: OutboxPort, name: str, s: BrokerStats | None, found: _Findings
) -> RelayHealth:
    """One broker's relay: down when it should run here and does not, or when a due
    message waits too long for it; degraded when its broker is down, messages fail or
    are abandoned, or keys are blocked. ``s``: its counts (None: database unreachable)."""
    p = relay_here(outbox, name)
    if outbox.lifecycle.started and (p is None or not p.running):
        found.is_down(f"relay {name!r} is not running")
    broker_down = p is not None and p.running and not p.broker_ok
    down_for: float | None = None
    if broker_down and p is not None:
        down_for = clock.wall() - (p.broker_down_since or clock.wall())
        what = (
            "authentication failed (check the user and password of its URL)"
            if p.broker_authentication_failed
            else "refusing messages"
            if p.broker_refusing
            else "unreachable"
        )
        found.is_degraded(f"broker {name!r} {what} for {down_for:.0f}s")
    age = s.oldest_pending_age_seconds if s else None
    if s is not None:
        _backlog_health(
            outbox, name, s, found, stuck_here=bool(p and p.running) and not broker_down
        )
    return RelayHealth(
        broker=name,
        external=name in outbox.external_brokers,
        running=bool(p and p.running),
        broker_available=None if p is None else p.broker_ok,
        broker_down_since=None if p is None else wall_time(p.broker_down_since),
        broker_down_seconds=None if down_for is None else round(down_for, 3),
        last_tick=None if p is None else wall_time(p.last_tick),
        pending=s.pending if s else None,
        processing=s.processing if s else None,
        failed=s.failed if s else None,
        abandoned=s.abandoned if s else None,
        oldest_pending_age_seconds=None if age is None else round(age, 3),
        published_last_minute=s.published_last_minute if s else None,
        last_error=_redacted(p.last_error) if p is not None else None,
    )


def _backlog_health(
    outbox: OutboxPort, name: str, s: BrokerStats, found: _Findings, *, stuck_here: bool
) -> None:
    """What the counts of one broker say. ``stuck_here``: a relay of this process
    runs for it with its broker up, so a message waiting too long is this process's fault
    (a restart cures it: down); otherwise (a broker outage, during which the relay
    pauses on purpose, or an API-only process's view of the table) it is degraded."""
    limit = outbox.settings.health_max_pending_age_seconds
    age = s.oldest_pending_age_seconds
    if age is not None and age > limit:
        reason = (
            f"a due message of {name!r} has waited {age:.0f}s "
            f"(> health_max_pending_age_seconds={limit:g})"
            + ("" if stuck_here else "; no relay here could take it")
        )
        if stuck_here:
            found.is_down(reason)
        else:
            found.is_degraded(reason)
    if s.abandoned:
        found.is_degraded(f"{s.abandoned} abandoned message(s) on {name!r}")
    if s.failed:
        found.is_degraded(f"{s.failed} failing message(s) on {name!r}")
    if s.blocked_keys:
        # Ordered dispatch: the later messages of such a key wait for an operator.
        found.is_degraded(
            f"{s.blocked_keys} key(s) of {name!r} blocked by an abandoned message "
            f"(first: {s.blocking_message}): replay it to publish the key in order, "
            "or purge it to go on without it"
        )


async def _wal_health(
    outbox: OutboxPort, slot: WalSlot, found: _Findings, database_ok: bool
) -> WalHealth:
    """The slot's health. Down: the slot is missing or was invalidated (messages lost: a
    restart cures nothing, but nothing must look fine), the relay of this process died,
    the reader here stopped before an undecodable message or has made no progress for
    longer than health_max_pending_age_seconds, or it is stuck; degraded: its broker is
    down, or the slot's WAL is about to exceed max_slot_wal_keep_size."""
    relay = outbox.relays.wal if outbox.lifecycle.started else None
    stats = None
    if database_ok:
        try:
            with anyio.fail_after(HEALTH_TIMEOUT_SECONDS):
                stats = await slot.stats()
        except Exception as exc:
            database_ok = False
            found.is_down(f"replication slot unreadable ({type(exc).__name__})")
    _slot_findings(slot.name, stats, found, database_ok)
    if outbox.lifecycle.started and (relay is None or not relay.running):
        found.is_down("the WAL relay is not running")
    reader = relay if relay is not None and relay.leader else None
    if reader is not None:
        _reader_findings(outbox.settings, slot.name, reader, stats, found)
    undecodable = None if reader is None else reader.undecodable
    return WalHealth(
        slot=slot.name,
        exists=None if not database_ok else stats is not None,
        wal_status=stats.wal_status if stats else None,
        lag_bytes=stats.lag_bytes if stats else None,
        retained_bytes=stats.retained_bytes if stats else None,
        safe_wal_size=stats.safe_wal_size if stats else None,
        relay_running=bool(relay and relay.running),
        reader_here=reader is not None,
        lag_seconds=None if reader is None else round(reader.lag_seconds, 3),
        last_relayed_at=None if relay is None else wall_time(relay.last_relayed_at),
        broker_available=None if relay is None else relay.broker_ok,
        last_error=None if relay is None else _redacted(relay.last_error),
        no_progress_seconds=_rounded(None if reader is None else reader.no_progress_seconds),
        read_window_bytes=None if reader is None else reader.read_window_bytes,
        undecodable_lsn=None if undecodable is None else format_lsn(undecodable.lsn),
        undecodable_skip_to=(
            None
            if undecodable is None or undecodable.end_lsn is None
            else format_lsn(undecodable.end_lsn)
        ),
    )


def _slot_findings(name: str, stats: SlotStats | None, found: _Findings, database_ok: bool) -> None:
    """What ``pg_replication_slots`` says of the slot (nothing when unread)."""
    if database_ok and stats is None:
        found.is_down(
            f"replication slot {name!r} does not exist: messages committed now are "
            "lost; run `fastapi-outbox db create` with capture='wal'"
        )
    elif stats is not None and stats.lost:
        found.is_down(
            f"replication slot {name!r} was invalidated (wal_status=lost: it retained "
            "more WAL than max_slot_wal_keep_size); messages it had not relayed are lost: "
            "drop and recreate it (`fastapi-outbox db drop-slot --force`, `db create`)"
        )
    elif stats is not None and stats.wal_status == "unreserved":
        found.is_degraded(
            f"replication slot {name!r} is about to be invalidated "
            "(wal_status=unreserved): its relay is far behind"
        )


def _reader_findings(
    settings: OutboxSettings,
    slot: str,
    reader: WalRelay,
    stats: SlotStats | None,
    found: _Findings,
) -> None:
    """What the reader of the slot in this process says of itself."""
    limit = settings.health_max_pending_age_seconds
    stalled = reader.no_progress_seconds
    if reader.undecodable is not None:
        found.is_down(reader.undecodable.describe(slot))
    elif not reader.broker_ok:
        found.is_degraded("WAL relay paused: broker down")
    elif stalled is not None and stalled > limit:
        behind = (
            f"{stats.lag_bytes} bytes behind"
            if stats is not None and stats.lag_bytes is not None
            else "lag unknown"
        )
        found.is_down(
            f"the WAL relay has made no progress for {stalled:.0f}s "
            f"(> health_max_pending_age_seconds={limit:g}; "
            f"slot {slot!r} {behind}): {reader.last_error or 'no error'}; a read "
            "must decode the WAL from the slot's restart_lsn within "
            f"wal_read_timeout_seconds={settings.wal_read_timeout_seconds:g}"
        )
    elif reader.lag_seconds > limit:
        found.is_down(
            f"the WAL relay's oldest unconfirmed message has waited "
            f"{reader.lag_seconds:.0f}s (> health_max_pending_age_seconds={limit:g})"
        )


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


async def _consumers_health(outbox: OutboxPort, found: _Findings) -> list[ConsumerStatus]:
    """A subscriber of this process that stopped running is down (a restart cures it); a
    paused one (broker unreachable) or dead letters waiting degrade the status."""
    if not outbox.subscribers:
        return []
    statuses = await operations.consumers(outbox)
    for c in statuses:
        c.last_error = _redacted(c.last_error)  # a handler's error text is the app's own
        where = f"consumer group {c.group!r} on {c.stream!r}"
        if outbox.lifecycle.started and not c.running:
            found.is_down(f"{where} is not running")
        elif c.running and c.broker_available is False:
            found.is_degraded(f"{where}: broker {c.broker!r} unavailable")
        if c.dead_letters_unwritten:
            found.is_degraded(
                f"{where}: {c.dead_letters_unwritten} message(s) could not be written to "
                f"{c.dead_letter_stream!r} (they stay pending; "
                f"{c.dead_letter_failures} failed write(s))"
            )
        if c.workers_replaced:
            found.is_degraded(
                f"{where}: {c.workers_replaced} handler task(s) failed outside the handler "
                "and were replaced (see the consumer.worker_replaced log records)"
            )
        if c.dead_letters:
            found.is_degraded(
                f"{c.dead_letters} dead letter(s) of {where} in {c.dead_letter_stream!r}"
            )
        if c.trimmed:
            found.is_degraded(
                f"{where}: {c.trimmed} entries trimmed from the stream (MAXLEN) before the "
                "group read them: lost to it; raise the broker's maxlen or drop it"
            )
    return statuses


def _redacted(text: str | None) -> str | None:
    """Even the detail: texts of drivers and handlers go through the one redaction."""
    return None if text is None else redact(text)


#: Why ``/outbox/health/detail`` refuses a process without a dashboard guard.
NO_GUARD = (
    "the health detail (errors naming hosts, handlers) is served behind the dashboard's "
    "guard: pass Outbox(..., dashboard_dependencies=[Depends(require_admin)]), or "
    "dashboard_dependencies=[] to serve it unguarded on purpose, or set "
    "health_public_detail=True (OUTBOX_HEALTH_PUBLIC_DETAIL) to put it in the public body"
)


class SingleFlight:
    """One computation at a time, shared by every caller that asks while it runs, and its
    result kept for ``ttl()`` seconds from when it finished. A caller that goes away (a
    client disconnects) does not cancel the computation the others wait for."""

    def __init__(self, compute: Callable[[], Awaitable[OutboxHealth]], ttl: Callable[[], float]):
        self._compute = compute
        self._ttl = ttl
        self._value: OutboxHealth | None = None
        self._at = 0.0
        self._task: asyncio.Task[OutboxHealth] | None = None

    async def get(self) -> OutboxHealth:
        if self._value is not None and time.monotonic() - self._at < self._ttl():
            return self._value
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return await asyncio.shield(self._task)

    async def _run(self) -> OutboxHealth:
        try:
            value = await self._compute()
            self._value, self._at = value, time.monotonic()
            return value
        finally:
            self._task = None


def liveness(outbox: OutboxPort) -> list[str]:
    """Why this process cannot make progress (empty: it can): a table relay, subscriber or
    WAL relay that should run here has stopped. In-process state only, no I/O: an outage of
    the database or a broker is not cured by a restart and never fails liveness."""
    if not outbox.lifecycle.started:
        return []
    tenants = tenants_of(outbox)
    if tenants is not None:
        running = tenants.relay.running
        reasons = [] if running else ["the tenant relay is not running"]
        return reasons + [
            f"consumer group {s.group!r} on {s.stream!r} is not running"
            for s in outbox.subscribers
            if not s.running
        ]
    reasons = [
        f"relay {name!r} is not running"
        for name in outbox.all_brokers
        if (p := relay_here(outbox, name)) is None or not p.running
    ]
    if outbox.wal_slot is not None and (outbox.relays.wal is None or not outbox.relays.wal.running):
        reasons.append("the WAL relay is not running")
    reasons += [
        f"consumer group {s.group!r} on {s.stream!r} is not running"
        for s in outbox.subscribers
        if not s.running
    ]
    return reasons


class Liveness(BaseModel):
    """``GET /outbox/health/live``."""

    status: Literal["ok", "down"]
    reasons: list[str] = Field(default_factory=list)


def build_health_router(outbox: OutboxPort) -> APIRouter:
    router = APIRouter(prefix="/outbox", tags=["outbox"])
    flight = SingleFlight(
        lambda: compute_health(outbox), lambda: outbox.settings.health_cache_seconds
    )
    current = flight.get

    @router.get(
        "/health",
        response_model=OutboxHealth,
        summary="Outbox health (readiness)",
        responses={503: {"model": OutboxHealth, "description": "The outbox is down."}},
    )
    async def outbox_health(response: Response) -> OutboxHealth:
        health = await current()
        if health.status == "down":
            response.status_code = 503
        return health if outbox.settings.health_public_detail else health.public()

    router.add_api_route(
        "/health/ready",
        outbox_health,
        methods=["GET"],
        response_model=OutboxHealth,
        summary="Readiness: the outbox is not down (same as /outbox/health)",
        responses={503: {"model": OutboxHealth, "description": "The outbox is down."}},
    )

    @router.get(
        "/health/live",
        response_model=Liveness,
        summary="Liveness: this process can make progress",
        responses={503: {"model": Liveness, "description": "A worker of this process died."}},
    )
    async def outbox_live(response: Response) -> Liveness:
        reasons = liveness(outbox)
        if reasons:
            response.status_code = 503
        return Liveness(status="down" if reasons else "ok", reasons=reasons)

    guard = outbox.dashboard_dependencies

    async def refuse_without_guard() -> None:
        if guard is None and not outbox.settings.health_public_detail:
            raise HTTPException(403, NO_GUARD)

    @router.get(
        "/health/detail",
        response_model=OutboxHealth,
        summary="Outbox health with errors and handlers (guarded)",
        responses={503: {"model": OutboxHealth, "description": "The outbox is down."}},
        dependencies=[Depends(refuse_without_guard), *(guard or [])],
    )
    async def outbox_health_detail(response: Response) -> OutboxHealth:
        health = await current()
        if health.status == "down":
            response.status_code = 503
        return health

    return router
