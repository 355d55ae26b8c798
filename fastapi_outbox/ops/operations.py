"""Operator actions on the outbox: one set, called by the CLI and by the dashboard.

``list_messages``, ``show``, ``replay``, ``replay_abandoned``, ``abandon``, ``cancel``,
``purge``, ``overview``; for consumers ``consumers``, ``dead_letters``,
``replay_dead_letters``. It sees the outbox through its port
(`fastapi_outbox.ops.port.OutboxPort`), never ``Outbox``; the SQL stays in
`fastapi_outbox.storage` (retention's batched delete in
`fastapi_outbox.lifecycle.retention`). This module validates what an operator asked for,
runs it, says per message id what it did (`Outcome`: a `Verdict` per id,
which callers branch on; the sentences of ``Outcome.problems`` are for people), and logs
every change with the operator's identity (``operator=``: who asked, as the dashboard's
guard or the CLI's user knows it).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.consumer import DeadLetter
from fastapi_outbox.consume.subscriber import ConsumerStatus, Subscriber
from fastapi_outbox.events import (
    HEADER_CAUSATION_ID,
    HEADER_CORRELATION_ID,
    HEADER_MESSAGE_ID,
    MessageStatus,
)
from fastapi_outbox.lifecycle import retention
from fastapi_outbox.ops.port import OutboxPort, relay_here, wall_time
from fastapi_outbox.payloads import Revealed, claim_check

# The listing's filter and its statuses: built by the CLI and the dashboard from a request.
from fastapi_outbox.storage.filters import STATUS_FILTERS as STATUS_FILTERS
from fastapi_outbox.storage.filters import MessageFilter as MessageFilter
from fastapi_outbox.storage.inbox import GroupStats

logger = logging.getLogger("fastapi_outbox.ops")

#: Statuses a single-message replay accepts: abandoned, or failed (retry now, no backoff).
REPLAYABLE = (MessageStatus.ABANDONED.value, MessageStatus.FAILED.value)
#: Statuses an operator may abandon: not yet published and not held by a relay.
ABANDONABLE = (MessageStatus.PENDING.value, MessageStatus.FAILED.value)
#: Statuses of messages that can still be cancelled (when no relay holds them).
CANCELLABLE = (MessageStatus.PENDING.value,)
#: Rows moved back to pending per statement by ``replay_abandoned``.
REPLAY_BATCH_SIZE = 1000
#: Most messages one list page shows.
MAX_PAGE_SIZE = 500
#: Most message ids one operator request takes (CLI or dashboard); a longer list is refused.
MAX_IDS = 100_000
#: Ids per statement: one bind parameter each, and asyncpg takes at most 32,767 of them.
ID_PAGE_SIZE = 1000


class Action(enum.Enum):
    """An operator's action on message ids: what it is called when done, the statuses it
    takes, and whether a message a relay holds is left alone."""

    REPLAY = "replay"
    ABANDON = "abandon"
    CANCEL = "cancel"

    @property
    def done(self) -> str:
        """``replayed``, ``abandoned``, ``cancelled``."""
        return f"{self.value}ed" if self is not Action.CANCEL else "cancelled"

    @property
    def takes(self) -> tuple[str, ...]:
        """The statuses the action changes."""
        return _TAKES[self]

    @property
    def unclaimed_only(self) -> bool:
        """Abandon and cancel leave a message a relay holds alone (fenced); a replay
        takes abandoned and failed ones, which no relay holds."""
        return self is not Action.REPLAY


_TAKES = {
    Action.REPLAY: REPLAYABLE,
    Action.ABANDON: ABANDONABLE,
    Action.CANCEL: CANCELLABLE,
}


class Verdict(enum.Enum):
    """What an action did with one message id."""

    #: Changed (in a dry run: would be changed).
    DONE = "done"
    #: No outbox message has that id.
    NOT_FOUND = "not_found"
    #: Its status is not one the action takes (published, say).
    WRONG_STATUS = "wrong_status"
    #: In a status the action takes, but a relay holds it right now.
    HELD = "held"


@dataclasses.dataclass(frozen=True, slots=True)
class IdOutcome:
    """One message id of an action, with its verdict and, when left alone in the table,
    its status."""

    message_id: uuid.UUID
    verdict: Verdict
    status: str | None = None


def explain(action: Action, result: IdOutcome) -> str | None:
    """The sentence an operator reads for an id the action left alone (None: done). A
    cancel speaks of being too late: the message was claimed or finished first."""
    mid, verdict = result.message_id, result.verdict
    if verdict is Verdict.DONE:
        return None
    if verdict is Verdict.NOT_FOUND:
        return f"no outbox message with id {mid}"
    if action is Action.CANCEL:
        now = "being published" if verdict is Verdict.HELD else result.status
        return f"too late: message {mid} is {now}"
    if verdict is Verdict.HELD:
        return f"message {mid} is held by a relay right now: not {action.done}"
    return (
        f"message {mid} is {result.status}: only {' or '.join(action.takes)} messages "
        f"can be {action.done}"
    )


@dataclasses.dataclass(slots=True)
class Outcome:
    """What an action did: a verdict per id, in the order given. ``changed``: the ids it
    changed (would change, in a dry run); ``problems``: a sentence per id it left alone."""

    action: Action
    results: list[IdOutcome] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> list[uuid.UUID]:
        return [r.message_id for r in self.results if r.verdict is Verdict.DONE]

    @property
    def refused(self) -> list[IdOutcome]:
        """The ids left alone, each with why."""
        return [r for r in self.results if r.verdict is not Verdict.DONE]

    @property
    def problems(self) -> list[str]:
        return [explain(self.action, r) or "" for r in self.refused]

    @property
    def count(self) -> int:
        return sum(1 for r in self.results if r.verdict is Verdict.DONE)


async def list_messages(
    outbox: OutboxPort,
    where: MessageFilter,
    *,
    before_id: uuid.UUID | None = None,
    limit: int = 50,
) -> list[Mapping[str, Any]]:
    """A page of messages without payloads, newest first; the next page is
    ``before_id=<last id>`` (keyset pagination)."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise exceptions.OperationError(f"limit: must be 1 to {MAX_PAGE_SIZE}, not {limit}")
    return await outbox.store.messages.list_messages(where, before_id=before_id, limit=limit)


