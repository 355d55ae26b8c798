"""The read side of the dashboard, health and ``status``: the rows of the counting
statements (`fastapi_outbox.storage.statements.messages.stats` and
``stream_stats``, ``published_per_minute``) folded into what those callers show.

Pure functions of the rows and the database's clock, so ``tests/unit`` checks them without
a database; `Messages` runs the statements and hands the
rows here.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastapi_outbox.storage.statements.parts import ABANDONED, FAILED, PENDING, PROCESSING

__all__ = ["BrokerStats", "age", "aware", "broker_stats", "per_minute", "stream_stats"]


def aware(value: Any) -> dt.datetime:
    """A time read back from the database as an aware UTC datetime (SQLite returns the
    stored text, or a naive datetime)."""
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    aware: dt.datetime = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
    return aware


def age(now: dt.datetime, since: Any) -> float | None:
    """Seconds from ``since`` (a due time) to ``now``; None while it is not yet due."""
    seconds = (now - aware(since)).total_seconds()
    return seconds if seconds >= 0 else None


@dataclasses.dataclass(slots=True)
class BrokerStats:
    """Counts of one broker's rows (health endpoint, ``status`` command)."""

    broker: str
    pending: int = 0
    processing: int = 0
    failed: int = 0
    abandoned: int = 0
    oldest_pending_age_seconds: float | None = None
    published_last_minute: int = 0
    #: Pending rows not due yet (delayed messages); included in ``pending``.
    scheduled: int = 0
    #: Only with ``stats(published_totals=True)``.
    published: int | None = None
    #: Ordered dispatch: keys whose later messages wait behind an abandoned message, and
    #: the first such message by id (None when none blocks).
    blocked_keys: int = 0
    blocking_message: str | None = None


def broker_stats(
    brokers: Iterable[str],
    db_now: dt.datetime,
    rows: Mapping[str, Sequence[Any]],
    *,
    ordered: bool = False,
    published_totals: bool = False,
) -> dict[str, BrokerStats]:
    """For `Messages.stats`: ``rows`` holds the
    rows of each statement of ``operations.stats`` by name (``active``, ``abandoned``,
    ``scheduled``, ``recent``; ``waiting_ordered`` and ``blocking_ordered`` with
    ``ordered``; ``published`` with ``published_totals``). Every broker of ``brokers``
    appears, with zeros when it has no row."""
    out: dict[str, BrokerStats] = {name: BrokerStats(name) for name in brokers}

    def entry(name: str) -> BrokerStats:
        return out.setdefault(name, BrokerStats(name))

    for broker, status, count, oldest in rows["active"]:
        setattr(entry(broker), status, int(count))
        if status == PENDING and oldest is not None and not ordered:
            entry(broker).oldest_pending_age_seconds = age(db_now, oldest)
    if ordered:
        # The pending age of the rows a relay could take now (not those waiting behind
        # an earlier row of their key), and the keys blocked behind an abandoned row.
        for broker, oldest in rows["waiting_ordered"]:
            if oldest is not None:
                entry(broker).oldest_pending_age_seconds = age(db_now, oldest)
        for broker, count, first in rows["blocking_ordered"]:
            entry(broker).blocked_keys = int(count)
            entry(broker).blocking_message = None if first is None else str(uuid.UUID(str(first)))
    for broker, count in rows["abandoned"]:
        entry(broker).abandoned = int(count)
    for broker, count in rows["scheduled"]:
        entry(broker).scheduled = int(count)
    for broker, count in rows["recent"]:
        entry(broker).published_last_minute = int(count)
    if published_totals:
        for s in out.values():
            s.published = 0
        for broker, count in rows["published"]:
            entry(broker).published = int(count)
    return out


def stream_stats(db_now: dt.datetime, rows: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """For `Messages.stream_stats`: the
    rows of ``operations.stream_stats`` by name (``active``, ``abandoned``, ``scheduled``)
    as one zero-filled entry per (broker, stream), sorted by broker then stream."""
    out: dict[tuple[str, str], dict[str, Any]] = {}

    def entry(broker: str, stream: str) -> dict[str, Any]:
        return out.setdefault((broker, stream), _stream_entry(broker, stream))

    for broker, stream, status, count, oldest in rows["active"]:
        e = entry(broker, stream)
        e[status] = int(count)
        if status == PENDING and oldest is not None:
            e["oldest_pending_age_seconds"] = age(db_now, oldest)
    for broker, stream, count in rows["abandoned"]:
        entry(broker, stream)[ABANDONED] = int(count)
    for broker, stream, count in rows["scheduled"]:
        entry(broker, stream)["scheduled"] = int(count)
    return sorted(out.values(), key=lambda e: (e["broker"], e["stream"]))


def per_minute(
    db_now: dt.datetime, rows: Iterable[Any], minutes: int
) -> list[tuple[dt.datetime, int]]:
    """For `Messages.published_per_minute`: the (minute, count) rows of
    ``operations.published_per_minute`` as one entry per minute of the last ``minutes``
    ending with ``db_now``'s, oldest first, minutes without any row as 0."""
    counts: dict[dt.datetime, int] = {}
    for minute, count in rows:
        counts[aware(minute).replace(second=0, microsecond=0)] = int(count)
    end = db_now.replace(second=0, microsecond=0)
    start = end - dt.timedelta(minutes=minutes - 1)
    return [
        (start + dt.timedelta(minutes=i), counts.get(start + dt.timedelta(minutes=i), 0))
        for i in range(minutes)
    ]


def _stream_entry(broker: str, stream: str) -> dict[str, Any]:
    """A zeroed entry of `stream_stats`."""
    return {
        "broker": broker,
        "stream": stream,
        PENDING: 0,
        PROCESSING: 0,
        FAILED: 0,
        ABANDONED: 0,
        "scheduled": 0,
        "oldest_pending_age_seconds": None,
    }
