"""Tables: what a drain costs per message on a plain outbox table and on a daily-partitioned
one, in one run, alternating rounds — the per-message input of the scaling guide
(docs/how-to/scaling.md) for partitioned tables.

Both tables live in the run's own database: ``outbox_messages`` (plain) and
``outbox_parted`` (``partitioning="daily"``: the partitions ``create_tables()`` makes — the
DEFAULT one, today and the coming days — plus ``--days-back`` empty daily partitions
before today, as a table keeping a week of messages has). One group of ``fastapi-outbox
dispatch`` processes (``benchmarks.bench_app``, default settings) per table, both up for the
whole run; each round inserts a backlog into one table (``dispatch.py``'s drain: one
``INSERT … SELECT``, rows due now, so in today's partition) and waits until it is published.
Prints msg/s, the relay's and the PostgreSQL backends' CPU µs per message (``/proc``).

    python benchmarks/tables.py                  # 30,000 rows x 4 rounds, Redis
    python benchmarks/tables.py --broker nats --days-back 30
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    BROKER_URLS,
    asyncpg_dsn,
    banner,
    bench_database,
    fmt,
    loopback,
    machine_note,
    median,
    processes,
    table,
)
from benchmarks.dispatch import TABLE, Brokers, Drain, Group, drain, start_library

PARTED = "outbox_parted"


async def add_past_partitions(db_url: str, days: int) -> int:
    """``days`` empty daily partitions before today's; returns the table's partition count."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from fastapi_outbox.storage import partitions

    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
            for back in range(1, days + 1):
                lo = today - dt.timedelta(days=back)
                await conn.run_sync(
                    partitions.create_partition_sync, PARTED, lo, lo + dt.timedelta(days=1)
                )
        async with engine.connect() as conn:
            count = await conn.scalar(
                text("SELECT count(*) FROM pg_inherits WHERE inhparent = CAST(:t AS regclass)"),
                {"t": PARTED},
            )
        return int(count or 0)
    finally:
        await engine.dispose()


async def run(args: argparse.Namespace, workdir: Path) -> list[list[Any]]:
    import asyncpg

    from fastapi_outbox import Outbox, OutboxSettings
    from fastapi_outbox.relay.wakeups import channel_name

    url = loopback(BROKER_URLS[args.broker])
    async with bench_database("bench_tables") as db_url:
        os.environ["BENCH_DATABASE_URL"] = db_url
        from benchmarks import bench_app

        await bench_app.create_schema()
        await bench_app.outbox.engine.dispose()
        parted = Outbox(db_url, settings=OutboxSettings(table_name=PARTED, partitioning="daily"))
        await parted.create_tables()
        await parted.aclose()
        count = await add_past_partitions(db_url, args.days_back)
        print(f"  {PARTED}: {count} partitions (DEFAULT included)", flush=True)
        brokers = Brokers()
        await brokers.connect([args.broker])
        conn = await asyncpg.connect(asyncpg_dsn(db_url))
        results: dict[str, list[Drain]] = {}
        try:
            with processes() as procs:
                groups = []
                for label, name, env in (
                    ("plain", TABLE, {}),
                    (
                        f"daily partitions ({count})",
                        PARTED,
                        {"OUTBOX_TABLE_NAME": PARTED, "OUTBOX_PARTITIONING": "daily"},
                    ),
                ):
                    started = start_library(
                        procs,
                        f"tables_{name}",
                        db_url,
                        url,
                        "lib",
                        workdir,
                        count=1,
                        settings=env,
                    )
                    groups.append(Group(label, "library", "lib", started, table=name))
                    results[label] = []
                for g in groups:  # warm-up
                    await drain(conn, brokers, args.broker, g, 2000, channel_name(g.table))
                for r in range(args.rounds):
                    for g in groups if r % 2 == 0 else groups[::-1]:
                        res = await drain(
                            conn, brokers, args.broker, g, args.backlog, channel_name(g.table)
                        )
                        results[g.label].append(res)
                        print(
                            f"  round {r + 1} {g.label:24s} {res.rate:8,.0f} msg/s"
                            f"  relay {res.relay_us:5.1f}  pg {res.pg_us:5.1f} us/msg  {res.check}",
                            flush=True,
                        )
        finally:
            await conn.close()
            await brokers.close()
    base = median(d.rate for d in results["plain"])
    return [
        [
            label,
            fmt(median(d.rate for d in got)),
            f"{median(d.rate for d in got) / base:.2f}",
            fmt(median(d.relay_us for d in got), 1),
            fmt(median(d.pg_us for d in got), 1),
        ]
        for label, got in results.items()
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--broker", choices=["redis", "nats"], default="redis")
    p.add_argument("--backlog", type=int, default=30_000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--days-back", type=int, default=7, help="empty daily partitions before today")
    p.add_argument("--quick", action="store_true", help="5,000 rows, 2 rounds")
    args = p.parse_args()
    if args.quick:
        args.backlog, args.rounds = 5_000, 2
    print(f"tables benchmark: {args.backlog:,} rows x {args.rounds} rounds; {machine_note()}")
    workdir = Path(tempfile.mkdtemp(prefix="bench_tables_"))
    started = time.monotonic()
    try:
        rows = asyncio.run(run(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    banner(f"drain to {args.broker}, one relay process per table, medians")
    print(table(["table", "msg/s", "vs plain", "relay us/msg", "PostgreSQL us/msg"], rows))
    print(f"\nfinished in {time.monotonic() - started:.0f} s; {machine_note()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
