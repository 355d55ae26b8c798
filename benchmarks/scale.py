"""The outbox at scale: a plain table and a daily-partitioned one, each filled with up to
``--rows`` finished (published) rows spread over ``--days`` days.

Printed, for both layouts:

* the claim (500 rows, ``Claims.claim``) and ``Messages.stats`` (the health endpoint's counts)
  at 0, 1,000,000 and ``--rows`` done rows, medians in ms, and the plan of the claim on the
  partitioned table at full size;
* retention of the oldest day's rows (``rows / days``): by the library's batched DELETE on
  the plain table, by dropping the partition on the partitioned one — time, WAL written
  (``pg_current_wal_lsn()`` difference; the counter is cluster-wide, so concurrent activity
  on the same server is included), table size afterwards, and the dispatch rate (a
  relay with default settings draining a backlog to Redis) before and while the
  retention runs.

With ``--dispatch`` (instead of the above): dispatch from a plain table and from a table
partitioned by day (by id: see ``fastapi_outbox.storage.partitions``) holding ``--days``
partitions (30 by default) of ``--rows`` done rows (3,000,000 by default, so a run takes ~10
minutes on a loaded 2-core machine), in ``--rounds`` alternating rounds (the layout going
first alternates): each round a default relay drains ``--dispatch-backlog`` pending rows
to Redis, msg/s from its first mark to its last. Then, per layout, the plans of a 500-row
claim and of its mark as a relay runs them once its prepared statements use a generic
plan (forced: the worst case for pruning), ``EXPLAIN (ANALYZE, BUFFERS)``, rolled back; scans
of other partitions that never ran are counted, not printed. ``--statements DATA_DIR``: on a
private server (``BENCH_PG_URL``) with ``pg_stat_statements`` preloaded (``track = all``,
``track_planning = on``), whose data directory this process can read: each round also prints
the statements of its drain (calls, execution and planning ms, rows, buffers; reset before
the drain), the relay's and the whole server's CPU per message, and the autovacuum and
autoanalyze runs on the table meanwhile.

Fill method: one ``INSERT … SELECT … FROM generate_series`` statement per step and layout,
UUIDv7-like ids (time-ordered, like the library's), ~80-byte JSON payloads.

Run: ``.venv/bin/python benchmarks/scale.py [--rows 10000000] [--days 10] [--quick]``, or
``.venv/bin/python benchmarks/scale.py --dispatch [--days 30] [--rows 3000000] [--rounds 7]
[--statements DATA_DIR]`` (PostgreSQL and Redis on loopback; a throw-away database
``bench_scale_<random>``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    REDIS_URL,
    banner,
    bench_database,
    loopback,
    machine_note,
    proc_cpu,
    table,
)

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
    ``Messages.stats``."""
    store = outbox.store
    claims, stats = [], []
    for n in range(rounds + 5):
        token = f"bench:{n}"
        t0 = time.perf_counter()
        rows = await store.claims.claim("default", CLAIM, token, 30.0)
        elapsed = (time.perf_counter() - t0) * 1000
        await store.claims.release([r.id for r in rows], token)
        t0 = time.perf_counter()
        await store.messages.stats(["default"])
        if n >= 5:  # warm-up: prepared statements, custom plans
            claims.append(elapsed)
            stats.append((time.perf_counter() - t0) * 1000)
    return statistics.median(claims), statistics.median(stats)


