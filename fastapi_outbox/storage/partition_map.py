"""Where the rows of a table partitioned by id are, for the relay's hot statements.

A generic plan on a partitioned table (PostgreSQL 15) locks every partition at each
execution, and initialises a scan of each partition before it prunes on a value the plan
computes itself (an init plan): pruned scans are "never executed" but cost their set-up,
34 times per claim and per mark on a month of daily partitions. A value passed as the
statement's own parameter is pruned *before* the scans are set up. Two uses of that, both
by `Claims` on asyncpg:

* **The claim's floor.** The unordered claim takes ``id >= $floor`` (its candidate scan
  and its update), the start of the oldest range partition that holds a row of the
  broker still needing work, read by one probe of each partition's partial due index
  (`PartitionMap.refresh`). Only the partitions from the floor up (and DEFAULT) are
  set up. A row can only become active below the floor later by a ``replay`` or a
  producer whose clock runs a partition late: the floor is used only while the claims
  come back full (a drain) and at most `FLOOR_SECONDS` after it was read; the claim
  after a short one, or after that time, has no floor (the nil UUID: nothing pruned). So
  such a row waits for the end of the drain, or `FLOOR_SECONDS` at most.
* **A batch's partition.** The marks after a publish (and the release, the lease
  extension) of a batch whose ids all lie in one range partition run on that partition
  itself: a plain table's statement. A batch across a boundary, or in ids no known range
  covers, takes the partitioned table. A partition is dropped or detached only when none
  of its rows needs work (`fastapi_outbox.storage.partitions`), so a batch in flight
  never loses its partition; should the statement find the partition gone anyway, the
  store forgets the ranges and runs it on the partitioned table.

The ranges are read with the floor; only for a table whose partition key is ``id``
(a table partitioned by ``created_at`` by an earlier release keeps the plain statements).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
import uuid
from collections.abc import Sequence

from sqlalchemy import Column, MetaData, Table
from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox.storage import partitions
from fastapi_outbox.storage.statements import partitions as sql

__all__ = ["FLOOR_SECONDS", "NIL", "PartitionMap", "Range"]

#: The floor of no pruning: every id is at or above it.
NIL = uuid.UUID(int=0)
#: A floor is used this long at most after it was read (seconds).
FLOOR_SECONDS = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """A range partition: ids in ``[lo, hi)``."""

    name: str
    lo: uuid.UUID
    hi: uuid.UUID


@dataclasses.dataclass(slots=True)
class _Floor:
    value: uuid.UUID
    read_at: float


class PartitionMap:
    """The id ranges of one partitioned table's partitions and each broker's claim floor."""

    def __init__(self, engine: AsyncEngine, table: Table) -> None:
        self.engine = engine
        self.table = table
        self._ranges: list[Range] = []
        self._starts: list[uuid.UUID] = []
        self._default: str | None = None
        #: None until read; False: not partitioned by id (nothing here applies).
        self._by_id: bool | None = None
        self._floors: dict[str, _Floor] = {}
        self._wanted: set[str] = set()
        self._tables: dict[str, Table] = {}

    # -- the claim's floor ---------------------------------------------------------------

    def floor(self, broker: str) -> uuid.UUID:
        """The floor of ``broker``'s next claim: `NIL` unless one was read less
        than `FLOOR_SECONDS` ago and the claims since came back full."""
        floor = self._floors.get(broker)
        if floor is None or time.monotonic() - floor.read_at > FLOOR_SECONDS:
            return NIL
        return floor.value

    async def next_floor(self, broker: str) -> uuid.UUID:
        """The floor of ``broker``'s next claim (`floor`), read first when the last
        claim asked for it (`claimed`)."""
        if broker in self._wanted:
            self._wanted.discard(broker)
            await self.refresh(broker)
        return self.floor(broker)

    def claimed(self, broker: str, floor: uuid.UUID, full: bool) -> None:
        """After a claim with ``floor``: a short claim drops the floor (the next one sees
        every partition); a full claim without one (a drain is running) has the next claim
        read it first."""
        if not full:
            self._floors.pop(broker, None)
        elif floor == NIL and self._by_id is not False:
            self._wanted.add(broker)

    async def refresh(self, broker: str) -> None:
        """Read the ranges and ``broker``'s floor (one statement each)."""
        async with self.engine.connect() as conn:
            if self._by_id is None:
                key = await conn.run_sync(partitions.partition_key, self.table.name)
                if key is None:  # no table yet (created later): asked again next time
                    return
                self._by_id = key == sql.KEY_ID
            if not self._by_id:
                return
            found = await conn.run_sync(partitions.list_partitions, self.table.name)
            self._set_ranges(found)
            names = [r.name for r in self._ranges]
            if self._default is not None:
                names.append(self._default)
            active = set()
            if names:
                stmt = sql.active_partitions(names)
                active = {n for (n,) in (await conn.execute(stmt, {"broker": broker})).all()}
            await conn.rollback()
        self._floors[broker] = _Floor(self._floor_of(active), time.monotonic())

    def _set_ranges(self, found: Sequence[partitions.Partition]) -> None:
        ranges = [
            Range(p.name, sql.id_bound(p.start), sql.id_bound(p.end))
            for p in found
            if not p.is_default and p.start is not None and p.end is not None
        ]
        self._ranges = sorted(ranges, key=lambda r: r.lo)
        self._starts = [r.lo for r in self._ranges]
        self._default = next((p.name for p in found if p.is_default), None)

    def _floor_of(self, active: set[int]) -> uuid.UUID:
        """The start of the oldest range partition in ``active`` (positions in
        ``self._ranges``, DEFAULT last); `NIL` when DEFAULT holds such a row (its
        ids may lie anywhere) or none does."""
        if not active or len(self._ranges) in active:
            return NIL
        return self._ranges[min(active)].lo

    # -- a batch's partition ---------------------------------------------------------------

    def partition_of(self, ids: Sequence[uuid.UUID]) -> Table | None:
        """The range partition holding every id of ``ids`` (as a table to build a plain
        statement on), None when they span partitions or no known range holds them."""
        if not self._ranges or not ids:
            return None
        lo, hi = min(ids), max(ids)
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0 or hi >= self._ranges[i].hi:
            return None
        return self._table(self._ranges[i].name)

    def _table(self, name: str) -> Table:
        found = self._tables.get(name)
        if found is None:
            columns = [
                Column(c.name, c.type, key=c.key, primary_key=c.primary_key)
                for c in self.table.columns
            ]
            found = self._tables[name] = Table(name, MetaData(), *columns)
        return found

    def forget(self) -> None:
        """A partition was not found: ranges and floors are read again at the next drain."""
        self._ranges, self._starts, self._default = [], [], None
        self._floors.clear()
        self._tables.clear()
