"""``GET /outbox/health``: is the outbox moving?

The body says ``ok``, ``degraded`` or ``down`` and, per processor, whether it runs, when it
last claimed, its counts and how long the longest-waiting due message has waited. HTTP 503
when ``down`` — only for what a restart of *this* process can cure: the database cannot be
reached, a processor of this process has died, or a due message has waited longer than
``health_max_pending_age_seconds`` for a processor of this process that could take it (its
broker reachable). ``degraded`` (HTTP 200): a broker is unreachable or refusing messages
(with how long), messages are failing or abandoned, or messages wait too long in a process
that runs no processor for them (an API-only process: restarting it would cure nothing).
Counts come from the partial indexes and are cached for ``health_cache_seconds``; when
the database cannot be reached they are
``null`` (unknown), and the check gives up after ``HEALTH_TIMEOUT_SECONDS`` so a database
that hangs makes the endpoint answer 503, not hang. The body holds no payloads and no
credentials: errors are reduced to their type or passed through ``log.safe_error``.

Public body and detail (DESIGN §18): ``GET /outbox/health`` answers anyone, so its body
says the status and why in words that name no host, port, user name or credential: the
``last_error`` texts (a driver's error names the server it could not reach) and the
handlers' names are ``null`` there. ``GET /outbox/health/detail`` has them, behind the
dashboard's guard (``Outbox(..., dashboard_dependencies=[...])``); without a guard it is
refused (403). ``health_public_detail=True`` (``OUTBOX_HEALTH_PUBLIC_DETAIL``) puts the
detail in the public body, for a deployment whose health port only the operators reach.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import TYPE_CHECKING, Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Response
from pydantic import BaseModel, Field

from fastapi_outbox.consume.subscriber import ConsumerStatus
from fastapi_outbox.redaction import redact
from fastapi_outbox.storage import clock
from fastapi_outbox.storage.store import BrokerStats
from fastapi_outbox.storage.wal_slot import format_lsn

if TYPE_CHECKING:
    from fastapi_outbox.outbox import Outbox

Status = Literal["ok", "degraded", "down"]

#: The counts are given up after this long: the endpoint then reports the database down.
HEALTH_TIMEOUT_SECONDS = 5.0


class ProcessorHealth(BaseModel):
    """One (database, broker) processor."""

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
        "dispatcher (from its commit, or from when it was given back); None when none waits."
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


class OutboxHealth(BaseModel):
    """Overall outbox health."""

    status: Status
    database: Literal["ok", "down"]
    dispatchers_running: bool = Field(description="Dispatchers run in this process.")
    reasons: list[str] = Field(default_factory=list, description="Why the status is not ok.")
    processors: list[ProcessorHealth] = Field(default_factory=list)
    wal: WalHealth | None = Field(default=None, description='capture="wal" only.')
    consumers: list[ConsumerStatus] = Field(
        default_factory=list, description="The subscribers' consumer groups."
    )
    listening: bool | None = Field(
        default=None,
        description="The dispatchers of this process get other processes' commits by "
        "LISTEN (False: they poll every poll_interval_seconds until it is back, after a "
        "lost or silent connection); None when none listens here (no dispatchers, SQLite, "
        "notify=False).",
    )

    def public(self) -> OutboxHealth:
        """This report without what may name a host, port, user or code path: every
        ``last_error`` and the handlers' names (the reasons never name them)."""
        wal = self.wal
        return self.model_copy(
            update={
                "processors": [p.model_copy(update={"last_error": None}) for p in self.processors],
                "wal": None if wal is None else wal.model_copy(update={"last_error": None}),
                "consumers": [
                    c.model_copy(update={"handler": None, "last_error": None})
                    for c in self.consumers
                ],
            }
        )