async def claim_plan(outbox: Any) -> list[str]:
    store = outbox.store
    stmt = store.claims.claim_statement("default", CLAIM, False)
    sql, args = store.connector.compile("plan", stmt, store.claims.claim_params("plan", 30.0))
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
    """``retention.purge``'s loop — the library's own DELETE (``Retention.purge_statement``), the
    same batches and pause — with each batch run under ``EXPLAIN (ANALYZE, WAL)``: returns
    the rows deleted and the WAL bytes these statements wrote (not the rest of the cluster)."""
    from fastapi_outbox.lifecycle.retention import BATCH_PAUSE_SECONDS

    dialect = outbox.engine.dialect
    deleted = wal = 0
    while True:
        stmt = outbox.store.retention.purge_statement("published", retention_seconds, batch_size)
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
    outbox: Any, relay: Any, cutoff: dt.datetime, backlog: int
) -> dict[str, Any]:
    """Drain ``backlog`` rows with ``relay`` (default settings, Redis); after a
    baseline window, run the retention of ``outbox`` and measure it."""
    name = outbox.table.name
    stream = f"bench_scale_{name}"
    await run_sql(outbox, fill_sql(name, "pending", 50_000_000, backlog, 1, stream=stream))
    out: dict[str, Any] = {}
    async with relay.relaying():
        table_relay = relay.relays.tables["default"]
        await asyncio.sleep(1.0)  # warm-up: claims grow to batch_size
        n0, t0 = table_relay.published_total, time.perf_counter()
        await asyncio.sleep(4.0)
        out["rate_before"] = (table_relay.published_total - n0) / (time.perf_counter() - t0)
        # Retention of the rows finished before ``cutoff``: exactly the oldest day (its
        # rows end 400 s before midnight; 2 s of margin for the clocks).
        retention_seconds = (dt.datetime.now(dt.UTC) - cutoff).total_seconds() + 2
        out["size_before"] = await size(outbox)
        lsn0 = await scalar(outbox, "SELECT pg_current_wal_lsn()::text")
        n0, t0 = table_relay.published_total, time.perf_counter()
        if outbox.partitions is None:
            deleted, out["own_wal"] = await explained_purge(
                outbox, retention_seconds, outbox.settings.cleanup_batch_size
            )
            out["what"] = f"batched DELETE of {deleted:,} rows"
        else:
            dropped = await outbox.partitions.drop_expired(retention_seconds, None)
            out["own_wal"] = None  # DDL: no EXPLAIN; see the cluster-wide window
            deleted = await outbox.store.retention.purge_batch("published", retention_seconds, 5000)
            out["what"] = f"DROP of {', '.join(dropped) or 'nothing'} (+{deleted} rows deleted)"
        out["seconds"] = time.perf_counter() - t0
        published = table_relay.published_total - n0
        out["wal"] = await scalar(
            outbox, f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn0}')::bigint"
        )
        out["rate_during"] = published / out["seconds"] if out["seconds"] >= 1.0 else None
        out["backlog_left"] = await outbox.store.messages.count("pending")
    out["size_after"] = await size(outbox)
    await run_sql(outbox, f"VACUUM {name}")
    out["size_after_vacuum"] = await size(outbox)
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS_URL)
    await client.delete(stream)
    await client.aclose()
    return out


def _literal(value: Any) -> str:
    """A bound value as an untyped SQL literal (``EXECUTE`` of a prepared statement)."""
    if value is None:
        return "NULL"
    if isinstance(value, list):
        value = "{" + ",".join(str(v) for v in value) + "}"
    elif isinstance(value, dt.timedelta):
        value = f"{value.total_seconds()} seconds"
    return "'" + str(value).replace("'", "''") + "'"


