"""Partition leases of ordered subscribers: which process handles which keys, and where.

An ordered subscriber (``@outbox.subscriber(stream, group=…, ordered=True)`` on a broker
whose consumer can read a stream from a position: Redis Streams, NATS JetStream) hashes
each message's key into one of ``consumer_ordered_partitions`` partitions. One row per
(group, stream, partition) in ``<inbox>_partitions`` says who owns it::

    group, stream, partition   the partition (primary key)
    partitions                 how many the group has (checked at every start)
    owner                      the process that holds the lease (NULL: free)
    token                      the fencing token, raised at every take-over
    position                   the stream position of the partition's last settled message
    expires_at                 the lease's end, on the database's clock
    started                    the message after ``position`` when its handling started (or
                               will start next; not past ``position``: none)
    attempts                   the handler's starts on it alone (0: a batch beginning with it)

``started`` and ``attempts`` count a message's attempts where a crash cannot lose them (a
handler that kills its process on every try would otherwise start again at attempt 1 in
every next owner and hold its partition back forever). Before a handler runs on a message,
the row says so — in the statement of the previous transaction where it can (the fence
records what comes next in the partition's queue: no statement added), in a statement of
its own otherwise (an empty queue, a retry). A new owner that finds ``started`` past
``position`` knows its predecessor died (or stopped) inside that transaction: it handles a
batch's messages one by one, and dead-letters a message whose ``attempts`` reached
``consumer_max_attempts`` (see `fastapi_outbox.consume.partitioned`).

and one row per live process in ``<inbox>_members`` (group, stream, member, expires_at):
its heartbeat, from which each process computes its fair share (``ceil(partitions /
live members)``).

The fence: the handler's transaction begins with ``UPDATE … SET position = <entry> WHERE
… AND token = <the owner's token>``: no row, the lease was taken over (the owner was
frozen, its lease expired): `LeaseLost`, the transaction rolls back, nothing of the
stale owner commits. The row lock it takes also makes a take-over wait for (or, with
``SKIP LOCKED``, skip) a partition whose owner is committing: the new owner reads the
position after the last commit.

Every due time is the database's (``now()``): processes on hosts whose clocks disagree
share one clock. Like the inbox, the tables live on the outbox table's ``MetaData``:
``create_tables()``, ``db create`` and ``db sql`` include them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    Column,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    bindparam,
    delete,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from fastapi_outbox import exceptions
from fastapi_outbox.storage import clock, schema
from fastapi_outbox.storage.dialects import flavor, is_mysql

__all__ = [
    "LeaseLost",
    "Leases",
    "OwnedPartition",
    "build_lease_tables",
]


class LeaseLost(BaseException):
    """This process no longer owns the partition (another took it over after its lease
    expired): its transaction rolls back and it stops handling the partition. A
    ``BaseException``, so the retry paths' ``except Exception`` never take it for a
    failure of the handler."""

    def __init__(self, group: str, stream: str, partition: int) -> None:
        super().__init__(
            f"group {group!r}, stream {stream!r}: partition {partition} was taken over by "
            "another process (this one's lease expired)"
        )
        self.partition = partition


def build_lease_tables(inbox_name: str, metadata_: MetaData) -> tuple[Table, Table]:
    """The partitions and members tables of the inbox table ``inbox_name``, on
    ``metadata_`` (the inbox table's)."""
    names = (f"{inbox_name}_partitions", f"{inbox_name}_members")
    if names[0] in metadata_.tables:
        return metadata_.tables[names[0]], metadata_.tables[names[1]]
    partitions = Table(
        names[0],
        metadata_,
        Column("group", String(255), primary_key=True, comment="consumer group"),
        Column("stream", String(255), primary_key=True, comment="stream / subject"),
        Column("partition", Integer, primary_key=True, autoincrement=False),
        Column("partitions", Integer, nullable=False, comment="the group's partition count"),
        Column("owner", String(255), nullable=True, comment="process holding the lease"),
        Column("token", Integer, nullable=False, default=0, comment="fencing token"),
        Column("position", String(64), nullable=False, comment="last settled entry"),
        Column("expires_at", schema.UtcDateTime(), nullable=False),
        # Added after the first layout: nullable or with a server default, so that
        # ``db upgrade`` adds them to a table with rows (``fastapi_outbox.storage.doctor``).
        Column(
            "started",
            String(64),
            nullable=True,
            comment="first unsettled entry when its handling started (past position)",
        ),
        Column(
            "attempts",
            Integer,
            nullable=False,
            default=0,
            server_default="0",
            comment="handler starts on it alone (0: a batch beginning with it)",
        ),
        # ``fastapi-outbox doctor`` / ``db upgrade``: the columns of a live table only.
        info={"doctor": "columns"},
    )
    members = Table(
        names[1],
        metadata_,
        Column("group", String(255), primary_key=True),
        Column("stream", String(255), primary_key=True),
        Column("member", String(255), primary_key=True),
        Column("expires_at", schema.UtcDateTime(), nullable=False),
        info={"doctor": "columns"},
    )
    return partitions, members


@dataclasses.dataclass(slots=True)
class OwnedPartition:
    """A partition this process took: its fencing token, the position of its last
    settled message (where its reading starts) and what the previous owner had started
    (``started`` past ``position``: it died or stopped inside that transaction, having
    started the handler ``attempts`` times on the message after ``position``)."""

    partition: int
    token: int
    position: str
    started: str | None = None
    attempts: int = 0


class Leases:
    """SQL on the lease tables of one inbox, for one (group, stream)."""

    def __init__(
        self, engine: AsyncEngine, tables: tuple[Table, Table], group: str, stream: str
    ) -> None:
        self.engine = engine
        self.table, self.members = tables
        self.group, self.stream = group, stream
        self.is_postgres = engine.dialect.name == "postgresql"
        #: MariaDB/MySQL: no UPDATE … RETURNING (a fence counts its rows; acquire and
        #: renew read the rows back in their transaction) and no ON CONFLICT.
        self.is_mysql = is_mysql(engine)
        self._flavor = flavor(engine)
        self._insert: Any = postgresql.insert if self.is_postgres else sqlite.insert
        t = self.table
        self._mine = and_(t.c.group == group, t.c.stream == stream)
        token_holds = and_(
            self._mine,
            t.c.partition == bindparam("b_partition"),
            t.c.token == bindparam("b_token"),
        )
        # fence. Caller: the handler's transaction of an ordered subscriber
        # (fastapi_outbox.consume.partitioned), first statement, and the settling of a
        # message without one (skipped, dead-lettered). Moves the partition's position to
        # the message; no row when the token changed (taken over): the caller rolls back.
        # The row lock it takes holds a take-over back until this transaction ends.
        # - started, attempts: what the partition's next transaction will start on (the
        #   next queued message; its first attempt alone, or 0: a batch beginning with
        #   it), written with the position so that the common case needs no statement of
        #   its own before that transaction's handler runs; NULL, 0 when nothing is queued.
        self._fence = (
            update(t)
            .where(token_holds)
            .values(
                position=bindparam("b_position"),
                started=bindparam("b_started"),
                attempts=bindparam("b_attempts"),
            )
        )
        # start. Caller: an ordered subscriber, in a transaction of its own right before a
        # handler's transaction that the last fence did not announce (the queue was
        # empty then, a retry): the handler is about to start on the message ``started``
        # alone for the ``attempts``-th time, or on a batch beginning with it (0). Fenced
        # like the fence; it commits before the handler runs, so a crash in the handler
        # cannot take the count with it.
        self._start = (
            update(t)
            .where(token_holds)
            .values(started=bindparam("b_started"), attempts=bindparam("b_attempts"))
        )
        if not self.is_mysql:
            self._fence = self._fence.returning(t.c.partition)
            self._start = self._start.returning(t.c.partition)

    async def create(self) -> None:
        for table in (self.table, self.members):
            await schema.create_table(self.engine, table)

    async def ensure(self, partitions: int, position: str) -> None:
        """The group's partition rows (free, at ``position``) when missing; a
        ConfigurationError when the group already has another number of partitions.
        Caller: an ordered subscriber's start."""
        t = self.table
        rows = [
            {
                "group": self.group,
                "stream": self.stream,
                "partition": p,
                "partitions": partitions,
                "owner": None,
                "token": 0,
                "position": position,
                "expires_at": clock.db_now(self._flavor),
                "started": None,
                "attempts": 0,
            }
            for p in range(partitions)
        ]
        async with self.engine.begin() as conn:
            existing = (
                await conn.execute(
                    select(t.c.partitions, func.count()).where(self._mine).group_by(t.c.partitions)
                )
            ).all()
            if not existing:
                stmt = (
                    mysql.insert(t).prefix_with("IGNORE")
                    if self.is_mysql
                    else self._insert(t).on_conflict_do_nothing(
                        index_elements=[t.c.group, t.c.stream, t.c.partition]
                    )
                )
                for row in rows:  # the database's clock per row
                    await conn.execute(stmt.values(**row))
                existing = (
                    await conn.execute(
                        select(t.c.partitions, func.count())
                        .where(self._mine)
                        .group_by(t.c.partitions)
                    )
                ).all()
        found = {int(n): int(c) for n, c in existing}
        if found != {partitions: partitions}:
            raise exceptions.ConfigurationError(
                f"ordered subscriber of stream {self.stream!r}, group {self.group!r}: "
                f"consumer_ordered_partitions={partitions}, but the group's partition "
                f"table {t.name!r} holds {sum(found.values())} partition row(s) of "
                f"{sorted(found)} partitions. Every process of a group must use the same "
                "count; to change it, stop every process of the group, let none run, "
                f'then delete the group\'s rows (DELETE FROM {t.name} WHERE "group" = '
                f"'{self.group}' AND stream = '{self.stream}') and start them with the "
                "new count: they start from the oldest position a partition had"
            )

    async def oldest_position(self) -> list[str]:
        """Every partition's position (for a re-created group). Caller: operators, tests."""
        t = self.table
        async with self.engine.connect() as conn:
            return list((await conn.execute(select(t.c.position).where(self._mine))).scalars())

    async def heartbeat(self, member: str, lease_seconds: float) -> int:
        """Note ``member`` alive for ``lease_seconds`` more; the number of live members
        (itself included). Caller: the ordered subscriber's coordinator, every third of a
        lease."""
        m = self.members
        later = clock.db_later(self._flavor, seconds=lease_seconds)
        now = clock.db_now(self._flavor)
        mine = and_(m.c.group == self.group, m.c.stream == self.stream)
        values = {"group": self.group, "stream": self.stream, "member": member}
        if self.is_mysql:
            upsert = (mysql.insert(m).values(**values, expires_at=later)).on_duplicate_key_update(
                expires_at=later
            )
        else:
            upsert = self._insert(m).values(**values, expires_at=later)
            upsert = upsert.on_conflict_do_update(
                index_elements=[m.c.group, m.c.stream, m.c.member], set_={"expires_at": later}
            )
        async with self.engine.begin() as conn:
            await conn.execute(upsert)
            # Members gone for ten leases: forgotten.
            await conn.execute(
                delete(m).where(
                    mine,
                    m.c.expires_at < clock.db_later(self._flavor, seconds=-10 * lease_seconds),
                )
            )
            live = await conn.execute(select(func.count()).where(mine, m.c.expires_at > now))
            return int(live.scalar_one())

    async def renew(self, member: str, lease_seconds: float) -> dict[int, int]:
        """Extend the leases ``member`` holds; partition -> token of those it still holds.
        Caller: the coordinator, every third of a lease."""
        t = self.table
        stmt = (
            update(t)
            .where(self._mine, t.c.owner == member)
            .values(expires_at=clock.db_later(self._flavor, seconds=lease_seconds))
        )
        async with self.engine.begin() as conn:
            if self.is_mysql:
                # The rows it updated, read back under the locks the update took.
                await conn.execute(stmt)
                held = select(t.c.partition, t.c.token).where(self._mine, t.c.owner == member)
                return {int(p): int(tok) for p, tok in (await conn.execute(held)).all()}
            stmt = stmt.returning(t.c.partition, t.c.token)
            return {int(p): int(tok) for p, tok in (await conn.execute(stmt)).all()}

    async def acquire(self, member: str, count: int, lease_seconds: float) -> list[OwnedPartition]:
        """Take up to ``count`` free partitions (no owner, or a lease expired): each gets a
        new token. Two statements in one transaction: the free rows, locked (``SKIP
        LOCKED`` on PostgreSQL: a partition whose owner is committing is left for the next
        round; a ``LIMIT`` subquery inside the ``UPDATE`` may be run again by the planner
        and take more), then their update. Caller: the coordinator."""
        if count <= 0:
            return []
        t = self.table
        now = clock.db_now(self._flavor)
        expired = or_(t.c.owner.is_(None), t.c.expires_at <= now)
        free = select(t.c.partition).where(self._mine, expired).order_by(t.c.partition)
        free = free.limit(count)
        if self.is_postgres or self.is_mysql:
            free = free.with_for_update(skip_locked=True)
        columns = (t.c.partition, t.c.token, t.c.position, t.c.started, t.c.attempts)
        async with self.engine.begin() as conn:
            numbers = list((await conn.execute(free)).scalars())
            if not numbers:
                return []
            stmt = (
                update(t)
                .where(self._mine, t.c.partition.in_(numbers), expired)
                .values(
                    owner=member,
                    token=t.c.token + 1,
                    expires_at=clock.db_later(self._flavor, seconds=lease_seconds),
                )
            )
            if self.is_mysql:
                # Locked by the SELECT above: every one of them is updated, then read back.
                await conn.execute(stmt)
                taken = select(*columns).where(self._mine, t.c.partition.in_(numbers))
                rows = (await conn.execute(taken)).all()
            else:
                rows = (await conn.execute(stmt.returning(*columns))).all()
        return sorted(
            (
                OwnedPartition(
                    int(p), int(tok), str(pos), None if st is None else str(st), int(n or 0)
                )
                for p, tok, pos, st, n in rows
            ),
            key=lambda o: o.partition,
        )

    async def release(
        self, member: str, partitions: Iterable[int], *, unstarted: Iterable[int] = ()
    ) -> None:
        """Give ``partitions`` up at once (a rebalance, a stop): free for the others now,
        not after the lease. ``unstarted``: those whose announced next message (see
        `fence`) never started: its count goes, the next owner starts it at attempt
        1. Caller: the coordinator."""
        wanted = list(partitions)
        if not wanted:
            return
        t = self.table
        stmt = (
            update(t)
            .where(self._mine, t.c.owner == member, t.c.partition.in_(wanted))
            .values(owner=None, expires_at=clock.db_now(self._flavor))
        )
        async with self.engine.begin() as conn:
            await self._forget_unstarted(conn, member, unstarted)
            await conn.execute(stmt)

    async def _forget_unstarted(
        self, conn: AsyncConnection, member: str, partitions: Iterable[int]
    ) -> None:
        numbers = list(partitions)
        if numbers:
            t = self.table
            await conn.execute(
                update(t)
                .where(self._mine, t.c.owner == member, t.c.partition.in_(numbers))
                .values(started=None, attempts=0)
            )

    async def leave(self, member: str, *, unstarted: Iterable[int] = ()) -> None:
        """``member`` stops: its member row goes, its partitions are freed (``unstarted``:
        as in `release`). Caller: the coordinator at a stop."""
        t, m = self.table, self.members
        async with self.engine.begin() as conn:
            await self._forget_unstarted(conn, member, unstarted)
            await conn.execute(
                update(t)
                .where(self._mine, t.c.owner == member)
                .values(owner=None, expires_at=clock.db_now(self._flavor))
            )
            await conn.execute(
                delete(m).where(
                    m.c.group == self.group, m.c.stream == self.stream, m.c.member == member
                )
            )

    async def fence(
        self,
        conn: AsyncConnection,
        partition: int,
        token: int,
        position: str,
        next_start: tuple[str | None, int] = (None, 0),
    ) -> None:
        """In ``conn``'s transaction: the partition's position moves to ``position`` if
        ``token`` still holds it, else `LeaseLost`. ``next_start``: (``started``,
        ``attempts``) announced for the partition's next transaction (see `start`),
        in the same statement."""
        started, attempts = next_start
        result = await conn.execute(
            self._fence,
            {
                "b_partition": partition,
                "b_token": token,
                "b_position": position,
                "b_started": started,
                "b_attempts": attempts,
            },
        )
        if not self._held(result):
            raise LeaseLost(self.group, self.stream, partition)

    def _held(self, result: Any) -> bool:
        """Whether a fenced update found its row (MySQL: its row count, the rows matched)."""
        if self.is_mysql:
            return int(result.rowcount) == 1
        return result.first() is not None

    async def settle(
        self,
        partition: int,
        token: int,
        position: str,
        next_start: tuple[str | None, int] = (None, 0),
    ) -> None:
        """`fence` in a transaction of its own: a message settled without a handler's
        transaction (skipped, dead-lettered)."""
        async with self.engine.begin() as conn:
            await self.fence(conn, partition, token, position, next_start)

    async def start(self, partition: int, token: int, started: str, attempts: int) -> None:
        """Committed before a handler's transaction: the handler is about to start on
        ``started`` (the partition's first unsettled message); ``attempts``: its starts on
        it alone so far, this one included, or 0 for a batch beginning with it (a crashed
        batch costs its messages no attempt: they go one by one after it).
        `LeaseLost` when ``token`` no longer holds the partition."""
        async with self.engine.begin() as conn:
            result = await conn.execute(
                self._start,
                {
                    "b_partition": partition,
                    "b_token": token,
                    "b_started": started,
                    "b_attempts": attempts,
                },
            )
            if not self._held(result):
                raise LeaseLost(self.group, self.stream, partition)