async def show(
    outbox: OutboxPort, message_id: uuid.UUID, *, archived: bool = False, reveal: bool = True
) -> dict[str, Any]:
    """One message with its headers and payload decoded; MessageNotFound when absent.
    The outbox table, then the archive (``archive=True``); ``archived``: the archive only.
    An archived message carries ``archived: True`` and its ``archived_at``.
    ``reveal``: encrypted payloads and headers are decrypted when this process holds the
    key (else ``payload`` is None and ``payload_note`` says ``encrypted (key k2)``); False:
    they stay as stored (a dashboard that shows no payloads)."""
    if archived and outbox.archive is None:
        raise exceptions.OperationError(
            "this outbox has no archive: archive=True (OUTBOX_ARCHIVE) is not set"
        )
    row = None if archived else await outbox.store.messages.get(message_id)
    if row is None and outbox.archive is not None:
        row = await outbox.archive.get(message_id)
    if row is None:
        if archived:
            raise exceptions.MessageNotFound(f"no archived message with id {message_id}")
        also = " (nor in the archive)" if outbox.archive is not None else ""
        raise exceptions.MessageNotFound(f"no outbox message with id {message_id}{also}")
    data = {k: v for k, v in dict(row).items() if k not in ("payload", "headers")}
    data["archived"] = "archived_at" in data
    headers = json.loads(row["headers"])
    claim = claim_check.label_of(headers)  # "claim-check: <ref> (5.0 MiB)"
    if claim is not None:
        data["claim_check"] = claim
    if not reveal:
        data["headers"], data["payload"] = headers, json.loads(row["payload"])
        return data
    shown = await outbox.payloads.reveal(
        str(headers.get(HEADER_MESSAGE_ID, row["id"])),
        row["stream"],
        row["type"],
        row["payload"],
        headers,
    )
    data["headers"] = shown.headers
    if claim is not None:  # the reference headers, as stored
        data["headers"].update({k: headers[k] for k in claim_check.ClaimCheckStage.headers})
    if isinstance(shown, Revealed):  # encrypted under a key this process lacks, ...
        data["payload"] = None
        data["payload_note"] = shown.note
    elif claim is not None and len(shown.payload) > SHOW_PAYLOAD_BYTES:
        # A large claim-checked payload: its first characters.
        data["payload"] = None
        text = shown.payload[: PAYLOAD_PREVIEW_CHARS * 4].decode(errors="ignore")
        data["payload_preview"] = text[:PAYLOAD_PREVIEW_CHARS]
    else:
        data["payload"] = json.loads(shown.payload)
    return data


#: A claim-checked payload up to this size is shown whole by ``show``; a larger one as a
#: preview of its first characters (``payload_preview``).
SHOW_PAYLOAD_BYTES = 256 * 1024
PAYLOAD_PREVIEW_CHARS = 20_000