async def compute_health(outbox: Outbox) -> OutboxHealth:
    settings = outbox.settings
    reasons: list[str] = []
    stats: dict[str, BrokerStats] = {}
    try:
        with anyio.fail_after(HEALTH_TIMEOUT_SECONDS):
            stats = await outbox.store.stats(outbox.all_brokers, ordered=settings.ordered)
        database_ok = True
    except Exception as exc:
        database_ok = False
        # The type only: a driver's message can quote the URL.
        reasons.append(f"database unreachable ({type(exc).__name__})")
    processors = []
    down = not database_ok
    degraded = False
    for name in outbox.all_brokers:
        s = stats.get(name)
        p = outbox.processors.get(name) if outbox.started else None
        if outbox.started and (p is None or not p.running):
            down = True
            reasons.append(f"processor {name!r} is not running")
        broker_down = p is not None and p.running and not p.broker_ok
        down_for: float | None = None
        if broker_down and p is not None:
            degraded = True
            down_for = clock.wall() - (p.broker_down_since or clock.wall())
            what = "refusing messages" if p.broker_refusing else "unreachable"
            reasons.append(f"broker {name!r} {what} for {down_for:.0f}s")
        age = s.oldest_pending_age_seconds if s else None
        if age is not None and age > settings.health_max_pending_age_seconds:
            # A restart cures a stuck processor of this process, not a broker outage (the
            # processor is paused on purpose) nor an API-only process's view of the table.
            stuck_here = p is not None and p.running and not broker_down
            if stuck_here:
                down = True
            else:
                degraded = True
            reasons.append(
                f"a due message of {name!r} has waited {age:.0f}s "
                f"(> health_max_pending_age_seconds={settings.health_max_pending_age_seconds:g})"
                + ("" if stuck_here else "; no processor here could take it")
            )
        if s and (s.failed or s.abandoned):
            degraded = True
            if s.abandoned:
                reasons.append(f"{s.abandoned} abandoned message(s) on {name!r}")
            if s.failed:
                reasons.append(f"{s.failed} failing message(s) on {name!r}")
        if s and s.blocked_keys:
            # Ordered dispatch: the later messages of such a key wait for an operator.
            degraded = True
            reasons.append(
                f"{s.blocked_keys} key(s) of {name!r} blocked by an abandoned message "
                f"(first: {s.blocking_message}): replay it to publish the key in order, "
                "or purge it to go on without it"
            )
        processors.append(
            ProcessorHealth(
                broker=name,
                external=name in outbox.external_brokers,
                running=bool(p and p.running),
                broker_available=None if p is None else p.broker_ok,
                broker_down_since=(
                    dt.datetime.fromtimestamp(p.broker_down_since, dt.UTC)
                    if p is not None and p.broker_down_since is not None
                    else None
                ),
                broker_down_seconds=None if down_for is None else round(down_for, 3),
                last_tick=(
                    dt.datetime.fromtimestamp(p.last_tick, dt.UTC)
                    if p is not None and p.last_tick is not None
                    else None
                ),
                pending=s.pending if s else None,
                processing=s.processing if s else None,
                failed=s.failed if s else None,
                abandoned=s.abandoned if s else None,
                oldest_pending_age_seconds=None if age is None else round(age, 3),
                published_last_minute=s.published_last_minute if s else None,
                last_error=_redacted(p.last_error) if p is not None else None,
            )
        )
    wal = None
    if outbox.wal_slot is not None:
        wal, wal_down, wal_degraded = await _wal_health(outbox, reasons, database_ok)
        down = down or wal_down
        degraded = degraded or wal_degraded
    consumers, consumers_down, consumers_degraded = await _consumers_health(outbox, reasons)
    down = down or consumers_down
    degraded = degraded or consumers_degraded
    status: Status = "down" if down else "degraded" if degraded else "ok"
    return OutboxHealth(
        consumers=consumers,
        status=status,
        database="ok" if database_ok else "down",
        dispatchers_running=outbox.started,
        reasons=reasons,
        processors=processors,
        wal=wal,
        listening=None if outbox.listener is None else outbox.listener.listening,
    )


