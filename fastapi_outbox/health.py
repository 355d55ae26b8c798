"""``GET /outbox/health``: is the outbox moving?

The body says ``ok``, ``degraded`` or ``down`` and, per processor, whether it runs, when it
last claimed, its counts and the oldest pending age. HTTP 503 when ``down``: the database
cannot be reached, a processor of this process has died, or the oldest pending message is
older than ``health_max_pending_age_seconds``. ``degraded`` (HTTP 200): a broker cannot be
reached, or messages are failing or abandoned. Counts come from the partial indexes and
are cached for ``health_cache_seconds``; when the database cannot be reached they are
``null`` (unknown), and the check gives up after ``HEALTH_TIMEOUT_SECONDS`` so a database
that hangs makes the endpoint answer 503, not hang. The body holds no payloads and no
credentials: errors are reduced to their type or passed through ``log.safe_error``.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import TYPE_CHECKING, Literal

import anyio
from fastapi import APIRouter, Response
from pydantic import BaseModel, Field

from fastapi_outbox.store import BrokerStats

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
    last_tick: dt.datetime | None = Field(description="Last successful claim (UTC).")
    pending: int | None = Field(description="None when the database cannot be reached.")
    processing: int | None
    failed: int | None
    abandoned: int | None
    oldest_pending_age_seconds: float | None = Field(
        description="Age of the oldest pending message; None when there is none."
    )
    published_last_minute: int | None
    last_error: str | None = Field(default=None, description="Last error, without data.")


class OutboxHealth(BaseModel):
    """Overall outbox health."""

    status: Status
    database: Literal["ok", "down"]
    dispatchers_running: bool = Field(description="Dispatchers run in this process.")
    reasons: list[str] = Field(default_factory=list, description="Why the status is not ok.")
    processors: list[ProcessorHealth] = Field(default_factory=list)


async def compute_health(outbox: Outbox) -> OutboxHealth:
    settings = outbox.settings
    reasons: list[str] = []
    stats: dict[str, BrokerStats] = {}
    try:
        with anyio.fail_after(HEALTH_TIMEOUT_SECONDS):
            stats = await outbox.store.stats(outbox.all_brokers)
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
        if p is not None and p.running and not p.broker_ok:
            degraded = True
            reasons.append(f"broker {name!r} unreachable")
        age = s.oldest_pending_age_seconds if s else None
        if age is not None and age > settings.health_max_pending_age_seconds:
            down = True
            reasons.append(
                f"oldest pending message of {name!r} is {age:.0f}s old "
                f"(> health_max_pending_age_seconds={settings.health_max_pending_age_seconds:g})"
            )
        if s and (s.failed or s.abandoned):
            degraded = True
            if s.abandoned:
                reasons.append(f"{s.abandoned} abandoned message(s) on {name!r}")
            if s.failed:
                reasons.append(f"{s.failed} failing message(s) on {name!r}")
        processors.append(
            ProcessorHealth(
                broker=name,
                external=name in outbox.external_brokers,
                running=bool(p and p.running),
                broker_available=None if p is None else p.broker_ok,
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
                last_error=p.last_error if p is not None else None,
            )
        )
    status: Status = "down" if down else "degraded" if degraded else "ok"
    return OutboxHealth(
        status=status,
        database="ok" if database_ok else "down",
        dispatchers_running=outbox.started,
        reasons=reasons,
        processors=processors,
    )


def build_health_router(outbox: Outbox) -> APIRouter:
    router = APIRouter(prefix="/outbox", tags=["outbox"])
    cache: dict[str, tuple[float, OutboxHealth]] = {}

    @router.get(
        "/health",
        response_model=OutboxHealth,
        summary="Outbox health",
        responses={503: {"model": OutboxHealth, "description": "The outbox is down."}},
    )
    async def outbox_health(response: Response) -> OutboxHealth:
        now = time.monotonic()
        hit = cache.get("health")
        if hit is not None and now - hit[0] < outbox.settings.health_cache_seconds:
            health = hit[1]
        else:
            health = await compute_health(outbox)
            cache["health"] = (now, health)
        if health.status == "down":
            response.status_code = 503
        return health

    return router