#: Headers whose value may be the id of another message: the message that caused this one,
#: and the correlation id (a message's id when its flow began with that message).
LINKED_HEADERS = (HEADER_CAUSATION_ID, HEADER_CORRELATION_ID)


async def linked_messages(outbox: OutboxPort, headers: Mapping[str, Any]) -> dict[str, str]:
    """Header name → message id, for each of `LINKED_HEADERS` in ``headers`` whose
    value is the id of a message the outbox table or its archive holds (one lookup each)."""
    found: dict[str, str] = {}
    own = headers.get(HEADER_MESSAGE_ID)
    for name in LINKED_HEADERS:
        value = headers.get(name)
        try:
            message_id = uuid.UUID(str(value))
        except ValueError:
            continue
        if str(value) == own:
            continue
        row = await outbox.store.messages.get(message_id)
        if row is None and outbox.archive is not None:
            row = await outbox.archive.get(message_id)
        if row is not None:
            found[name] = str(message_id)
    return found


async def list_archived(
    outbox: OutboxPort,
    where: MessageFilter,
    *,
    before_id: uuid.UUID | None = None,
    limit: int = 50,
) -> list[Mapping[str, Any]]:
    """A page of archived messages without payloads, newest first (``archive list``);
    OperationError when the outbox has no archive or a filter does not apply."""
    if outbox.archive is None:
        raise exceptions.OperationError(
            "this outbox has no archive: archive=True (OUTBOX_ARCHIVE) is not set"
        )
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise exceptions.OperationError(f"limit: must be 1 to {MAX_PAGE_SIZE}, not {limit}")
    if where.status not in (None, "published", "abandoned"):
        raise exceptions.OperationError(
            f"status: archived messages are published or abandoned, not {where.status!r}"
        )
    return await outbox.archive.list_messages(where, before_id=before_id, limit=limit)


async def replay(
    outbox: OutboxPort,
    ids: Sequence[uuid.UUID],
    *,
    operator: str | None = None,
    dry_run: bool = False,
) -> Outcome:
    """Move abandoned (or failed) messages back to pending with attempts reset.
    ``dry_run``: what it would do (``changed``: the ids it would move), changing nothing."""

    async def move(page: list[uuid.UUID]) -> list[uuid.UUID]:
        return await outbox.store.messages.replay(page, statuses=REPLAYABLE)

    outcome = await _by_pages(outbox, ids, None if dry_run else move, Action.REPLAY)
    if not dry_run:
        _log(outcome, operator)
    return outcome


async def replay_abandoned(
    outbox: OutboxPort,
    *,
    stream: str | None = None,
    operator: str | None = None,
    progress: Callable[[int], None] | None = None,
    max_rows: int | None = None,
) -> int:
    """Move every abandoned message (of ``stream``) back to pending, in bounded batches;
    ``max_rows``: at most that many (the count an operator confirmed)."""
    abandoned = MessageStatus.ABANDONED.value
    total = await outbox.store.messages.count_matching(abandoned, stream=stream)
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
        moved = await outbox.store.messages.replay(stream=stream, limit=limit)
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
    outbox: OutboxPort,
    ids: Sequence[uuid.UUID],
    *,
    operator: str | None = None,
    reason: str | None = None,
    dry_run: bool = False,
) -> Outcome:
    """Stop retrying pending or failed messages that no relay holds right now."""
    who = f" by {operator}" if operator else ""
    error = f"abandoned by an operator{who}" + (f": {reason}" if reason else "")

    async def stop(page: list[uuid.UUID]) -> list[uuid.UUID]:
        return await outbox.store.messages.abandon_unclaimed(page, error)

    outcome = await _by_pages(outbox, ids, None if dry_run else stop, Action.ABANDON)
    if not dry_run:
        _log(outcome, operator)
    return outcome


async def cancel(
    outbox: OutboxPort,
    ids: Sequence[uuid.UUID],
    *,
    operator: str | None = None,
    dry_run: bool = False,
) -> Outcome:
    """Cancel pending messages (delayed ones, typically) that no relay has claimed:
    their rows are deleted. Fenced against a concurrent claim: a message claimed first
    is too late to cancel, and the answer says so."""

    async def delete(page: list[uuid.UUID]) -> list[uuid.UUID]:
        return await outbox.store.messages.cancel_unclaimed(page)

    outcome = await _by_pages(outbox, ids, None if dry_run else delete, Action.CANCEL)
    if not dry_run:
        _log(outcome, operator)
    return outcome


