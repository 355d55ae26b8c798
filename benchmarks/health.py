"""Latency of ``GET /outbox/health`` on an empty table and on a table keeping 1,000,000
published rows plus a few thousand that still need work.

The health endpoint must stay cheap however many published rows retention keeps: its
counts come from the partial indexes (rows still needing work, abandoned rows, published
rows of the last minute). The script prints p50/p99 of the endpoint (in process, through
``httpx.ASGITransport``, the one-second cache turned off) and of ``Messages.stats`` alone,
and the plan of every statement behind it, failing loudly on a sequential scan.

Run: ``.venv/bin/python benchmarks/health.py [--rows 1000000] [--requests 300] [--quick]``
(PostgreSQL on loopback, ``BENCH_PG_URL`` / ``OUTBOX_TEST_PG_URL``; a throw-away database).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    banner,
    bench_database,
    machine_note,
    percentile,
    table,
)

#: Requests measured while the pool still holds plans made on the empty table (slow).
STALE_REQUESTS = 10
PENDING_ROWS = 3000
FAILED_ROWS = 50
ABANDONED_ROWS = 20
PAYLOAD = '{"order_id": 12345, "customer": "c-0001", "total": 99.5, "currency": "EUR"}'


def fill_sql(table_name: str, published: int) -> list[str]:
    """One INSERT … SELECT generate_series per status: published rows spread over the
    last ``published / 2`` seconds (so ~120 fall in the last minute), then the rows that
    still need work."""
    cols = (
        "id, broker, stream, type, key, payload, headers, status, attempts, "
        "next_attempt_at, created_at, published_at, abandoned_at"
    )
    row = (
        "gen_random_uuid(), 'default', 'orders', 'OrderPlaced', (g % 1000)::text, "
        f"'{PAYLOAD}'::jsonb, '{{}}'::jsonb"
    )
    return [
        f"INSERT INTO {table_name} ({cols}) SELECT {row}, 'published', 1, "
        "now() - make_interval(secs => g * 0.5), now() - make_interval(secs => g * 0.5 + 1), "
        f"now() - make_interval(secs => g * 0.5), NULL FROM generate_series(1, {published}) g",
        f"INSERT INTO {table_name} ({cols}) SELECT {row}, 'pending', 0, now(), "
        f"now() - make_interval(secs => g * 0.001), NULL, NULL "
        f"FROM generate_series(1, {PENDING_ROWS}) g",
        f"INSERT INTO {table_name} ({cols}) SELECT {row}, 'failed', 3, now() + interval '1 hour', "
        f"now() - interval '1 minute', NULL, NULL FROM generate_series(1, {FAILED_ROWS}) g",
        f"INSERT INTO {table_name} ({cols}) SELECT {row}, 'abandoned', 10, now(), "
        f"now() - interval '1 day', NULL, now() FROM generate_series(1, {ABANDONED_ROWS}) g",
    ]


async def measure(client: Any, store: Any, requests: int, *, warmup: int = 20) -> dict[str, float]:
    """p50/p99 in milliseconds of the endpoint and of ``Messages.stats`` (after a warm-up)."""
    for _ in range(warmup):
        await client.get("/outbox/health")
    endpoint: list[float] = []
    for _ in range(requests):
        t0 = time.perf_counter()
        response = await client.get("/outbox/health")
        endpoint.append((time.perf_counter() - t0) * 1000)
        assert response.status_code in (200, 503), response.text
    stats: list[float] = []
    for _ in range(requests):
        t0 = time.perf_counter()
        await store.messages.stats(["default"])
        stats.append((time.perf_counter() - t0) * 1000)
    return {
        "endpoint_p50": percentile(endpoint, 50),
        "endpoint_p99": percentile(endpoint, 99),
        "stats_p50": percentile(stats, 50),
        "stats_p99": percentile(stats, 99),
    }


async def explain(outbox: Any) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of each statement of ``Messages.stats``; returns the names
    of the health endpoint's statements whose plan scans the table sequentially (the
    CLI-only count of all published rows reads them all by design)."""
    seq: list[str] = []
    dialect = outbox.engine.dialect
    async with outbox.engine.connect() as conn:
        for name, stmt in outbox.store.messages.stats_statements().items():
            # Render the (interval) parameters inline so EXPLAIN sees a complete statement.
            sql = str(stmt.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
            result = await conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}")
            lines = [r[0] for r in result]
            note = " (CLI status only)" if name == "published" else ""
            print(f"\n-- {name}{note}")
            for line in lines:
                print(f"   {line}")
            if name != "published" and any("Seq Scan" in line for line in lines):
                seq.append(name)
    return seq