async def explain_generic(outbox: Any, sql: str, args: list[Any]) -> list[str]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of ``sql`` as a relay runs it once its prepared
    statement switched to a generic plan (forced here: the worst case for pruning),
    executed in a transaction that is rolled back. Plan nodes that never ran (the other
    partitions, pruned at run time) are counted, not printed."""
    name = f"bench_{time.monotonic_ns()}"
    async with outbox.store.connector.driver_connection() as driver:
        await driver.execute(f"PREPARE {name} AS {sql}")
        transaction = driver.transaction()
        await transaction.start()
        try:
            await driver.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            params = ", ".join(_literal(a) for a in args)
            rows = await driver.fetch(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE {name}({params})")
        finally:
            await transaction.rollback()
            await driver.execute(f"DEALLOCATE {name}")
    lines = [r[0] for r in rows]
    # The update's list of result partitions ("Update on <partition> <alias>"): counted.
    targets = [line for line in lines if re.fullmatch(r"\s+Update on \S+ \S+", line)]
    lines = [line for line in lines if line not in targets]
    never = [line for line in lines if "(never executed)" in line and "Scan" in line]
    shown = []
    skip_depth: int | None = None
    for line in lines:
        depth = len(line) - len(line.lstrip())
        if skip_depth is not None and depth > skip_depth:
            continue  # the conditions of a scan that never ran
        skip_depth = None
        if line in never:
            skip_depth = depth
            continue
        shown.append(line)
    if targets:
        shown.append(f"({len(targets)} 'Update on <partition>' lines: not shown)")
    if never:
        shown.append(f"({len(never)} scans on other partitions never executed: not shown)")
    return shown


async def dispatch_plans(outbox: Any) -> dict[str, list[str]]:
    """The plans of a 500-row claim and of its mark (``mark_published``), generic, with
    ANALYZE and BUFFERS, on ``outbox``'s table with a 500-row backlog."""
    from fastapi_outbox.storage.partition_map import NIL
    from fastapi_outbox.storage.statements import claims as claims_sql
    from fastapi_outbox.storage.statements.parts import batch_params

    name = outbox.table.name
    store = outbox.store
    await run_sql(outbox, fill_sql(name, "pending", 90_000_000, CLAIM, 1, stream="plans"))
    out = {}
    stmt = store.claims.claim_statement("default", CLAIM, False)
    # Partitioned: the floor a relay's claims use during a drain (partition_map).
    pmap = store.claims.partition_map
    floor = NIL
    if pmap is not None:
        await pmap.refresh("default")
        floor = pmap.floor("default")
    params = store.claims.claim_params("plan", 30.0, floor)
    sql, args = store.connector.compile("plan", stmt, params)
    out["claim"] = await explain_generic(outbox, sql, args)
    rows = await store.claims.claim("default", CLAIM, "plan", 30.0)
    ids = [r.id for r in rows]
    # Partitioned: the mark runs on the batch's partition when one holds it all.
    part = pmap.partition_of(ids) if pmap is not None else None
    mark = claims_sql.mark_published(outbox.table if part is None else part, outbox.engine.dialect)
    sql, args = store.connector.compile("plan_mark", mark, {**batch_params(ids), "token": "plan"})
    out["mark"] = await explain_generic(outbox, sql, args)
    await store.claims.mark_published(ids, "plan")
    return out


async def drain_rate(relay: Any, backlog: int, stream: str) -> float:
    """Messages per second of a default relay draining ``backlog`` rows to Redis,
    from its first mark to its last."""
    import redis.asyncio as aioredis

    async with relay.relaying():
        table_relay = relay.relays.tables["default"]
        deadline = time.monotonic() + 600

        async def until(done: Any) -> None:
            # A poll (the table_relay has no event to wait on), bounded by the deadline.
            for _ in range(10**7):
                if done() or time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.005)

        await until(lambda: table_relay.published_total > 0)
        n0, t0 = table_relay.published_total, time.perf_counter()
        await until(lambda: table_relay.published_total >= backlog)
        rate = (table_relay.published_total - n0) / (time.perf_counter() - t0)
    client = aioredis.Redis.from_url(REDIS_URL)
    await client.delete(stream)
    await client.aclose()
    return rate


def server_cpu(data_dir: str) -> float:
    """CPU seconds used so far by a PostgreSQL server whose data directory this process can
    read (a private one, as root): the postmaster's live children (backends, autovacuum,
    writers) plus the children it already reaped, plus its own."""
    postmaster = int(Path(data_dir, "postmaster.pid").read_text().split()[0])
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    total = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            rest = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[1]) == postmaster:
            total += proc_cpu(int(stat.parent.name))
    return total


VACUUMS = (
    "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_user_tables "
    "WHERE relname = '{name}' OR relname LIKE '{name}\\_p%' OR relname = '{name}_default'"
)
STATEMENTS = (
    "SELECT calls, total_exec_time, total_plan_time, plans, rows, shared_blks_hit, "
    "shared_blks_read, query FROM pg_stat_statements "
    "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "ORDER BY total_exec_time + total_plan_time DESC LIMIT 12"
)


