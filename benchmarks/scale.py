"""The outbox at scale: a plain table and a daily-partitioned one, each filled with up to
``--rows`` finished (published) rows spread over ``--days`` days.

Printed, for both layouts:

* the claim (500 rows, ``Store.claim``) and ``Store.stats`` (the health endpoint's counts)
  at 0, 1,000,000 and ``--rows`` done rows, medians in ms, and the plan of the claim on the
  partitioned table at full size;
* retention of the oldest day's rows (``rows / days``): by the library's batched DELETE on
  the plain table, by dropping the partition on the partitioned one — time, WAL written
  (``pg_current_wal_lsn()`` difference; the counter is cluster-wide, so concurrent activity
  on the same server is included), table size afterwards, and the dispatch rate (a
  dispatcher with default settings draining a backlog to Redis) before and while the
  retention runs.

Fill method: one ``INSERT … SELECT … FROM generate_series`` statement per step and layout,
UUIDv7-like ids (time-ordered, like the library's), ~80-byte JSON payloads.

Run: ``.venv/bin/python benchmarks/scale.py [--rows 10000000] [--days 10] [--quick]``
(PostgreSQL and Redis on loopback; a throw-away database ``bench_scale_<random>``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import REDIS_URL, banner, bench_database, loopback, machine_note, table

CLAIM = 500
PENDING = 20_000
PAYLOAD = '{"order_id": 12345, "customer": "c-0001", "total": 99.5, "currency": "EUR"}'
DAY = dt.timedelta(days=1)


def midnight(at: dt.datetime) -> dt.datetime:
    return at.replace(hour=0, minute=0, second=0, microsecond=0)


#: Heap order of the done rows: ``time`` (oldest first, as a fresh table fills: one day's
#: rows are contiguous) or ``interleaved`` (every page holds rows of every day: the steady
#: state of a table whose DELETE-based retention frees space that new rows then reuse).
ORDERS = ("time", "interleaved")


def fill_sql(
    table_name: str, status: str, first: int, count: int, days: int, order: str = "time", **kw: Any
) -> str:
    """Rows ``first .. first + count`` of a fill: done rows spread evenly over the ``days``
    calendar days before today, created at a second of their day and published at the same
    instant, in heap order ``order`` (see :data:`ORDERS`); pending rows created and due now.
    Ids are UUIDv7-like: the creation time in milliseconds, then hash bits."""
    if status == "published" and order == "interleaved":
        created = (
            f"(date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' "
            f"- make_interval(days => 1 + g % {days}) "
            f"+ make_interval(secs => (g / {days}) % 86000))"
        )
        published = created
    elif status == "published":
        per_day = -(-count // days)
        index = f"(g - {first})"
        created = (
            f"(date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' "
            f"- make_interval(days => {days} - {index} / {per_day}) "
            f"+ make_interval(secs => ({index} % {per_day}) * 86000.0 / {per_day}))"
        )
        published = created
    else:
        created, published = "now()", "NULL"
    uuid7 = (
        "(lpad(to_hex((extract(epoch FROM c) * 1000)::bigint), 12, '0') || '7' "
        "|| substr(md5(g::text), 1, 3) || '8' || substr(md5(g::text), 4, 15))::uuid"
    )
    return (
        f"INSERT INTO {table_name} (id, broker, stream, type, key, payload, headers, status, "
        "attempts, next_attempt_at, created_at, published_at) "
        f"SELECT {uuid7}, 'default', '{kw.get('stream', 'orders')}', 'OrderPlaced', "
        f"(g % 1000)::text, '{PAYLOAD}'::jsonb, '{{}}'::jsonb, '{status}', "
        f"{1 if status == 'published' else 0}, c, c, {published} "
        f"FROM (SELECT g, {created} AS c FROM generate_series({first}, {first + count - 1}) g) s"
    )


async def run_sql(outbox: Any, *statements: str) -> None:
    async with outbox.engine.connect() as conn:
        auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
        for statement in statements:
            await auto.exec_driver_sql(statement)


async def scalar(outbox: Any, statement: str) -> Any:
    async with outbox.engine.connect() as conn:
        return (await conn.exec_driver_sql(statement)).scalar()


async def scalar_rows(outbox: Any, statement: str) -> list[Any]:
    async with outbox.engine.connect() as conn:
        return list((await conn.exec_driver_sql(statement)).all())


async def measure(outbox: Any, rounds: int = 60) -> tuple[float, float]:
    """Median ms of a 500-row claim (released again, so the pending rows stay) and of
    ``Store.stats``."""
    store = outbox.store
    claims, stats = [], []
    for n in range(rounds + 5):
        token = f"bench:{n}"
        t0 = time.perf_counter()
        rows = await store.claim("default", CLAIM, token, 30.0)
        elapsed = (time.perf_counter() - t0) * 1000
        await store.release([r.id for r in rows], token)
        t0 = time.perf_counter()
        await store.stats(["default"])
        if n >= 5:  # warm-up: prepared statements, custom plans
            claims.append(elapsed)
            stats.append((time.perf_counter() - t0) * 1000)
    return statistics.median(claims), statistics.median(stats)


async def claim_plan(outbox: Any) -> list[str]:
    store = outbox.store
    stmt = store.claim_statement("default", CLAIM, False)
    sql, args = store.connector.compile("plan", stmt, store.claim_params("plan", 30.0))
    async with store.connector.driver_connection() as driver:
        return [r[0] for r in await driver.fetch("EXPLAIN (COSTS OFF) " + sql, *args)]


async def size(outbox: Any) -> int:
    name = outbox.table.name
    if outbox.partitions is None:
        return int(await scalar(outbox, f"SELECT pg_total_relation_size('{name}')"))
    return int(
        await scalar(
            outbox,
            "SELECT coalesce(sum(pg_total_relation_size(i.inhrelid)), 0) FROM pg_inherits i "
            f"WHERE i.inhparent = '{name}'::regclass",
        )
    )


async def explained_purge(
    outbox: Any, retention_seconds: float, batch_size: int
) -> tuple[int, int]:
    """``retention.purge``'s loop — the library's own DELETE (``Store.purge_statement``), the
    same batches and pause — with each batch run under ``EXPLAIN (ANALYZE, WAL)``: returns
    the rows deleted and the WAL bytes these statements wrote (not the rest of the cluster)."""
    from fastapi_outbox.relay.retention import BATCH_PAUSE_SECONDS

    dialect = outbox.engine.dialect
    deleted = wal = 0
    while True:
        stmt = outbox.store.purge_statement("published", retention_seconds, batch_size)
        sql = str(stmt.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
        async with outbox.engine.connect() as conn:
            auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
            result = await auto.exec_driver_sql(f"EXPLAIN (ANALYZE, WAL, FORMAT JSON) {sql}")
            plan = result.scalar_one()
        top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
        child = top["Plans"][0]
        n = int(child["Actual Rows"] * child["Actual Loops"])
        deleted += n
        wal += int(top.get("WAL Bytes", 0))
        if n < batch_size:
            return deleted, wal
        await asyncio.sleep(BATCH_PAUSE_SECONDS)


async def retention_under_load(
    outbox: Any, dispatcher: Any, cutoff: dt.datetime, backlog: int
) -> dict[str, Any]:
    """Drain ``backlog`` rows with ``dispatcher`` (default settings, Redis); after a
    baseline window, run the retention of ``outbox`` and measure it."""
    name = outbox.table.name
    stream = f"bench_scale_{name}"
    await run_sql(outbox, fill_sql(name, "pending", 50_000_000, backlog, 1, stream=stream))
    out: dict[str, Any] = {}
    async with dispatcher.dispatcher():
        processor = dispatcher.processors["default"]
        await asyncio.sleep(1.0)  # warm-up: claims grow to batch_size
        n0, t0 = processor.published_total, time.perf_counter()
        await asyncio.sleep(4.0)
        out["rate_before"] = (processor.published_total - n0) / (time.perf_counter() - t0)
        # Retention of the rows finished before ``cutoff``: exactly the oldest day (its
        # rows end 400 s before midnight; 2 s of margin for the clocks).
        retention_seconds = (dt.datetime.now(dt.UTC) - cutoff).total_seconds() + 2
        out["size_before"] = await size(outbox)
        lsn0 = await scalar(outbox, "SELECT pg_current_wal_lsn()::text")
        n0, t0 = processor.published_total, time.perf_counter()
        if outbox.partitions is None:
            deleted, out["own_wal"] = await explained_purge(
                outbox, retention_seconds, outbox.settings.cleanup_batch_size
            )
            out["what"] = f"batched DELETE of {deleted:,} rows"
        else:
            dropped = await outbox.partitions.drop_expired(retention_seconds, None)
            out["own_wal"] = None  # DDL: no EXPLAIN; see the cluster-wide window
            deleted = await outbox.store.purge_batch("published", retention_seconds, 5000)
            out["what"] = f"DROP of {', '.join(dropped) or 'nothing'} (+{deleted} rows deleted)"
        out["seconds"] = time.perf_counter() - t0
        published = processor.published_total - n0
        out["wal"] = await scalar(
            outbox, f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn0}')::bigint"
        )
        out["rate_during"] = published / out["seconds"] if out["seconds"] >= 1.0 else None
        out["backlog_left"] = await outbox.store.count("pending")
    out["size_after"] = await size(outbox)
    await run_sql(outbox, f"VACUUM {name}")
    out["size_after_vacuum"] = await size(outbox)
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS_URL)
    await client.delete(stream)
    await client.aclose()
    return out


def mb(value: float) -> str:
    return f"{value / 1e6:,.1f} MB"


async def main(rows: int, days: int, backlog: int, order: str) -> None:
    from fastapi_outbox import Outbox, OutboxSettings
    from fastapi_outbox.brokers import RedisStreamsBroker

    loopback(REDIS_URL)
    banner(
        f"outbox at scale: {rows:,} done rows over {days} days, heap order {order} "
        f"({machine_note()})"
    )
    # Retention keeps days - 1 calendar days: the oldest day is past it.
    now = dt.datetime.now(dt.UTC)
    cutoff = midnight(now) - (days - 1) * DAY
    retention_seconds = (now - cutoff).total_seconds() + 3600  # the settings: any value
    steps = sorted({0, rows, *(n for n in (1_000_000,) if n <= rows)})
    results: dict[str, dict[int, tuple[float, float]]] = {}
    fills: dict[str, float] = {}
    retention_results: dict[str, dict[str, Any]] = {}
    async with bench_database("bench_scale") as url:
        for layout, partitioning in (("plain", None), ("partitioned daily", "daily")):
            name = "plain_outbox" if partitioning is None else "parted_outbox"
            settings = OutboxSettings(
                table_name=name,
                partitioning=partitioning,
                run_dispatchers=False,
                published_retention_seconds=retention_seconds,
                abandoned_retention_seconds=None,
            )
            outbox = Outbox(url, settings=settings)
            dispatcher = Outbox(
                url,
                brokers={"default": RedisStreamsBroker(REDIS_URL, maxlen=10_000, dedup="off")},
                settings=OutboxSettings(
                    table_name=name,
                    published_retention_seconds=None,
                    abandoned_retention_seconds=None,
                ),
            )
            try:
                await outbox.create_tables()
                if outbox.partitions is not None:
                    async with outbox.engine.begin() as conn:
                        from fastapi_outbox.storage import partitions

                        for d in range(1, days + 1):
                            lo = midnight(now) - d * DAY
                            await conn.run_sync(
                                partitions.create_partition_sync, name, lo, lo + DAY
                            )
                await run_sql(outbox, fill_sql(name, "pending", 1, PENDING, days))
                results[layout] = {}
                done = 0
                for step in steps:
                    if step > done:
                        t0 = time.perf_counter()
                        await run_sql(
                            outbox,
                            fill_sql(name, "published", done + 1, step - done, days, order),
                        )
                        fills[f"{layout} {done:,} → {step:,}"] = time.perf_counter() - t0
                        done = step
                        await outbox.engine.dispose()  # plans made against the new size
                    # Steady state: autovacuum has cleaned the previous step's claims.
                    await run_sql(outbox, f"VACUUM ANALYZE {name}")
                    results[layout][step] = await measure(outbox)
                    print(
                        f"{layout}: {step:,} done rows: claim {results[layout][step][0]:.2f} ms,"
                        f" stats {results[layout][step][1]:.2f} ms",
                        flush=True,
                    )
                if outbox.partitions is not None:
                    plan = await claim_plan(outbox)
                    print(f"\nclaim plan, partitioned table, {done:,} done rows:")
                    print("\n".join(f"   {line}" for line in plan))
                    empty = {
                        row[0]
                        for row in (
                            await scalar_rows(
                                outbox,
                                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON "
                                f"c.oid = i.inhrelid WHERE i.inhparent = '{name}'::regclass "
                                "AND c.reltuples <= 0",
                            )
                        )
                    }
                    seq = [line.split()[-2] for line in plan if "Seq Scan on" in line]
                    bad = [p for p in seq if p not in empty]
                    print(
                        f"sequential scans: {bad or 'none'} on partitions holding rows "
                        f"(on empty ones: {sorted(set(seq) & empty)})\n"
                    )
                r = await retention_under_load(outbox, dispatcher, cutoff, backlog)
                retention_results[layout] = r
                print(f"{layout}: retention {r}", flush=True)
            finally:
                await dispatcher.aclose()
                await outbox.aclose()

    print()
    print(table(["fill step", "seconds"], [[k, f"{v:.1f}"] for k, v in fills.items()]))
    print()
    print(
        table(
            [
                "layout",
                *(f"claim ms @ {s:,}" for s in steps),
                *(f"stats ms @ {s:,}" for s in steps),
            ],
            [
                [
                    layout,
                    *(f"{r[s][0]:.2f}" for s in steps),
                    *(f"{r[s][1]:.2f}" for s in steps),
                ]
                for layout, r in results.items()
            ],
        )
    )
    print()
    print(
        table(
            [
                "retention of one day",
                "what",
                "seconds",
                "WAL of the retention",
                "cluster WAL in the window",
                "size before",
                "after",
                "after VACUUM",
                "dispatch msg/s before",
                "during",
            ],
            [
                [
                    layout,
                    r["what"],
                    f"{r['seconds']:.2f}",
                    "-" if r["own_wal"] is None else mb(r["own_wal"]),
                    mb(r["wal"]),
                    mb(r["size_before"]),
                    mb(r["size_after"]),
                    mb(r["size_after_vacuum"]),
                    f"{r['rate_before']:,.0f}",
                    "-" if r["rate_during"] is None else f"{r['rate_during']:,.0f}",
                ]
                for layout, r in retention_results.items()
            ],
        )
    )
    for layout, r in retention_results.items():
        if r["backlog_left"] == 0:
            print(f"note: {layout}: the backlog ran out during the retention")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="done rows at the end")
    parser.add_argument("--days", type=int, default=10, help="days the done rows span")
    parser.add_argument(
        "--backlog", type=int, default=600_000, help="pending rows drained during retention"
    )
    parser.add_argument(
        "--order", choices=ORDERS, default="time", help="heap order of the done rows"
    )
    parser.add_argument("--quick", action="store_true", help="200,000 rows: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.days, args.backlog = 200_000, 4, 100_000
    asyncio.run(main(args.rows, args.days, args.backlog, args.order))
