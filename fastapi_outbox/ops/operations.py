"""Operator actions on the outbox: one set, called by the CLI and by the dashboard.

``list_messages``, ``show``, ``replay``, ``replay_abandoned``, ``abandon``, ``cancel``,
``purge``, ``overview``; for consumers ``consumers``, ``dead_letters``,
``replay_dead_letters``. The SQL stays in :mod:`fastapi_outbox.storage.store`
(retention's batched delete in :mod:`fastapi_outbox.relay.retention`); this module
validates what an operator asked for, runs it, explains refusals per message id, and logs
every change with the operator's identity
(``operator=``: who asked, as the dashboard's guard or the CLI's user knows it).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi_outbox import exceptions
from fastapi_outbox.events import MessageStatus

if TYPE_CHECKING:
    from fastapi_outbox.outbox import Outbox

logger = logging.getLogger("fastapi_outbox.operations")

#: Statuses a single-message replay accepts: abandoned, or failed (retry now, no backoff).
REPLAYABLE = (MessageStatus.ABANDONED.value, MessageStatus.FAILED.value)
#: Statuses an operator may abandon: not yet published and not held by a dispatcher.
ABANDONABLE = (MessageStatus.PENDING.value, MessageStatus.FAILED.value)
#: Statuses of messages that can still be cancelled (when no dispatcher holds them).
CANCELLABLE = (MessageStatus.PENDING.value,)
#: Rows moved back to pending per statement by ``replay_abandoned``.
REPLAY_BATCH_SIZE = 1000
#: ``status`` filters: the stored statuses, and ``scheduled`` (pending, not yet due).
STATUS_FILTERS = (*(s.value for s in MessageStatus), "scheduled")
#: Most messages one list page shows.
MAX_PAGE_SIZE = 500
#: Most message ids one operator request takes (CLI or dashboard); a longer list is refused.
MAX_IDS = 100_000
#: Ids per statement: one bind parameter each, and asyncpg takes at most 32,767 of them.
ID_PAGE_SIZE = 1000


@dataclasses.dataclass(slots=True)
class Outcome:
    """What an action changed: ``changed`` ids, and a sentence per id it left alone."""

    changed: list[uuid.UUID]
    problems: list[str]

    @property
    def count(self) -> int:
        return len(self.changed)


@dataclasses.dataclass(slots=True)
class MessageFilter:
    """Filters of ``list_messages``; ``None`` means any."""

    status: str | None = None
    stream: str | None = None
    broker: str | None = None
    type: str | None = None
    key: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in STATUS_FILTERS:
            raise exceptions.OperationError(
                f"status: {self.status!r} is not one of " + ", ".join(STATUS_FILTERS)
            )
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                setattr(self, name, value.replace(tzinfo=dt.UTC))


async def list_messages(
    outbox: Outbox,
    where: MessageFilter,
    *,
    before_id: uuid.UUID | None = None,
    limit: int = 50,
) -> list[Mapping[str, Any]]:
    """A page of messages without payloads, newest first; the next page is
    ``before_id=<last id>`` (keyset pagination)."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise exceptions.OperationError(f"limit: must be 1 to {MAX_PAGE_SIZE}, not {limit}")
    return await outbox.store.list_messages(
        status=where.status,
        scheduled=where.status == "scheduled",
        stream=where.stream,
        broker=where.broker,
        type_=where.type,
        key=where.key,
        since=where.since,
        until=where.until,
        before_id=before_id,
        limit=limit,
    )


async def show(outbox: Outbox, message_id: uuid.UUID) -> dict[str, Any]:
    """One message with its headers and payload decoded; MessageNotFound when absent."""
    row = await outbox.store.get(message_id)
    if row is None:
        raise exceptions.MessageNotFound(f"no outbox message with id {message_id}")
    data = {k: v for k, v in dict(row).items() if k not in ("payload", "headers")}
    data["headers"] = json.loads(row["headers"])
    data["payload"] = json.loads(row["payload"])
    return data


async def replay(
    outbox: Outbox,
    ids: Sequence[uuid.UUID],
    *,
    operator: str | None = None,
    dry_run: bool = False,
) -> Outcome:
    """Move abandoned (or failed) messages back to pending with attempts reset.
    ``dry_run``: what it would do (``changed``: the ids it would move), changing nothing."""

    async def move(page: list[uuid.UUID]) -> list[uuid.UUID]:
        return await outbox.store.replay(page, statuses=REPLAYABLE)

    outcome = await _by_pages(outbox, ids, None if dry_run else move, REPLAYABLE, "replayed")
    if not dry_run:
        _log("replay", outcome, operator)
    return outcome