async def main(rows: int, requests: int) -> int:
    import httpx
    from fastapi import FastAPI

    from fastapi_outbox import Outbox, OutboxSettings
    from fastapi_outbox.brokers import MemoryBroker

    banner(f"health endpoint latency ({machine_note()})")
    results: dict[str, dict[str, float]] = {}
    async with bench_database("bench_health") as url:
        outbox = Outbox(
            url,
            brokers={"default": MemoryBroker()},
            settings=OutboxSettings(health_cache_seconds=0, run_relays=False),
        )
        await outbox.create_tables()
        app = FastAPI(lifespan=outbox.lifespan)
        app.include_router(outbox.health_router)
        transport = httpx.ASGITransport(app=app)
        try:
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(transport=transport, base_url="http://bench") as client,
            ):
                results["empty table"] = await measure(client, outbox.store, requests)
                t0 = time.perf_counter()
                async with outbox.engine.begin() as conn:
                    for sql in fill_sql(outbox.table.name, rows):
                        await conn.exec_driver_sql(sql)
                print(
                    f"inserted {rows:,} published + {PENDING_ROWS + FAILED_ROWS:,} active + "
                    f"{ABANDONED_ROWS} abandoned rows in {time.perf_counter() - t0:.1f}s"
                )
                # Pooled connections keep the plans PostgreSQL cached for their prepared
                # statements while the table was empty (a parameterless statement always
                # reuses its generic plan): until the next ANALYZE invalidates them, the
                # 'active' count scans the table. Autovacuum analyzes a table that grew
                # from empty within a minute or so; shown here for what it is.
                results[f"{rows:,} published, plans cached when empty"] = await measure(
                    client, outbox.store, STALE_REQUESTS, warmup=0
                )
                # Fresh connections, still no ANALYZE: plans made against the table's size.
                await outbox.engine.dispose()
                results[f"{rows:,} published, not analyzed"] = await measure(
                    client, outbox.store, requests
                )
                print("\nplans before ANALYZE:")
                seq_before = await explain(outbox)
                async with outbox.engine.connect() as conn:
                    auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
                    await auto.exec_driver_sql(f"VACUUM ANALYZE {outbox.table.name}")
                results[f"{rows:,} published, analyzed"] = await measure(
                    client, outbox.store, requests
                )
                body = (await client.get("/outbox/health")).json()
                print(
                    "health body: status={status} pending={pending} failed={failed} "
                    "abandoned={abandoned} published_last_minute={recent}".format(
                        status=body["status"],
                        pending=body["relays"][0]["pending"],
                        failed=body["relays"][0]["failed"],
                        abandoned=body["relays"][0]["abandoned"],
                        recent=body["relays"][0]["published_last_minute"],
                    )
                )
                print("\nplans of the statements behind Messages.stats (after ANALYZE):")
                seq = await explain(outbox)
        finally:
            await outbox.aclose()
    print()
    print(
        table(
            ["table", "endpoint p50 ms", "endpoint p99 ms", "stats p50 ms", "stats p99 ms"],
            [
                [
                    name,
                    f"{r['endpoint_p50']:.2f}",
                    f"{r['endpoint_p99']:.2f}",
                    f"{r['stats_p50']:.2f}",
                    f"{r['stats_p99']:.2f}",
                ]
                for name, r in results.items()
            ],
        )
    )
    bad = sorted({*(f"{n} (not analyzed)" for n in seq_before), *seq})
    if bad:
        print(f"\nSEQUENTIAL SCAN in: {', '.join(bad)}")
        return 1
    print("\nno sequential scan in the statements of the health endpoint")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="published rows")
    parser.add_argument("--requests", type=int, default=300, help="requests per measurement")
    parser.add_argument("--quick", action="store_true", help="smoke run: 50,000 rows")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.requests = min(args.rows, 50_000), min(args.requests, 50)
    raise SystemExit(asyncio.run(main(args.rows, args.requests)))
