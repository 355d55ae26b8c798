"""Dashboard timings on a table of 1,000,000 rows.

Fills a fresh database's outbox with ``--rows`` rows (``INSERT … SELECT generate_series``:
99 % published over the last day, the rest pending, failed and abandoned, over 20 streams),
then times, over HTTP through the ASGI app (rendering included), alternating with a
hand-written baseline (the same counts as plain asyncpg queries, no rendering):

* the overview page and its refresh fragment (counts per broker and stream from the
  partial indexes, published per minute over the last hour from the published index);
* the first page of messages, a filtered page (abandoned of one stream), a page 200 pages
  deep by keyset (``before=<id>``), and one message page.

Run: ``python benchmarks/dashboard.py`` (``--rows 100000`` for a quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import httpx
from fastapi import FastAPI

from benchmarks._common import banner, bench_database, machine_note, median, table
from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker

FILL_SQL = """
INSERT INTO outbox_messages
    (id, broker, stream, type, key, payload, headers, status, attempts, next_attempt_at,
     created_at, published_at, abandoned_at, last_error)
SELECT u.id, 'default', 'stream-' || (u.i % 20), 'OrderPlaced', (u.i % 5000)::text,
    jsonb_build_object('order_id', u.i, 'note', repeat('x', 100)),
    jsonb_build_object('message-id', u.id::text, 'type', 'OrderPlaced'),
    u.status, 1, now(), u.at, CASE WHEN u.status = 'published' THEN u.at END,
    CASE WHEN u.status = 'abandoned' THEN u.at END,
    CASE WHEN u.status IN ('failed', 'abandoned') THEN 'MessageRejected: refused' END
FROM (
    SELECT gen_random_uuid() AS id, i,
        now() - (($1::int - i) * interval '1 day' / $1::int) AS at,
        CASE WHEN i % 100 = 1 THEN 'pending' WHEN i % 100 = 2 THEN 'failed'
             WHEN i % 1000 = 3 THEN 'abandoned' ELSE 'published' END AS status
    FROM generate_series(1, $1::int) AS i
) AS u
"""

BASELINE = [
    "SELECT broker, stream, status, count(*), min(next_attempt_at) FROM outbox_messages "
    "WHERE status IN ('pending', 'processing', 'failed') GROUP BY broker, stream, status",
    "SELECT broker, stream, count(*) FROM outbox_messages WHERE status IN ('abandoned') "
    "GROUP BY broker, stream",
    "SELECT date_trunc('minute', published_at), count(*) FROM outbox_messages "
    "WHERE status IN ('published') AND published_at > now() - interval '1 hour' GROUP BY 1",
]


async def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    async with bench_database("bench_dashboard") as url:
        outbox = Outbox(
            url,
            brokers={"default": MemoryBroker()},
            settings=OutboxSettings(run_relays=False),
            dashboard_dependencies=[],
        )
        await outbox.create_tables()
        raw = await outbox.engine.raw_connection()
        conn: Any = raw.driver_connection
        try:
            t = time.monotonic()
            await conn.execute(FILL_SQL, args.rows)
            await conn.execute("VACUUM ANALYZE outbox_messages")
            print(f"filled {args.rows:,} rows in {time.monotonic() - t:.1f} s")
            app = FastAPI()
            app.include_router(outbox.dashboard_router)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
                first = await conn.fetch(
                    "SELECT id FROM outbox_messages ORDER BY id DESC OFFSET 10000 LIMIT 1"
                )
                deep, one = first[0]["id"], first[0]["id"]
                pages = {
                    "overview page": "/outbox/dashboard",
                    "overview fragment": "/outbox/dashboard/fragments/overview",
                    "messages, first page": "/outbox/dashboard/messages",
                    "abandoned of one stream": "/outbox/dashboard/messages?status=abandoned"
                    "&stream=stream-3",
                    "messages, 200 pages deep": f"/outbox/dashboard/messages?before={deep}",
                    "one message": f"/outbox/dashboard/messages/{one}",
                }

                async def baseline() -> None:
                    for sql in BASELINE:
                        await conn.fetch(sql)

                results: dict[str, list[float]] = {name: [] for name in pages}
                results["baseline: the overview's counts, raw SQL"] = []
                for _ in range(args.rounds):
                    for name, path in pages.items():

                        async def get(path: str = path) -> None:
                            response = await client.get(path)
                            assert response.status_code == 200, response.text[:300]

                        results[name] += await timed(get, args.repeat)
                    results["baseline: the overview's counts, raw SQL"] += await timed(
                        baseline, args.repeat
                    )
            banner(f"dashboard with {args.rows:,} rows (HTTP through ASGI, rendering included)")
            print(
                table(
                    ["request", "median ms", "max ms"],
                    [[k, f"{median(v):.1f}", f"{max(v):.1f}"] for k, v in results.items()],
                )
            )
            print(machine_note())
        finally:
            raw.close()
            await outbox.aclose()


if __name__ == "__main__":
    asyncio.run(main())
