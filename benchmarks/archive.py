"""What ``OutboxSettings(archive=True)`` costs retention, on PostgreSQL.

* Plain table: ``--rows`` published rows past retention removed by the library's batched
  DELETE (``Retention.purge_batch``, the default retention) and moved by the archive's batched
  move (``Archive.move_batch``: ``WITH moved AS (DELETE … RETURNING …) INSERT INTO
  archive …``), both in batches of ``--batch`` rows; rows/s and WAL written per row
  (``pg_current_wal_lsn()`` difference: cluster-wide, so other activity on the server is
  included). The two alternate, round after round, on the same table refilled each round
  (``VACUUM`` between rounds, the archive emptied).
* Daily-partitioned table: one finished day of ``--rows`` rows dropped
  (``Maintainer.drop_expired``, the default retention) or re-attached to the archive
  (``Maintainer.archive_expired``: DETACH, ADD COLUMN archived_at with a catalogue
  default, ATTACH to the archive — no row copied); seconds per partition, alternating.

Fill: one ``INSERT … SELECT … generate_series`` (``benchmarks/scale.py``'s, UUIDv7-like
ids, ~80-byte payloads), not timed.

Run: ``.venv/bin/python benchmarks/archive.py [--rows 50000] [--batch 5000] [--rounds 3]``
(PostgreSQL on loopback; a throw-away database ``bench_archive_<random>``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import banner, bench_database, machine_note, table
from benchmarks.scale import fill_sql, run_sql, scalar

DAY = dt.timedelta(days=1)


def make_outbox(url: str, **overrides: Any) -> Any:
    from fastapi_outbox import Outbox, OutboxSettings
    from fastapi_outbox.brokers import MemoryBroker

    settings = OutboxSettings(
        run_relays=False,
        archive=True,
        published_retention_seconds=60.0,
        **overrides,
    )
    return Outbox(url, brokers={"default": MemoryBroker()}, settings=settings)


async def wal_lsn(outbox: Any) -> int:
    return int(await scalar(outbox, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))


async def timed_batches(outbox: Any, step: Any, batch: int) -> tuple[int, float, int]:
    """Run ``step(batch)`` until a batch comes back short: (rows, seconds, WAL bytes)."""
    wal = await wal_lsn(outbox)
    started = time.perf_counter()
    total = 0
    while True:
        n = await step(batch)
        total += n
        if n < batch:
            break
    seconds = time.perf_counter() - started
    return total, seconds, await wal_lsn(outbox) - wal


async def plain(url: str, rows: int, batch: int, rounds: int) -> list[list[Any]]:
    outbox = make_outbox(url, table_name="bench_plain")
    await outbox.create_tables()
    name, archive = outbox.table.name, outbox.archive.name
    results: dict[str, list[tuple[int, float, int]]] = {"delete": [], "move": []}
    steps = {
        "delete": lambda n: outbox.store.retention.purge_batch("published", 60.0, n),
        "move": lambda n: outbox.archive.move_batch("published", 60.0, n),
    }
    try:
        for _ in range(rounds):
            for mode in ("delete", "move"):
                await run_sql(outbox, fill_sql(name, "published", 0, rows, 1))
                await run_sql(outbox, f"VACUUM ANALYZE {name}", f"TRUNCATE {archive}")
                done, seconds, wal = await timed_batches(outbox, steps[mode], batch)
                assert done == rows, (mode, done)
                results[mode].append((done, seconds, wal))
    finally:
        await outbox.drop_tables()
        await outbox.aclose()
    out = []
    for mode, runs in results.items():
        rates = [n / s for n, s, _ in runs]
        wal_per_row = statistics.median(w / n for n, _, w in runs)
        out.append(
            [
                f"plain, batched {mode}",
                f"{statistics.median(rates):,.0f}",
                f"{min(rates):,.0f}-{max(rates):,.0f}",
                f"{wal_per_row:,.0f}",
            ]
        )
    return out


async def partitioned(url: str, rows: int, rounds: int) -> list[list[Any]]:
    from fastapi_outbox.storage import partitions

    results: dict[str, list[float]] = {"drop": [], "re-attach": []}
    for index in range(rounds):
        for mode in ("drop", "re-attach"):
            outbox = make_outbox(
                url, table_name=f"bench_parts_{index}_{mode[0]}", partitioning="daily"
            )
            await outbox.create_tables()
            name = outbox.table.name
            yesterday = (
                dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0) - DAY
            )
            try:
                async with outbox.engine.begin() as conn:
                    await conn.run_sync(
                        partitions.create_partition_sync, name, yesterday, yesterday + DAY
                    )
                await run_sql(outbox, fill_sql(name, "published", 0, rows, 1))
                await run_sql(outbox, f"VACUUM ANALYZE {name}")
                started = time.perf_counter()
                if mode == "drop":
                    done = await outbox.partitions.drop_expired(60.0, 60.0)
                else:
                    done = await outbox.partitions.archive_expired(outbox.archive.table, 60.0, 60.0)
                results[mode].append(time.perf_counter() - started)
                assert done == [partitions.partition_name(name, yesterday)], done
                if mode == "re-attach":
                    archived = await scalar(outbox, f"SELECT count(*) FROM {outbox.archive.name}")
                    assert archived == rows, archived
            finally:
                await outbox.drop_tables()
                await outbox.aclose()
    return [
        [
            f"daily partition of {rows:,} rows, {mode}",
            f"{statistics.median(seconds) * 1000:,.0f} ms",
            f"{min(seconds) * 1000:,.0f}-{max(seconds) * 1000:,.0f} ms",
        ]
        for mode, seconds in results.items()
    ]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine_note()}")
    async with bench_database("bench_archive") as url:
        banner(f"retention of {args.rows:,} published rows, batches of {args.batch:,}")
        print(
            table(
                ["layout, retention", "rows/s (median)", "range", "WAL bytes/row"],
                await plain(url, args.rows, args.batch, args.rounds),
            )
        )
        banner("retention of one finished partition")
        print(
            table(
                ["partition, retention", "time (median)", "range"],
                await partitioned(url, args.rows, args.rounds),
            )
        )
    print(f"machine after: {machine_note()}")


if __name__ == "__main__":
    asyncio.run(main())