async def cancel_one(outbox: OutboxPort, message_id: uuid.UUID) -> None:
    """Cancel one pending message (``Outbox.cancel``): MessageNotFound for an unknown id,
    TooLate when a relay claimed it, or it finished, first."""
    outcome = await cancel(outbox, [message_id])
    for refused in outcome.refused:
        text = explain(outcome.action, refused)
        if refused.verdict is Verdict.NOT_FOUND:
            raise exceptions.MessageNotFound(text)
        raise exceptions.TooLate(text)


async def purge(
    outbox: OutboxPort,
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
    deleted = await retention.purge(
        outbox.store.retention,
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
    consumers: list[ConsumerStatus]


async def overview(outbox: OutboxPort) -> Overview:
    """Counts per broker and stream, published per minute over the last hour, and the
    status of the database and of each broker's relay in this process."""
    try:
        streams = await outbox.store.messages.stream_stats()
        per_minute = await outbox.store.messages.published_per_minute(60)
        database_ok = True
    except Exception as exc:
        logger.warning(
            "overview: database unreachable",
            extra={"action": "operations.overview", "error": type(exc).__name__},
        )
        streams, per_minute, database_ok = [], [], False
    brokers = [_broker_row(outbox, name) for name in outbox.all_brokers]
    return Overview(streams, per_minute, database_ok, brokers, await consumers(outbox))


def _broker_row(outbox: OutboxPort, name: str) -> dict[str, Any]:
    """One broker of the overview: its relay's state in this process."""
    p = relay_here(outbox, name)
    return {
        "broker": name,
        "external": name in outbox.external_brokers,
        "running": bool(p and p.running),
        "available": None if p is None else p.broker_ok,
        "refusing": bool(p and p.broker_refusing),
        "down_since": None if p is None else wall_time(p.broker_down_since),
        "last_error": p.last_error if p is not None else None,
    }


def checked_ids(ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
    """``ids`` once each, in the order given; OperationError past ``MAX_IDS``."""
    unique = list(dict.fromkeys(ids))
    if len(unique) > MAX_IDS:
        raise exceptions.OperationError(
            f"ids: at most {MAX_IDS} message ids per request, not {len(unique)}: split the list"
        )
    return unique


async def _by_pages(
    outbox: OutboxPort,
    ids: Sequence[uuid.UUID],
    change: Callable[[list[uuid.UUID]], Awaitable[list[uuid.UUID]]] | None,
    action: Action,
) -> Outcome:
    """Apply ``change`` to ``ids`` a page of ``ID_PAGE_SIZE`` at a time (each page one
    statement, and one more reading the states of the ids it left alone), with a verdict
    for every id. ``change=None``: a dry run, the ids that would change (in a status the
    action takes, and held by no relay when the action leaves those alone)."""
    outcome = Outcome(action)
    unique = checked_ids(ids)
    for start in range(0, len(unique), ID_PAGE_SIZE):
        page = unique[start : start + ID_PAGE_SIZE]
        done = set(await change(page)) if change is not None else set()
        rest = [mid for mid in page if mid not in done]
        states = await outbox.store.messages.states(rest) if rest else {}
        for mid in page:  # keep the order given
            if mid in done:
                outcome.results.append(IdOutcome(mid, Verdict.DONE))
            else:
                outcome.results.append(
                    verdict(action, mid, states.get(mid), dry_run=change is None)
                )
    return outcome


def verdict(
    action: Action, message_id: uuid.UUID, state: tuple[str, bool] | None, *, dry_run: bool
) -> IdOutcome:
    """Why ``action`` left ``message_id`` alone, from its ``state`` (status, held by a
    relay; None: not in the table); in a dry run, DONE when it would change."""
    if state is None:
        return IdOutcome(message_id, Verdict.NOT_FOUND)
    status, held = state
    if status not in action.takes:
        return IdOutcome(message_id, Verdict.WRONG_STATUS, status)
    if dry_run and not (action.unclaimed_only and held):
        return IdOutcome(message_id, Verdict.DONE)
    return IdOutcome(message_id, Verdict.HELD, status)


def _log(outcome: Outcome, operator: str | None) -> None:
    action = outcome.action.value
    logger.info(
        f"operator {action}",
        extra={
            "action": f"operator.{action}",
            "count": outcome.count,
            "message_ids": [str(i) for i in outcome.changed[:100]],
            "refused": len(outcome.results) - outcome.count,
            "operator": operator,
        },
    )


# -- consumers ---------------------------------------------------------------------------------

#: Bound of the broker calls of one consumers view (lag, dead letters).
CONSUMER_QUERY_TIMEOUT_SECONDS = 3.0


async def consumers(outbox: OutboxPort, *, counts: bool = False) -> list[ConsumerStatus]:
    """Every ``@outbox.subscriber`` with its lag, pending and dead letters (from the
    broker), its last handling time (from the inbox, so any process's work shows) and,
    when it runs here, its state. ``counts``: also the inbox rows per group (reads every
    row of the groups: the CLI asks for it, health and the dashboard do not). A broker or
    database that does not answer leaves its figures None and its error in
    ``status.causes``."""
    subscribers = list(outbox.subscribers)
    if not subscribers:
        return []
    inbox = await _inbox_stats(outbox, sorted({s.group for s in subscribers}), counts=counts)
    out = []
    for sub in subscribers:
        status = _status_here(sub)
        if isinstance(inbox, BaseException):  # the database did not answer: unknown
            status.causes.append(inbox)
        else:
            stats = inbox.get(sub.group)
            status.handled = (stats.handled if stats else 0) if counts else None
            status.last_handled_at = stats.last_handled_at if stats else None
        await _broker_figures(sub, status)
        out.append(status)
    return out


async def _inbox_stats(
    outbox: OutboxPort, groups: list[str], *, counts: bool
) -> dict[str, GroupStats] | BaseException:
    """The inbox's figures of ``groups``; the error when the database does not answer in
    time (or the query fails)."""
    try:
        with anyio.fail_after(CONSUMER_QUERY_TIMEOUT_SECONDS):
            return await outbox.inbox.group_stats(groups, counts=counts)
    except Exception as exc:
        logger.warning(
            "consumers: inbox unreadable",
            extra={"action": "operations.consumers", "error": type(exc).__name__},
        )
        return exc


def _status_here(sub: Subscriber) -> ConsumerStatus:
    """What this process knows of a subscriber (its broker's and inbox's figures unset)."""
    return ConsumerStatus(
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
        handed_back=sub.stats.handed_back,
        dead_letters_unwritten=sub.dead_letters_unwritten,
        workers_replaced=sub.stats.workers_replaced,
    )


async def _broker_figures(sub: Subscriber, status: ConsumerStatus) -> None:
    """Set the group's lag, pending, trimmed and dead letters from its broker; a broker
    that does not answer in time leaves them None."""
    try:
        consumer = sub.consumer or sub.make_consumer()
        with anyio.fail_after(CONSUMER_QUERY_TIMEOUT_SECONDS):
            lag = await consumer.lag()
            status.lag, status.pending = lag.lag, lag.pending
            status.trimmed = lag.trimmed
            status.lag_partitions = lag.partitions
            status.dead_letters = await consumer.count_dead_letters()
    except Exception as exc:
        status.causes.append(exc)
        logger.warning(
            "consumers: broker unreadable",
            extra={
                "action": "operations.consumers",
                "group": sub.group,
                "stream": sub.stream,
                "error": type(exc).__name__,
            },
        )


def find_subscriber(outbox: OutboxPort, stream: str, group: str) -> Subscriber:
    """The subscriber of (``stream``, ``group``); OperationError naming the known ones."""
    for sub in outbox.subscribers:
        if sub.stream == stream and sub.group == group:
            return sub
    known = ", ".join(f"{s.stream}/{s.group}" for s in outbox.subscribers)
    raise exceptions.OperationError(
        f"no subscriber for stream {stream!r} and group {group!r} "
        f"(declared: {known or 'none; pass --app module:outbox of the consuming service'})"
    )


async def dead_letters(
    outbox: OutboxPort, stream: str, group: str, *, limit: int = 100
) -> list[DeadLetter]:
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
    outbox: OutboxPort, stream: str, group: str, entry_ids: Sequence[str] | None = None
) -> list[DeadLetter]:
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
    now = await outbox.store.messages.clock()
    stale = []
    for letter in letters:
        if wanted is not None and letter.entry_id not in wanted:
            continue
        times = [t for t in (_created_at(letter.message_id), letter.dead_lettered_at) if t]
        if times and (now - min(times)).total_seconds() > retention:
            stale.append(letter)
    return stale


async def replay_dead_letters(
    outbox: OutboxPort,
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
    ``inbox_retention_seconds`` raise
    [`StaleDeadLetters`][fastapi_outbox.exceptions.StaleDeadLetters]
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