async def replay_abandoned(
    outbox: Outbox,
    *,
    stream: str | None = None,
    operator: str | None = None,
    progress: Callable[[int], None] | None = None,
    max_rows: int | None = None,
) -> int:
    """Move every abandoned message (of ``stream``) back to pending, in bounded batches;
    ``max_rows``: at most that many (the count an operator confirmed)."""
    total = await outbox.store.count_matching(MessageStatus.ABANDONED.value, stream=stream)
    if max_rows is not None:
        total = min(total, max_rows)
    replayed = 0
    # Bounded: each round moves rows out of 'abandoned', so at most total/batch + a few
    # rounds (rows abandoned meanwhile are taken too, up to twice the initial count).
    for _ in range(2 * (total // REPLAY_BATCH_SIZE) + 3):
        limit = REPLAY_BATCH_SIZE
        if max_rows is not None:
            limit = min(limit, max_rows - replayed)
            if limit <= 0:
                break
        moved = await outbox.store.replay(stream=stream, limit=limit)
        replayed += len(moved)
        if progress is not None:
            progress(len(moved))
        if len(moved) < limit:
            break
    logger.info(
        "abandoned messages replayed",
        extra={
            "action": "operator.replay_abandoned",
            "stream": stream,
            "count": replayed,
            "operator": operator,
        },
    )
    return replayed


async def abandon(
    outbox: Outbox,
    ids: Sequence[uuid.UUID],
    *,
    operator: str | None = None,
    reason: str | None = None,
    dry_run: bool = False,
) -> Outcome:
    """Stop retrying pending or failed messages that no dispatcher holds right now."""
    who = f" by {operator}" if operator else ""
    error = f"abandoned by an operator{who}" + (f": {reason}" if reason else "")

    async def stop(page: list[uuid.UUID]) -> list[uuid.UUID]:
        return await outbox.store.abandon_unclaimed(page, error)

    outcome = await _by_pages(
        outbox, ids, None if dry_run else stop, ABANDONABLE, "abandoned", unclaimed=True
    )
    if not dry_run:
        _log("abandon", outcome, operator)
    return outcome


async def cancel(
    outbox: Outbox,
    ids: Sequence[uuid.UUID],
    *,
    operator: str | None = None,
    dry_run: bool = False,
) -> Outcome:
    """Cancel pending messages (delayed ones, typically) that no dispatcher has claimed:
    their rows are deleted. Fenced against a concurrent claim: a message claimed first
    is too late to cancel, and the answer says so."""

    async def delete(page: list[uuid.UUID]) -> list[uuid.UUID]:
        return await outbox.store.cancel_unclaimed(page)

    outcome = await _by_pages(
        outbox, ids, None if dry_run else delete, CANCELLABLE, "cancelled", unclaimed=True
    )
    outcome.problems = [
        p.replace(": only pending messages can be cancelled", "")
        .replace("message ", "too late: message ", 1)
        .replace(" is held by a dispatcher right now: not cancelled", " is being published")
        if not p.startswith("no outbox message")
        else p
        for p in outcome.problems
    ]
    if not dry_run:
        _log("cancel", outcome, operator)
    return outcome


async def purge(
    outbox: Outbox,
    status: str,
    older_than_seconds: float,
    *,
    batch_size: int,
    operator: str | None = None,
    progress: Callable[[int], None] | None = None,
    max_rows: int | None = None,
) -> int:
    """Delete finished (published or abandoned) messages older than that, in batches;
    ``max_rows``: at most that many (the count an operator confirmed)."""
    from fastapi_outbox.relay import retention

    deleted = await retention.purge(
        outbox.store,
        status,
        older_than_seconds,
        batch_size=batch_size,
        progress=progress,
        max_rows=max_rows,
    )
    logger.info(
        "messages purged",
        extra={
            "action": "operator.purge",
            "status": status,
            "count": deleted,
            "operator": operator,
        },
    )
    return deleted


@dataclasses.dataclass(slots=True)
class Overview:
    """What the dashboard's overview shows."""

    streams: list[dict[str, Any]]
    per_minute: list[tuple[dt.datetime, int]]
    database_ok: bool
    brokers: list[dict[str, Any]]
    consumers: list[Any]


async def overview(outbox: Outbox) -> Overview:
    """Counts per broker and stream, published per minute over the last hour, and the
    status of the database and of each broker's processor in this process."""
    try:
        streams = await outbox.store.stream_stats()
        per_minute = await outbox.store.published_per_minute(60)
        database_ok = True
    except Exception as exc:
        logger.warning(
            "overview: database unreachable",
            extra={"action": "operations.overview", "error": type(exc).__name__},
        )
        streams, per_minute, database_ok = [], [], False
    brokers = []
    for name in outbox.all_brokers:
        p = outbox.processors.get(name) if outbox.started else None
        brokers.append(
            {
                "broker": name,
                "external": name in outbox.external_brokers,
                "running": bool(p and p.running),
                "available": None if p is None else p.broker_ok,
                "refusing": bool(p and p.broker_refusing),
                "down_since": (
                    dt.datetime.fromtimestamp(p.broker_down_since, dt.UTC)
                    if p is not None and p.broker_down_since is not None
                    else None
                ),
                "last_error": p.last_error if p is not None else None,
            }
        )
    consumers: list[Any] = []
    consumers_status = getattr(outbox, "consumers_status", None)
    if consumers_status is not None:
        consumers = list(await consumers_status())
    return Overview(streams, per_minute, database_ok, brokers, consumers)


def checked_ids(ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
    """``ids`` once each, in the order given; OperationError past ``MAX_IDS``."""
    unique = list(dict.fromkeys(ids))
    if len(unique) > MAX_IDS:
        raise exceptions.OperationError(
            f"ids: at most {MAX_IDS} message ids per request, not {len(unique)}: split the list"
        )
    return unique


async def _by_pages(
    outbox: Outbox,
    ids: Sequence[uuid.UUID],
    change: Callable[[list[uuid.UUID]], Awaitable[list[uuid.UUID]]] | None,
    allowed: Sequence[str],
    verb: str,
    *,
    unclaimed: bool = False,
) -> Outcome:
    """Apply ``change`` to ``ids`` a page of ``ID_PAGE_SIZE`` at a time (each page one
    statement, and one more reading the states of the ids it left alone), and explain
    every id left alone. ``change=None``: a dry run, the ids that would change (in an
    ``allowed`` status, and held by no dispatcher when ``unclaimed``)."""
    outcome = Outcome([], [])
    unique = checked_ids(ids)
    for start in range(0, len(unique), ID_PAGE_SIZE):
        page = unique[start : start + ID_PAGE_SIZE]
        done = set(await change(page)) if change is not None else set()
        rest = [mid for mid in page if mid not in done]
        states = await outbox.store.states(rest) if rest else {}
        for mid in page:  # keep the order given
            state = states.get(mid)
            if mid in done:
                outcome.changed.append(mid)
            elif state is None:
                outcome.problems.append(f"no outbox message with id {mid}")
            elif state[0] in allowed and change is None and not (unclaimed and state[1]):
                outcome.changed.append(mid)  # a dry run: it would change
            elif state[0] in allowed:
                outcome.problems.append(
                    f"message {mid} is held by a dispatcher right now: not {verb}"
                )
            else:
                outcome.problems.append(
                    f"message {mid} is {state[0]}: only {' or '.join(allowed)} messages "
                    f"can be {verb}"
                )
    return outcome


def _log(action: str, outcome: Outcome, operator: str | None) -> None:
    logger.info(
        f"operator {action}",
        extra={
            "action": f"operator.{action}",
            "count": outcome.count,
            "message_ids": [str(i) for i in outcome.changed][:100],
            "refused": len(outcome.problems),
            "operator": operator,
        },
    )


# -- consumers ---------------------------------------------------------------------------------

#: Bound of the broker calls of one consumers view (lag, dead letters).
CONSUMER_QUERY_TIMEOUT_SECONDS = 3.0


async def consumers(outbox: Outbox, *, counts: bool = False) -> list[Any]:
    """Every ``@outbox.subscriber`` with its lag, pending and dead letters (from the
    broker), its last handling time (from the inbox, so any process's work shows) and,
    when it runs here, its state. ``counts``: also the inbox rows per group (reads every
    row of the groups: the CLI asks for it, health and the dashboard do not). A broker or
    database that does not answer leaves its figures None."""
    import anyio

    from fastapi_outbox.consume.subscriber import ConsumerStatus

    subscribers = list(getattr(outbox, "subscribers", []))
    if not subscribers:
        return []
    inbox: dict[str, Any] | None = None
    try:
        with anyio.fail_after(CONSUMER_QUERY_TIMEOUT_SECONDS):
            inbox = await outbox.inbox.group_stats(
                sorted({s.group for s in subscribers}), counts=counts
            )
    except Exception as exc:
        logger.warning(
            "consumers: inbox unreadable",
            extra={"action": "operations.consumers", "error": type(exc).__name__},
        )
    out = []
    for sub in subscribers:
        status = ConsumerStatus(
            stream=sub.stream,
            group=sub.group,
            broker=sub.broker_name,
            handler=sub.name,
            dead_letter_stream=sub.dead_letter,
            running=sub.running,
            broker_available=sub.broker_ok if sub.running else None,
            failures=sub.stats.failures,
            last_error=sub.stats.last_error,
            dead_letter_failures=sub.stats.dead_letter_failures,
            dead_letters_unwritten=len(getattr(sub, "_unwritten_dead_letters", ())),
        )
        if inbox is not None:  # else the database did not answer: unknown
            stats = inbox.get(sub.group)
            status.handled = (stats.handled if stats else 0) if counts else None
            status.last_handled_at = stats.last_handled_at if stats else None
        try:
            consumer = sub.consumer or sub.make_consumer()
            with anyio.fail_after(CONSUMER_QUERY_TIMEOUT_SECONDS):
                lag = await consumer.lag()
                status.lag, status.pending = lag.lag, lag.pending
                status.trimmed = lag.trimmed
                status.dead_letters = await consumer.count_dead_letters()
        except Exception as exc:
            logger.warning(
                "consumers: broker unreadable",
                extra={
                    "action": "operations.consumers",
                    "group": sub.group,
                    "stream": sub.stream,
                    "error": type(exc).__name__,
                },
            )
        out.append(status)
    return out


def find_subscriber(outbox: Outbox, stream: str, group: str) -> Any:
    """The subscriber of (``stream``, ``group``); OperationError naming the known ones."""
    for sub in getattr(outbox, "subscribers", []):
        if sub.stream == stream and sub.group == group:
            return sub
    known = ", ".join(f"{s.stream}/{s.group}" for s in getattr(outbox, "subscribers", []))
    raise exceptions.OperationError(
        f"no subscriber for stream {stream!r} and group {group!r} "
        f"(declared: {known or 'none; pass --app module:outbox of the consuming service'})"
    )


async def dead_letters(outbox: Outbox, stream: str, group: str, *, limit: int = 100) -> list[Any]:
    """Dead letters of a (stream, group), oldest first."""
    sub = find_subscriber(outbox, stream, group)
    consumer = sub.consumer or sub.make_consumer()
    return list(await consumer.dead_letters(limit))


def _created_at(message_id: str) -> dt.datetime | None:
    """When an outbox message was created, from its UUIDv7 id (None for other ids)."""
    try:
        value = uuid.UUID(message_id)
    except ValueError:
        return None
    if value.version != 7:
        return None
    return dt.datetime.fromtimestamp((value.int >> 80) / 1000, dt.UTC)


#: Dead letters examined for their age before a replay (the oldest first).
STALE_SCAN = 10_000


async def stale_dead_letters(
    outbox: Outbox, stream: str, group: str, entry_ids: Sequence[str] | None = None
) -> list[Any]:
    """The dead letters of (``stream``, ``group``) (all, or ``entry_ids``) older than
    ``inbox_retention_seconds``, by the database's clock: the message's creation (its
    UUIDv7 id) or, for another id, its dead-lettering. The other groups handled them about
    when they were created; once their inbox rows are deleted, a replay is handled anew
    by each of them."""
    retention = outbox.settings.inbox_retention_seconds
    if retention is None:
        return []
    sub = find_subscriber(outbox, stream, group)
    consumer = sub.consumer or sub.make_consumer()
    letters = list(await consumer.dead_letters(STALE_SCAN))
    wanted = None if entry_ids is None else set(entry_ids)
    now = await outbox.store.clock()
    stale = []
    for letter in letters:
        if wanted is not None and letter.entry_id not in wanted:
            continue
        times = [t for t in (_created_at(letter.message_id), letter.dead_lettered_at) if t]
        if times and (now - min(times)).total_seconds() > retention:
            stale.append(letter)
    return stale


async def replay_dead_letters(
    outbox: Outbox,
    stream: str,
    group: str,
    entry_ids: Sequence[str] | None = None,
    *,
    operator: str | None = None,
    force: bool = False,
) -> int:
    """Put dead letters of (``stream``, ``group``) back on the stream (all, or the entries
    ``entry_ids``); the group handles them again, other groups skip them through their
    inbox — as long as their inbox rows are kept: dead letters older than
    ``inbox_retention_seconds`` raise :class:`~fastapi_outbox.exceptions.StaleDeadLetters`
    unless ``force``. Returns how many were re-driven."""
    sub = find_subscriber(outbox, stream, group)
    consumer = sub.consumer or sub.make_consumer()
    if not force:
        stale = await stale_dead_letters(outbox, stream, group, entry_ids)
        if stale:
            retention = outbox.settings.inbox_retention_seconds or 0
            raise exceptions.StaleDeadLetters(
                f"{len(stale)} dead letter(s) of group {group!r} on {stream!r} are older "
                f"than inbox_retention_seconds ({retention:g} s; e.g. message "
                f"{stale[0].message_id}): the other groups' inbox rows of these messages "
                "may be deleted, so every other group of the stream would handle them "
                "again; replay only the recent ones (--entry), or force it (--force, or "
                "force in the dashboard) if those groups can take them twice"
            )
    count = int(await consumer.replay_dead_letters(entry_ids))
    logger.info(
        "operator replay_dead_letters",
        extra={
            "action": "operator.replay_dead_letters",
            "stream": stream,
            "group": group,
            "count": count,
            "entry_ids": list(entry_ids or [])[:100],
            "operator": operator,
            "forced": force,
        },
    )
    return count
