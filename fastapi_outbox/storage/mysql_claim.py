"""The claim on MariaDB and MySQL: what PostgreSQL's one ``UPDATE … RETURNING`` does, in
one transaction of two steps, since MySQL has no ``UPDATE … RETURNING``.

1. Per active status (``pending``, ``processing``, ``failed``), the due rows in claim
   order, ``FOR UPDATE SKIP LOCKED``, with their columns, the three in one ``UNION ALL``
   (`claim_candidates`): concurrent
   claimers lock disjoint rows. The three lists merged in claim order, ``limit`` kept,
   and the suspect rule of `claim`
   applied: the rows before the first suspect, or a suspect alone.
2. One ``UPDATE`` of the chosen ids
   (`claim_rows`): ``processing``, the
   claim token (the fence of every later change), the lease by the database's clock, one
   more attempt. The locks of step 1 hold until the commit, so no other claim can
   come between.

The transaction is READ COMMITTED (the engine's default on MySQL; see
`MYSQL_ISOLATION`): no gap locks, so producers keep
inserting while a claim holds its rows. Ordered claimers of one table and broker take
turns on a named lock (``GET_LOCK``), as PostgreSQL's take an advisory lock.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import Table, union_all
from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox.storage.statements import claims as claims_sql
from fastapi_outbox.storage.statements.parts import ACTIVE

__all__ = ["ORDERED_TURN_WAIT_SECONDS", "MysqlClaim"]

#: Longest wait of an ordered claimer for its turn (``GET_LOCK``'s timeout): a claimer that
#: does not get it claims nothing this time and asks again.
ORDERED_TURN_WAIT_SECONDS = 10


class MysqlClaim:
    """The claim of one outbox table on MySQL (caller: ``Claims.claim``)."""

    def __init__(self, engine: AsyncEngine, table: Table) -> None:
        self.engine = engine
        self.table = table
        self.dialect = engine.dialect
        self._statements: dict[tuple[str, int, bool], Any] = {}
        self._update = claims_sql.claim_rows(table, self.dialect)
        self._earliest: dict[str, Any] = {}
        digest = hashlib.sha1(table.name.encode(), usedforsecurity=False).hexdigest()[:16]
        self._lock_prefix = f"fastapi_outbox:{digest}"

    def _candidates(self, broker: str, limit: int, ordered: bool) -> Any:
        """One statement for the three statuses: a ``UNION ALL`` of a locking read each
        (one round trip; each part a range of the claim index in claim order)."""
        key = (broker, limit, ordered)
        stmt = self._statements.get(key)
        if stmt is None:
            stmt = self._statements[key] = union_all(
                *(
                    claims_sql.claim_candidates(
                        self.table, broker, limit, ordered, status, self.dialect
                    )
                    for status in ACTIVE
                )
            )
        return stmt

    def _turn(self, broker: str) -> tuple[Any, Any]:
        digest = hashlib.sha1(broker.encode(), usedforsecurity=False).hexdigest()[:16]
        return claims_sql.claim_turn(f"{self._lock_prefix}:{digest}", ORDERED_TURN_WAIT_SECONDS)

    async def claim(
        self, broker: str, limit: int, token: str, lease: Any, *, ordered: bool
    ) -> list[tuple[Any, ...]]:
        """Claim up to ``limit`` rows of ``broker`` for ``token``; the rows in claim order,
        each the claim's columns then the claim order's (as the PostgreSQL claim returns
        them)."""
        async with self.engine.connect() as conn:
            if not ordered:
                return await self._claim(conn, broker, limit, token, lease, ordered)
            take, give = self._turn(broker)
            got = (await conn.execute(take)).scalar()
            await conn.commit()  # the lock is the session's; the claim's transaction is next
            if got != 1:
                return []  # another ordered claimer's turn went on for too long
            try:
                return await self._claim(conn, broker, limit, token, lease, ordered)
            except BaseException:
                # The named lock is the session's: a connection whose release may not have
                # gone never returns to the pool.
                await conn.invalidate()
                raise
            finally:
                if not conn.invalidated:
                    await conn.execute(give)
                    await conn.commit()

    async def _claim(
        self, conn: Any, broker: str, limit: int, token: str, lease: Any, ordered: bool
    ) -> list[tuple[Any, ...]]:
        async with conn.begin():
            found = list((await conn.execute(self._candidates(broker, limit, ordered))).all())
            if not found:
                return []
            width = claims_sql.CLAIM_COLUMNS
            found.sort(key=lambda row: tuple(row[width + 1 :]))
            if ordered:
                found = await self._without_passed_by(conn, broker, found)
                if not found:
                    return []
            chosen = choose(found[:limit], suspect_at=width)
            await conn.execute(
                self._update, {"ids": [row[0] for row in chosen], "token": token, "lease": lease}
            )
        claimed = []
        for row in chosen:
            values = list(row)
            values[6] += 1  # attempts: the one this claim counted
            claimed.append((*values[:width], *values[width + 1 :]))
        return claimed

    async def _without_passed_by(self, conn: Any, broker: str, found: list[Any]) -> list[Any]:
        """Ordered: drop the candidates of a key whose earliest active row is not among
        them (``SKIP LOCKED`` passed it by; see ``claims_sql.earliest_active``). ``found``
        is in insert order; the result too."""
        keys = {row[3] for row in found if row[3] is not None}
        if not keys:
            return found
        stmt = self._earliest.get(broker)
        if stmt is None:
            stmt = self._earliest[broker] = claims_sql.earliest_active(self.table, broker)
        earliest = dict((await conn.execute(stmt, {"keys": sorted(keys)})).all())
        width = claims_sql.CLAIM_COLUMNS
        first_found: dict[str, Any] = {}
        for row in found:
            if row[3] is not None:
                first_found.setdefault(row[3], row[width + 1])
        return [
            row
            for row in found
            if row[3] is None or earliest.get(row[3], first_found[row[3]]) >= first_found[row[3]]
        ]


def choose(rows: list[Any], *, suspect_at: int) -> list[Any]:
    """The suspect rule of the claim (see
    `claim`): the rows before the first
    suspect (column ``suspect_at``), or the first row alone when it is the suspect."""
    for position, row in enumerate(rows):
        if row[suspect_at]:
            return rows[: max(position, 1)]
    return rows