def statements_table(rows: list[Any], messages: int) -> str:
    """pg_stat_statements of one drain, the costliest first; µs per message too."""
    return table(
        ["calls", "exec ms", "mean ms", "plan ms", "µs/msg", "rows", "hit", "read", "query"],
        [
            [
                f"{r[0]:,}",
                f"{r[1]:,.0f}",
                f"{r[1] / max(r[0], 1):.3f}",
                f"{r[2]:,.0f}",
                f"{(r[1] + r[2]) * 1000 / messages:.1f}",
                f"{r[4]:,}",
                f"{r[5]:,}",
                f"{r[6]:,}",
                " ".join(r[7].split())[:70],
            ]
            for r in rows
        ],
    )


async def dispatch_comparison(
    url: str, rows: int, days: int, order: str, rounds: int, backlog: int, statements: str = ""
) -> None:
    """Dispatch from a plain table and from a table partitioned by day holding ``days``
    partitions of done rows, in alternating rounds (the layout going first alternates),
    then the generic plans of the claim and the mark of each."""
    from fastapi_outbox import Outbox, OutboxSettings
    from fastapi_outbox.brokers import RedisStreamsBroker
    from fastapi_outbox.storage import partitions

    now = dt.datetime.now(dt.UTC)
    layouts = {"plain": None, f"partitioned, {days} days": "daily"}
    outboxes: dict[str, tuple[Any, Any]] = {}
    try:
        for layout, partitioning in layouts.items():
            name = "plain_outbox" if partitioning is None else "parted_outbox"
            settings = OutboxSettings(
                table_name=name,
                partitioning=partitioning,
                published_retention_seconds=None,
                abandoned_retention_seconds=None,
            )
            outbox = Outbox(url, settings=settings.model_copy(update={"run_relays": False}))
            relay = Outbox(
                url,
                brokers={"default": RedisStreamsBroker(REDIS_URL, maxlen=10_000, dedup="off")},
                settings=settings,
            )
            outboxes[layout] = (outbox, relay)
            if statements and partitioning is None:
                await run_sql(outbox, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            await outbox.create_tables()
            if partitioning is not None:
                async with outbox.engine.begin() as conn:
                    for d in range(1, days + 1):
                        lo = midnight(now) - d * DAY
                        await conn.run_sync(partitions.create_partition_sync, name, lo, lo + DAY)
            t0 = time.perf_counter()
            await run_sql(outbox, fill_sql(name, "published", 1, rows, days, order))
            await run_sql(outbox, f"VACUUM ANALYZE {name}")
            count = len(await outbox.partitions.partitions()) if outbox.partitions else 0
            print(
                f"{layout}: {rows:,} done rows filled in {time.perf_counter() - t0:.0f} s"
                + (f", {count} partitions (DEFAULT included)" if count else ""),
                flush=True,
            )
        rates: dict[str, list[float]] = {layout: [] for layout in layouts}
        for n in range(rounds):
            names = list(layouts) if n % 2 == 0 else list(reversed(layouts))
            for layout in names:
                outbox, relay = outboxes[layout]
                name = outbox.table.name
                stream = f"bench_scale_dispatch_{name}"
                first = 100_000_000 + n * backlog
                await run_sql(
                    outbox,
                    fill_sql(name, "pending", first, backlog, 1, stream=stream),
                    f"ANALYZE {name}",
                )
                if statements:
                    vacuums0 = await scalar(outbox, VACUUMS.format(name=name))
                    await run_sql(outbox, "SELECT pg_stat_statements_reset()")
                    relay0, pg0 = proc_cpu(os.getpid()), server_cpu(statements)
                rate = await drain_rate(relay, backlog, stream)
                rates[layout].append(rate)
                print(f"round {n + 1}: {layout}: {rate:,.0f} msg/s", flush=True)
                if statements:
                    relay = (proc_cpu(os.getpid()) - relay0) * 1e6 / backlog
                    server = (server_cpu(statements) - pg0) * 1e6 / backlog
                    vacuums = await scalar(outbox, VACUUMS.format(name=name)) - vacuums0
                    print(
                        f"  CPU per message: relay {relay:.0f} µs, PostgreSQL {server:.0f} µs "
                        f"(autovacuum + autoanalyze runs on the table: {vacuums})"
                    )
                    print(statements_table(await scalar_rows(outbox, STATEMENTS), backlog))
        for layout, (outbox, _) in outboxes.items():
            plans = await dispatch_plans(outbox)
            for what, plan in plans.items():
                print(f"\n{what} plan (generic, EXPLAIN ANALYZE, BUFFERS), {layout}:")
                print("\n".join(f"   {line}" for line in plan))
    finally:
        for outbox, relay in outboxes.values():
            await relay.aclose()
            await outbox.aclose()
    print()
    medians = {layout: statistics.median(r) for layout, r in rates.items()}
    plain = medians["plain"]
    print(
        table(
            ["layout", *(f"round {i + 1} msg/s" for i in range(rounds)), "median", "vs plain"],
            [
                [
                    layout,
                    *(f"{r:,.0f}" for r in rates[layout]),
                    f"{medians[layout]:,.0f}",
                    f"{medians[layout] / plain:.2f}x",
                ]
                for layout in rates
            ],
        )
    )


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
                run_relays=False,
                published_retention_seconds=retention_seconds,
                abandoned_retention_seconds=None,
            )
            outbox = Outbox(url, settings=settings)
            relay = Outbox(
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
                r = await retention_under_load(outbox, relay, cutoff, backlog)
                retention_results[layout] = r
                print(f"{layout}: retention {r}", flush=True)
            finally:
                await relay.aclose()
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


async def dispatch_only(
    rows: int, days: int, order: str, rounds: int, backlog: int, statements: str = ""
) -> None:
    loopback(REDIS_URL)
    banner(
        f"dispatch at scale: plain vs {days} daily partitions, {rows:,} done rows, "
        f"{rounds} alternating rounds of {backlog:,} messages to Redis ({machine_note()})"
    )
    async with bench_database("bench_scale") as url:
        await dispatch_comparison(url, rows, days, order, rounds, backlog, statements)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, help="done rows at the end (10,000,000; --dispatch: 3,000,000)"
    )
    parser.add_argument("--days", type=int, help="days the done rows span (10; --dispatch: 30)")
    parser.add_argument(
        "--backlog", type=int, default=600_000, help="pending rows drained during retention"
    )
    parser.add_argument(
        "--order", choices=ORDERS, default="time", help="heap order of the done rows"
    )
    parser.add_argument("--quick", action="store_true", help="200,000 rows: a smoke run")
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="only the dispatch comparison: plain vs partitioned, alternating rounds, plans",
    )
    parser.add_argument("--rounds", type=int, default=3, help="dispatch rounds per layout")
    parser.add_argument(
        "--dispatch-backlog", type=int, default=50_000, help="pending rows drained per round"
    )
    parser.add_argument(
        "--statements",
        metavar="DATA_DIR",
        default="",
        help="--dispatch on a private server with pg_stat_statements loaded, whose data "
        "directory this process reads: per round, its statements and the CPU per message",
    )
    args = parser.parse_args()
    if args.rows is None:
        args.rows = 3_000_000 if args.dispatch else 10_000_000
    if args.days is None:
        args.days = 30 if args.dispatch else 10
    if args.quick:
        args.rows, args.days, args.backlog = 200_000, 4, 100_000
    if args.dispatch:
        asyncio.run(
            dispatch_only(
                args.rows,
                args.days,
                args.order,
                args.rounds,
                args.dispatch_backlog,
                args.statements,
            )
        )
    else:
        asyncio.run(main(args.rows, args.days, args.backlog, args.order))