async def _wal_health(
    outbox: Outbox, reasons: list[str], database_ok: bool
) -> tuple[WalHealth, bool, bool]:
    """The slot's health: (report, down, degraded). Down: the slot is missing or was
    invalidated (messages lost: a restart cures nothing, but nothing must look fine), the
    relay of this process died, the reader here stopped before an undecodable message or
    has made no progress for longer than health_max_pending_age_seconds, or it is
    stuck; degraded: its broker is
    down, or the slot's WAL is about to exceed max_slot_wal_keep_size."""
    slot = outbox.wal_slot
    assert slot is not None
    settings = outbox.settings
    relay = outbox.wal_relay if outbox.started else None
    stats = None
    down = degraded = False
    if database_ok:
        try:
            with anyio.fail_after(HEALTH_TIMEOUT_SECONDS):
                stats = await slot.stats()
        except Exception as exc:
            database_ok = False
            reasons.append(f"replication slot unreadable ({type(exc).__name__})")
            down = True
    if database_ok and stats is None:
        down = True
        reasons.append(
            f"replication slot {slot.name!r} does not exist: messages committed now are "
            "lost; run `fastapi-outbox db create` with capture='wal'"
        )
    elif stats is not None and stats.lost:
        down = True
        reasons.append(
            f"replication slot {slot.name!r} was invalidated (wal_status=lost: it retained "
            "more WAL than max_slot_wal_keep_size); messages it had not relayed are lost: "
            "drop and recreate it (`fastapi-outbox db drop-slot --force`, `db create`)"
        )
    elif stats is not None and stats.wal_status == "unreserved":
        degraded = True
        reasons.append(
            f"replication slot {slot.name!r} is about to be invalidated "
            "(wal_status=unreserved): its relay is far behind"
        )
    if outbox.started and (relay is None or not relay.running):
        down = True
        reasons.append("the WAL relay is not running")
    lag = stalled = None
    undecodable = relay.undecodable if relay is not None and relay.leader else None
    if relay is not None and relay.leader:
        lag = relay.lag_seconds
        stalled = relay.no_progress_seconds
        if undecodable is not None:
            down = True
            reasons.append(undecodable.describe(slot.name))
        elif not relay.broker_ok:
            degraded = True
            reasons.append("WAL relay paused: broker down")
        elif stalled is not None and stalled > settings.health_max_pending_age_seconds:
            down = True
            behind = (
                f"{stats.lag_bytes} bytes behind"
                if stats is not None and stats.lag_bytes is not None
                else "lag unknown"
            )
            reasons.append(
                f"the WAL relay has made no progress for {stalled:.0f}s "
                f"(> health_max_pending_age_seconds={settings.health_max_pending_age_seconds:g}; "
                f"slot {slot.name!r} {behind}): {relay.last_error or 'no error'}; a read "
                "must decode the WAL from the slot's restart_lsn within "
                f"wal_read_timeout_seconds={settings.wal_read_timeout_seconds:g}"
            )
        elif lag > settings.health_max_pending_age_seconds:
            down = True
            reasons.append(
                f"the WAL relay's oldest unconfirmed message has waited {lag:.0f}s "
                f"(> health_max_pending_age_seconds={settings.health_max_pending_age_seconds:g})"
            )
    report = WalHealth(
        slot=slot.name,
        exists=None if not database_ok else stats is not None,
        wal_status=stats.wal_status if stats else None,
        lag_bytes=stats.lag_bytes if stats else None,
        retained_bytes=stats.retained_bytes if stats else None,
        safe_wal_size=stats.safe_wal_size if stats else None,
        relay_running=bool(relay and relay.running),
        reader_here=bool(relay and relay.leader),
        lag_seconds=None if lag is None else round(lag, 3),
        last_relayed_at=(
            dt.datetime.fromtimestamp(relay.last_relayed_at, dt.UTC)
            if relay is not None and relay.last_relayed_at is not None
            else None
        ),
        broker_available=None if relay is None else relay.broker_ok,
        last_error=None if relay is None else _redacted(relay.last_error),
        no_progress_seconds=None if stalled is None else round(stalled, 3),
        read_window_bytes=relay.read_window_bytes if relay is not None and relay.leader else None,
        undecodable_lsn=None if undecodable is None else format_lsn(undecodable.lsn),
        undecodable_skip_to=(
            None
            if undecodable is None or undecodable.end_lsn is None
            else format_lsn(undecodable.end_lsn)
        ),
    )
    return report, down, degraded


async def _consumers_health(
    outbox: Outbox, reasons: list[str]
) -> tuple[list[ConsumerStatus], bool, bool]:
    """(statuses, down, degraded): a subscriber of this process that stopped running is
    down (a restart cures it); a paused one (broker unreachable) or dead letters waiting
    degrade the status."""
    if not outbox.subscribers:
        return [], False, False
    from fastapi_outbox.ops import operations

    statuses: list[ConsumerStatus] = await operations.consumers(outbox)
    for status in statuses:  # a handler's error text is the application's own
        status.last_error = _redacted(status.last_error)
    down = degraded = False
    for c in statuses:
        where = f"consumer group {c.group!r} on {c.stream!r}"
        if outbox.started and not c.running:
            down = True
            reasons.append(f"{where} is not running")
        elif c.running and c.broker_available is False:
            degraded = True
            reasons.append(f"{where}: broker {c.broker!r} unavailable")
        if c.dead_letters_unwritten:
            degraded = True
            reasons.append(
                f"{where}: {c.dead_letters_unwritten} message(s) could not be written to "
                f"{c.dead_letter_stream!r} (they stay pending; "
                f"{c.dead_letter_failures} failed write(s))"
            )
        if c.dead_letters:
            degraded = True
            reasons.append(
                f"{c.dead_letters} dead letter(s) of {where} in {c.dead_letter_stream!r}"
            )
        if c.trimmed:
            degraded = True
            reasons.append(
                f"{where}: {c.trimmed} entries trimmed from the stream (MAXLEN) before the "
                "group read them: lost to it; raise the broker's maxlen or drop it"
            )
    return statuses, down, degraded


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


def build_health_router(outbox: Outbox) -> APIRouter:
    router = APIRouter(prefix="/outbox", tags=["outbox"])
    cache: dict[str, tuple[float, OutboxHealth]] = {}

    async def current() -> OutboxHealth:
        now = time.monotonic()
        hit = cache.get("health")
        if hit is not None and now - hit[0] < outbox.settings.health_cache_seconds:
            return hit[1]
        health = await compute_health(outbox)
        cache["health"] = (now, health)
        return health

    @router.get(
        "/health",
        response_model=OutboxHealth,
        summary="Outbox health",
        responses={503: {"model": OutboxHealth, "description": "The outbox is down."}},
    )
    async def outbox_health(response: Response) -> OutboxHealth:
        health = await current()
        if health.status == "down":
            response.status_code = 503
        return health if outbox.settings.health_public_detail else health.public()

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
