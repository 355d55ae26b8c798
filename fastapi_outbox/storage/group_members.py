"""What every process of a consumer group handles, and the attempts the library counts.

Two tables beside the inbox (on its ``MetaData``: ``create_tables()``, ``db create`` and
``db sql`` include them):

``<inbox>_handlers``, one row per running subscriber process::

    group, stream, member   the process (primary key)
    types                   the event types its handler takes, sorted, comma-separated
                            ("*": a ``Message`` handler takes every type)
    expires_at              its heartbeat's end, on the database's clock

During a rolling deploy two versions of one group run side by side. A process that gets a
message of a type its handler does not take asks this table whether another live process
of its group takes it: then the message is handed back to the group, uncharged, for that
process (see `fastapi_outbox.consume.processing`).

``<inbox>_attempts``, one row per (group, message id) that was redelivered or failed::

    attempts          handler runs started on the message (its last one included)
    unhandled_since   first time a process of the group found its type handled by no live
                      process (NULL: never); counts ``consumer_unknown_type_grace_seconds``
    updated_at        for retention

A broker's delivery count cannot tell a message prefetched and handed back at a stop from
one whose handler ran and crashed (RabbitMQ's ``x-delivery-count``, JetStream's
``num_delivered``, ``XPENDING``'s count all rise either way), so a redelivered message's
attempt is the library's own count: a row is written right before the handler runs on a
redelivery (one statement, only when the broker's count is above 1) and when a handler
fails on a first delivery. A first delivery that is handled writes nothing.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    delete,
    func,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox.storage import clock, schema
from fastapi_outbox.storage.dialects import flavor, is_mysql

__all__ = ["ANY_TYPE", "Attempts", "GroupMembers", "build_group_tables"]

#: ``types`` of a process whose handler takes every type (a ``Message`` handler).
ANY_TYPE = "*"


def build_group_tables(inbox_name: str, metadata_: MetaData) -> tuple[Table, Table]:
    """The handlers and attempts tables of the inbox table ``inbox_name``."""
    names = (f"{inbox_name}_handlers", f"{inbox_name}_attempts")
    if names[0] in metadata_.tables:
        return metadata_.tables[names[0]], metadata_.tables[names[1]]
    handlers = Table(
        names[0],
        metadata_,
        Column("group", String(255), primary_key=True, comment="consumer group"),
        Column("stream", String(255), primary_key=True, comment="stream / subject"),
        Column("member", String(255), primary_key=True, comment="subscriber process"),
        Column("types", Text, nullable=False, comment="event types its handler takes, or *"),
        Column("expires_at", schema.UtcDateTime(), nullable=False),
    )
    attempts = Table(
        names[1],
        metadata_,
        Column("group", String(255), primary_key=True, comment="consumer group"),
        Column("message_id", String(255), primary_key=True, comment="incoming message id"),
        Column("attempts", Integer, nullable=False, comment="handler runs started"),
        Column("unhandled_since", schema.UtcDateTime(), nullable=True),
        Column("updated_at", schema.UtcDateTime(), nullable=False),
    )
    Index(f"ix_{names[1]}_updated_at", attempts.c.updated_at)
    return handlers, attempts


def _insert(is_postgres: bool, table: Table) -> Any:
    return (postgresql.insert if is_postgres else sqlite.insert)(table)


def _upsert(
    engine: AsyncEngine,
    table: Table,
    keys: list[Any],
    values: dict[str, Any],
    set_: dict[str, Any],
    where: Any = None,
) -> Any:
    """INSERT ``values``; on a conflict on ``keys``, UPDATE ``set_`` (where ``where``, or
    leave the row: then ``set_`` on MySQL must keep its value itself). MySQL's form is
    ``ON DUPLICATE KEY UPDATE`` (it has no ON CONFLICT)."""
    if is_mysql(engine):
        return mysql.insert(table).values(**values).on_duplicate_key_update(**set_)
    return (
        _insert(engine.dialect.name == "postgresql", table)
        .values(**values)
        .on_conflict_do_update(index_elements=keys, set_=set_, where=where)
    )


class GroupMembers:
    """The ``<inbox>_handlers`` rows of one (group, stream)."""

    def __init__(self, engine: AsyncEngine, table: Table, group: str, stream: str) -> None:
        self.engine = engine
        self.table = table
        self.group = group
        self.stream = stream
        self.is_postgres = engine.dialect.name == "postgresql"
        self._flavor = flavor(engine)

    async def heartbeat(self, member: str, types: str, ttl_seconds: float) -> None:
        """``member`` alive, taking ``types``, for ``ttl_seconds`` more; rows gone for ten
        times that are forgotten."""
        t = self.table
        later = clock.db_later(self._flavor, seconds=ttl_seconds)
        upsert = _upsert(
            self.engine,
            t,
            [t.c.group, t.c.stream, t.c.member],
            {
                "group": self.group,
                "stream": self.stream,
                "member": member,
                "types": types,
                "expires_at": later,
            },
            {"types": types, "expires_at": later},
        )
        old = clock.db_later(self._flavor, seconds=-10 * ttl_seconds)
        async with self.engine.begin() as conn:
            await conn.execute(upsert)
            await conn.execute(
                delete(t).where(
                    t.c.group == self.group, t.c.stream == self.stream, t.c.expires_at < old
                )
            )

    async def leave(self, member: str) -> None:
        t = self.table
        async with self.engine.begin() as conn:
            await conn.execute(
                delete(t).where(
                    t.c.group == self.group, t.c.stream == self.stream, t.c.member == member
                )
            )

    async def live_types(self, but: str) -> list[frozenset[str]]:
        """The type sets of the live processes of the group other than ``but``."""
        t = self.table
        stmt = select(t.c.types).where(
            t.c.group == self.group,
            t.c.stream == self.stream,
            t.c.member != but,
            t.c.expires_at > clock.db_now(self._flavor),
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(stmt)).scalars().all()
        return [frozenset(r.split(",")) if r else frozenset() for r in rows]


class Attempts:
    """The ``<inbox>_attempts`` rows of one group."""

    def __init__(self, engine: AsyncEngine, table: Table, group: str) -> None:
        self.engine = engine
        self.table = table
        self.group = group
        self.is_postgres = engine.dialect.name == "postgresql"
        self.is_mysql = is_mysql(engine)
        self._flavor = flavor(engine)
        t = table
        now = clock.db_now(self._flavor)
        # One statement: the row's count raised by one (1 when new), the new count back
        # (MySQL, no RETURNING: read back in the same transaction, the row locked).
        self._start = _upsert(
            engine,
            t,
            [t.c.group, t.c.message_id],
            {"attempts": 1, "updated_at": now},
            {"attempts": t.c.attempts + 1, "updated_at": now},
        )
        if not self.is_mysql:
            self._start = self._start.returning(t.c.attempts)
            ins = _insert(self.is_postgres, t)
            self._failed = ins.values(updated_at=now).on_conflict_do_nothing(
                index_elements=[t.c.group, t.c.message_id]
            )
        else:
            self._failed = mysql.insert(t).prefix_with("IGNORE").values(updated_at=now)
        # The first time only: a row of an earlier attempt gets the time, one that has
        # it keeps it.
        self._unhandled = _upsert(
            engine,
            t,
            [t.c.group, t.c.message_id],
            {"attempts": 0, "unhandled_since": now, "updated_at": now},
            {"unhandled_since": func.coalesce(t.c.unhandled_since, now) if self.is_mysql else now},
            where=t.c.unhandled_since.is_(None),
        )

    async def start(self, message_id: str) -> int:
        """A handler run starts on a redelivered ``message_id``: its attempt number."""
        async with self.engine.begin() as conn:
            key = {"group": self.group, "message_id": message_id}
            result = await conn.execute(self._start, key)
            if self.is_mysql:
                t = self.table
                result = await conn.execute(
                    select(t.c.attempts).where(
                        t.c.group == self.group, t.c.message_id == message_id
                    )
                )
            return int(result.scalar_one())

    async def failed(self, message_id: str, attempt: int) -> None:
        """The handler failed on the first delivery of ``message_id`` (no row yet)."""
        async with self.engine.begin() as conn:
            await conn.execute(
                self._failed, {"group": self.group, "message_id": message_id, "attempts": attempt}
            )

    async def unhandled_for(self, message_id: str) -> float:
        """Seconds since a process of the group first found ``message_id``'s type taken by
        no live process (0 now, the first time)."""
        t = self.table
        key = {"group": self.group, "message_id": message_id}
        async with self.engine.begin() as conn:
            await conn.execute(self._unhandled, key)
            row = (
                await conn.execute(
                    select(t.c.unhandled_since, clock.db_now(self._flavor)).where(
                        t.c.group == self.group, t.c.message_id == message_id
                    )
                )
            ).one()
        since, now = row
        if isinstance(now, str):
            now = dt.datetime.fromisoformat(now).replace(tzinfo=dt.UTC)
        return max(0.0, float((now - since).total_seconds()))

    async def uncount(self, message_ids: list[str]) -> None:
        """The last counted run of each of ``message_ids`` was cancelled by a normal stop:
        not an attempt."""
        t = self.table
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t)
                .where(t.c.group == self.group, t.c.message_id.in_(message_ids), t.c.attempts > 0)
                .values(attempts=t.c.attempts - 1)
            )

    async def forget(self, message_ids: list[str]) -> None:
        """Rows of messages now settled (handled, skipped or dead-lettered)."""
        if not message_ids:
            return
        t = self.table
        async with self.engine.begin() as conn:
            await conn.execute(
                delete(t).where(
                    tuple_(t.c.group, t.c.message_id).in_([(self.group, m) for m in message_ids])
                )
            )
