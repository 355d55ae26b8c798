"""The logical replication slot of ``capture="wal"``: its life cycle and its format.

The unit of work writes each transaction's messages with ``pg_logical_emit_message(true,
<prefix>, <json>)`` (`fastapi_outbox.write.wal_capture`); the relay
(`fastapi_outbox.relay.wal`) reads them back from a logical replication slot of the
built-in ``pgoutput`` plugin with ``messages 'true'``, through the SQL slot functions:

``pg_logical_slot_peek_binary_changes``
    decodes the WAL from the slot's ``restart_lsn`` and returns whole committed
    transactions, in commit order, *without* moving the slot: what the relay then fails to
    publish is read again by the next peek (or by the next reader after a crash). Each read
    is bounded by an ``upto_lsn`` a window ahead of the slot's confirmed position
    (`WalSlot.peek`), so a backlog of WAL is read, and confirmed, a window at a time.
``pg_replication_slot_advance``
    moves the slot's ``confirmed_flush_lsn`` once the broker acknowledged: the commit LSN
    of the last transaction published, or the end of the window read when nothing of ours
    is left in it, so the next peek starts after it.

pgoutput needs a publication: an empty one (``CREATE PUBLICATION name``, no table) so no
table change is decoded into the output, only the messages. Transactions that emitted no
message produce no row at all (PostgreSQL 15 skips empty transactions).

Each row of a peek is one pgoutput protocol message (``data``): ``B`` (begin: final LSN,
commit time, xid), ``M`` (flags, LSN, prefix, length, content) and ``C`` (flags, commit
LSN, end LSN, commit time). `decode` keeps the ``M`` records of our prefix, grouped
by transaction. Content of our prefix it cannot decode stops the decoding there
(`Undecodable`): the relay never confirms past a message it could not read.

The statements themselves, each with its caller and the why of its parts, are in
`fastapi_outbox.storage.statements.wal`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import struct
import time
import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox import exceptions
from fastapi_outbox.storage.statements.wal import (
    ADVANCE_SQL,
    BOUNDARY_SQL,
    CHECK_SQL,
    CREATE_SLOT_SQL,
    DB_NOW_SQL,
    DROP_SLOT_SQL,
    PEEK_SQL,
    PUBLICATION_EXISTS_SQL,
    SESSION_SQL,
    SLOT_EXISTS_SQL,
    STATS_SQL,
    TRY_LOCK_SQL,
)

__all__ = [
    "Read",
    "SlotStats",
    "Transaction",
    "Undecodable",
    "UndecodableWalMessage",
    "WalMessage",
    "WalSlot",
    "decode",
    "encode",
]

logger = logging.getLogger("fastapi_outbox.storage")

#: Version of the JSON content of a message (``{"v": 1, "m": [[id, broker, stream, type,
#: key, headers, payload], ...]}``).
CONTENT_VERSION = 1
#: PostgreSQL's epoch (2000-01-01) in Unix seconds: pgoutput times count from it.
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC).timestamp()

#: pgoutput decodes logical messages from PostgreSQL 14 on.
MIN_SERVER_VERSION = 140000

WAL_LEVEL_HINT = (
    "set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) "
    "and restart PostgreSQL; max_replication_slots must allow one more slot"
)


def message_prefix(table_name: str) -> str:
    """The ``pg_logical_emit_message`` prefix of an outbox: other outboxes (and other
    programs) emitting messages on the same database are ignored by its relay."""
    return f"fastapi_outbox:{table_name}"


def format_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclasses.dataclass(slots=True)
class WalMessage:
    """One message read from the slot (one outbox row's worth)."""

    id: str
    broker: str
    stream: str
    type: str
    key: str | None
    headers: str
    payload: str


@dataclasses.dataclass(slots=True)
class Transaction:
    """A committed transaction's messages of our prefix, in emission order."""

    end_lsn: int
    commit_time: float  # Unix seconds
    messages: list[WalMessage]


@dataclasses.dataclass(slots=True)
class SlotStats:
    """``pg_replication_slots`` of the slot, with its lag."""

    slot: str
    wal_status: str | None  # reserved, extended, unreserved, lost
    active_pid: int | None
    lag_bytes: int | None  # current WAL position - confirmed_flush_lsn
    retained_bytes: int | None  # current WAL position - restart_lsn
    safe_wal_size: int | None  # bytes before max_slot_wal_keep_size invalidates it

    @property
    def lost(self) -> bool:
        return self.wal_status == "lost"


def encode(rows: Iterable[dict[str, Any]]) -> str:
    """The content of one ``pg_logical_emit_message``: a transaction's due messages."""
    return json.dumps(
        {
            "v": CONTENT_VERSION,
            "m": [
                [
                    str(r["id"]),
                    r["broker"],
                    r["stream"],
                    r["type"],
                    r["key"],
                    r["headers"],
                    r["payload"],
                ]
                for r in rows
            ],
        },
        separators=(",", ":"),
    )


@dataclasses.dataclass(slots=True, frozen=True)
class Undecodable:
    """A message of our prefix whose content cannot be decoded (malformed, or written by a
    newer version of the library): where it is, and where its transaction ends (the
    position an operator advances the slot to in order to skip it, on purpose)."""

    lsn: int  # the message record
    end_lsn: int | None  # end of its transaction; None when the read did not reach it
    error: str

    def describe(self, slot: str) -> str:
        skip = (
            f"; to drop that transaction's messages on purpose: SELECT "
            f"pg_replication_slot_advance('{slot}', '{format_lsn(self.end_lsn)}')"
            if self.end_lsn is not None
            else ""
        )
        return (
            f"undecodable WAL message at LSN {format_lsn(self.lsn)} in replication slot "
            f"{slot!r} ({self.error}): the WAL relay stopped there and relays nothing after "
            f"it; deploy a version of fastapi-outbox that reads it{skip}"
        )


class UndecodableWalMessage(exceptions.OutboxError):
    """The slot holds a message of the outbox's prefix that cannot be decoded: the relay
    stops before it (``fastapi_outbox.testing.drain`` raises this)."""

    def __init__(self, undecodable: Undecodable, slot: str) -> None:
        super().__init__(undecodable.describe(slot))
        self.undecodable = undecodable


@dataclasses.dataclass(slots=True)
class Read:
    """One bounded read of the slot (`WalSlot.peek`)."""

    #: The slot's confirmed position before the read.
    confirmed: int
    #: Whole committed transactions, in commit order, up to the first undecodable one.
    transactions: list[Transaction]
    #: pgoutput rows returned (``nchanges`` reached: the read was cut short).
    nrows: int
    #: The position the slot may be confirmed to once every transaction read is published:
    #: every commit before it was read (None: the read was cut short, only the last
    #: transaction's end).
    complete_upto: int | None
    #: The read stopped at its window's end, short of the WAL's end: more WAL waits.
    more: bool
    #: The first message of our prefix that could not be decoded, if any.
    undecodable: Undecodable | None = None


def decode(datas: Iterable[bytes], prefix: str) -> tuple[list[Transaction], Undecodable | None]:
    """pgoutput rows (``data`` of a peek) → our transactions, in commit order. A transaction
    with no message of ``prefix`` is kept (empty): its end LSN still moves the slot.

    Decoding stops at the first message of ``prefix`` whose content cannot be decoded: the
    transactions before it are returned with it, its own transaction and what follows are
    not (never guessed, never skipped)."""
    transactions, undecodable = _scan(datas, prefix, stop=True)
    return transactions, undecodable[0] if undecodable else None


def _scan(
    datas: Iterable[bytes], prefix: str, *, stop: bool
) -> tuple[list[Transaction], list[Undecodable]]:
    """`decode`; without ``stop``, every transaction, and every undecodable message
    (an operator's count of what the slot holds)."""
    wanted = prefix.encode()
    out: list[Transaction] = []
    bad: list[Undecodable] = []
    messages: list[WalMessage] = []
    bad_here: list[tuple[int, str]] = []
    commit_time = 0.0
    for data in datas:
        kind = data[:1]
        if kind == b"B":
            # Int64 final LSN, Int64 commit time (µs since 2000-01-01), Int32 xid.
            (micros,) = struct.unpack_from(">q", data, 9)
            commit_time = _PG_EPOCH + micros / 1e6
            messages, bad_here = [], []
        elif kind == b"M":
            # Int8 flags, Int64 LSN, String prefix, Int32 length, Byte[n] content.
            end = data.index(b"\0", 10)
            if data[10:end] != wanted:
                continue
            (length,) = struct.unpack_from(">i", data, end + 1)
            content = data[end + 5 : end + 5 + length]
            (lsn,) = struct.unpack_from(">Q", data, 2)
            try:
                messages.extend(_messages(content))
            except Exception as exc:
                bad_here.append((lsn, repr(exc)[:200]))
        elif kind == b"C":
            # Int8 flags, Int64 commit LSN, Int64 end LSN, Int64 commit time.
            (end_lsn,) = struct.unpack_from(">Q", data, 10)
            bad.extend(Undecodable(lsn, end_lsn, error) for lsn, error in bad_here)
            if bad and stop:
                return out, bad
            out.append(Transaction(end_lsn, commit_time, messages))
            messages, bad_here = [], []
        # Other records (relations, origins, …) carry nothing for us.
    bad.extend(Undecodable(lsn, None, error) for lsn, error in bad_here)
    return out, bad


def _messages(content: bytes) -> list[WalMessage]:
    """One message's content; raises when it is not ours after all (another program using
    our prefix) or from a newer version: never guess."""
    document = json.loads(content)
    if not isinstance(document, dict) or document.get("v") != CONTENT_VERSION:
        version = document.get("v") if isinstance(document, dict) else None
        raise ValueError(f"content version {version!r}, this version reads {CONTENT_VERSION}")
    entries = document.get("m")
    if not isinstance(entries, list):
        raise ValueError("no message list")
    out = []
    for entry in entries:
        # id, broker, stream, type, key (or null), headers, payload: all text.
        if (
            not isinstance(entry, list)
            or len(entry) != 7
            or not all(isinstance(v, str) for i, v in enumerate(entry) if i != 4)
            or not (entry[4] is None or isinstance(entry[4], str))
        ):
            raise ValueError("malformed message entry")
        uuid.UUID(entry[0])
        out.append(WalMessage(*entry))
    return out


class WalSlot:
    """The slot and publication of one outbox, on one database."""

    def __init__(self, engine: AsyncEngine, slot_name: str, table_name: str) -> None:
        self.engine = engine
        self.name = slot_name
        self.publication = slot_name
        self.prefix = message_prefix(table_name)
        self.lock_key = f"fastapi_outbox.wal:{slot_name}"
        #: (process monotonic time, database clock in Unix seconds) at the last peek: ages
        #: of commit times are counted on the database's clock (see ``clock``).
        self.clock_at_peek: tuple[float, float] | None = None

    # -- checks and DDL (on any connection) -----------------------------------------------------

    async def _driver(self, conn: Any) -> Any:
        raw = await conn.get_raw_connection()
        return raw.driver_connection

    async def check_server(self, *, slot: bool = False) -> None:
        """Refuse a server whose ``wal_level`` is not ``logical`` (and, with ``slot``, a
        database where the slot was not created): messages emitted there would be lost."""
        async with self.engine.connect() as conn:
            driver = await self._driver(conn)
            version, level, exists = await driver.fetchrow(CHECK_SQL, self.name)
        check_ready(version, level, exists, self.name, slot=slot)

    async def create(self) -> bool:
        """Create the publication and the slot when missing; True when the slot was new.

        The slot sees only WAL written after it exists: create it before the first
        producer with ``capture="wal"`` commits (``db create`` / ``create_tables()``)."""
        await self.check_server()
        async with self.engine.connect() as conn:
            driver = await self._driver(conn)
            if not await driver.fetchval(PUBLICATION_EXISTS_SQL, self.publication):
                # No table: only the messages reach pgoutput's output.
                await driver.execute(f'CREATE PUBLICATION "{self.publication}"')
            if await driver.fetchval(SLOT_EXISTS_SQL, self.name):
                return False
            await driver.execute(CREATE_SLOT_SQL, self.name)
            logger.info(
                "replication slot created", extra={"action": "wal.slot_created", "slot": self.name}
            )
            return True

    async def drop(self) -> bool:
        """Drop the slot and its publication; False when there was no slot."""
        async with self.engine.connect() as conn:
            driver = await self._driver(conn)
            existed = bool(await driver.fetchval(SLOT_EXISTS_SQL, self.name))
            if existed:
                await driver.execute(DROP_SLOT_SQL, self.name)
            await driver.execute(f'DROP PUBLICATION IF EXISTS "{self.publication}"')
            return existed

    async def stats(self) -> SlotStats | None:
        """The slot's state and lag; None when it does not exist."""
        async with self.engine.connect() as conn:
            driver = await self._driver(conn)
            row = await driver.fetchrow(STATS_SQL, self.name)
        if row is None:
            return None
        return SlotStats(
            slot=self.name,
            wal_status=row["wal_status"],
            active_pid=row["active_pid"],
            lag_bytes=None if row["lag_bytes"] is None else int(row["lag_bytes"]),
            retained_bytes=None if row["retained_bytes"] is None else int(row["retained_bytes"]),
            safe_wal_size=None if row["safe_wal_size"] is None else int(row["safe_wal_size"]),
        )

    async def pending_messages(self, limit: int = 100_000) -> int:
        """Messages of our prefix the slot still holds (a peek: decodes WAL, not for a hot
        path; fails while a relay is reading the slot)."""
        return (await self.backlog(limit))[0]

    async def backlog(self, limit: int = 100_000) -> tuple[int, float | None]:
        """How many messages of our prefix the slot holds (reading at most about ``limit``
        pgoutput rows; undecodable ones included) and the commit time (Unix seconds) of the
        oldest decodable one; for operators (``status``, ``db drop-slot``): it decodes WAL,
        and fails with SQLSTATE 55006 while a relay is reading the slot at that very
        moment."""
        count, oldest, _ = await self._backlog(limit)
        return count, oldest

    async def _backlog(self, limit: int) -> tuple[int, float | None, Undecodable | None]:
        async with self.engine.connect() as conn:
            driver = await self._driver(conn)
            datas = await driver.fetch(PEEK_SQL, self.name, None, limit, self.publication)
        decoded, undecodable = _scan((r["data"] for r in datas), self.prefix, stop=False)
        transactions = [t for t in decoded if t.messages]
        count = sum(len(t.messages) for t in transactions) + len(undecodable)
        oldest = transactions[0].commit_time if transactions else None
        return count, oldest, undecodable[0] if undecodable else None

    async def _db_now(self) -> float:
        """The database's clock in Unix seconds (commit times are on it)."""
        async with self.engine.connect() as conn:
            driver = await self._driver(conn)
            return float(await driver.fetchval(DB_NOW_SQL))

    async def report(self) -> dict[str, Any]:
        """What operators see (``status``): the slot's state, lag and retained WAL, and
        its backlog of messages (None while a relay happens to be reading the slot)."""
        stats = await self.stats()
        out: dict[str, Any] = {"slot": self.name, "exists": stats is not None}
        if stats is None:
            return out
        out.update(dataclasses.asdict(stats))
        if stats.lost:  # invalidated: its messages cannot be read any more
            out["backlog_messages"] = out["oldest_unrelayed_age_seconds"] = None
            return out
        undecodable = None
        try:
            count, oldest, undecodable = await self._backlog(100_000)
        except Exception as exc:
            if getattr(exc, "sqlstate", None) != "55006":
                raise
            count, oldest = None, None
        out["backlog_messages"] = count
        # The first message of our prefix the relay cannot decode (it stops there).
        out["undecodable"] = None if undecodable is None else undecodable.describe(self.name)
        out["oldest_unrelayed_age_seconds"] = (
            None if oldest is None else round(max(0.0, await self._db_now() - oldest), 3)
        )
        return out

    # -- the relay's statements (on its dedicated asyncpg connection) ----------------------------

    async def prepare_session(self, driver: Any) -> None:
        """Settings of a relay's dedicated connection: a name for operators, and server-side
        TCP keepalives, so that the server notices a reader cut off by the network within
        about half a minute and releases its lock to a standby (the default would take
        the kernel's two hours)."""
        await driver.execute(SESSION_SQL)

    async def try_lock(self, driver: Any) -> bool:
        """Take the reader's session-level advisory lock (held until the connection ends)."""
        return bool(await driver.fetchval(TRY_LOCK_SQL, self.lock_key))

    async def peek(
        self, driver: Any, nchanges: int, window: int, timeout: float, *, bound: float
    ) -> Read:
        """Read up to about ``nchanges`` rows (whole transactions) of the WAL up to
        ``window`` bytes past the slot's confirmed position, without moving the slot.

        The read's ``upto_lsn`` is the nearer of the window's end and the WAL flush
        position taken *before* the read. The peek decodes every record that starts before
        its ``upto_lsn`` (it stops after the first record that ends at or past it, and waits
        for a record to be flushed whole before decoding it): when the read was not cut
        short by ``nchanges``, no commit before that bound was missed, and the slot may be
        confirmed up to it — over WAL without any message of ours too (a bulk load). Raises
        ``TimeoutError`` after ``timeout`` seconds (asyncpg cancels the read on the server).

        The positions are read first under ``bound`` (the relay's bound of an ordinary
        statement): it also waits for the server to acknowledge the cancel of a previous
        read that timed out."""
        boundary = await driver.fetchrow(BOUNDARY_SQL, self.name, timeout=bound)
        if boundary is not None:
            self.clock_at_peek = (time.monotonic(), float(boundary["db_now"]))
        if boundary is None or boundary["confirmed_lsn"] is None:
            raise exceptions.ConfigurationError(
                f"capture='wal': the replication slot {self.name!r} does not exist in this "
                "database (dropped?): run `fastapi-outbox db create` with capture='wal'"
            )
        flush_lsn = parse_lsn(boundary["flush_lsn"])
        confirmed = parse_lsn(boundary["confirmed_lsn"])
        window_end = confirmed + window
        upto = min(window_end, flush_lsn)
        rows = await driver.fetch(
            PEEK_SQL, self.name, upto, nchanges, self.publication, timeout=timeout
        )
        transactions, undecodable = decode((r["data"] for r in rows), self.prefix)
        complete = len(rows) < nchanges and undecodable is None
        return Read(
            confirmed=confirmed,
            transactions=transactions,
            nrows=len(rows),
            complete_upto=upto if complete else None,
            more=window_end < flush_lsn,
            undecodable=undecodable,
        )

    async def advance(self, driver: Any, lsn: int, timeout: float) -> None:
        """Confirm everything before ``lsn`` (never backwards)."""
        # asyncpg passes a pg_lsn as an integer.
        await driver.execute(ADVANCE_SQL, self.name, lsn, timeout=timeout)


def check_ready(version: int, level: str, exists: bool, slot_name: str, *, slot: bool) -> None:
    """Raise unless the server can carry ``capture="wal"`` (and, with ``slot``, the slot
    exists): PostgreSQL 14+ (pgoutput's ``messages`` option), ``wal_level=logical``."""
    if version < MIN_SERVER_VERSION:
        raise exceptions.ConfigurationError(
            f"capture='wal' needs PostgreSQL 14 or later (pgoutput's 'messages' option), "
            f"this server is {version // 10000}: use capture='table'"
        )
    if level != "logical":
        raise exceptions.ConfigurationError(
            f"capture='wal' needs PostgreSQL with wal_level=logical, this server has "
            f"wal_level={level}: {WAL_LEVEL_HINT} — or use capture='table'"
        )
    if slot and not exists:
        raise exceptions.ConfigurationError(
            f"capture='wal': the replication slot {slot_name!r} does not exist in this "
            "database, so messages written now would be lost: run `fastapi-outbox db create` "
            "(or await outbox.create_tables()) with capture='wal' first"
        )
