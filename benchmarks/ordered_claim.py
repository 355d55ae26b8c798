"""Ordered claim at depth: ``Claims.claim(ordered=True)`` with 500,000 pending rows.

Fills a fresh database's outbox (``OutboxSettings(ordered=True)``, so the table has the
ordered index ``ix_<table>_ordered`` on ``(broker, seq)`` over active rows) with
``--rows`` pending rows (500,000 by default; ``INSERT … SELECT generate_series``, 1,000
keys), prints ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim, then times ``--claims`` claims
of 100 rows each (each batch released again with its attempt refunded, so every claim sees
the same backlog) — with the ordered index, and again after dropping it (the layout before
the index existed), alternating rounds. Run: ``python benchmarks/ordered_claim.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from benchmarks._common import banner, bench_database, machine_note, median, table
from benchmarks.dispatch import BACKLOG_SQL
from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.storage.schema import ordered_index_name

BATCH = 100


async def explain(outbox: Outbox) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of the claim statement, in a transaction rolled back."""
    import datetime as dt

    stmt = outbox.store.claims.claim_statement("default", BATCH, True)
    compiled = stmt.compile(dialect=outbox.engine.dialect)
    params = {**compiled.params, "token": "bench:explain", "lease": dt.timedelta(seconds=30)}
    positional = [params[name] for name in compiled.positiontup or []]
    raw = await outbox.engine.raw_connection()
    try:
        conn: Any = raw.driver_connection
        tr = conn.transaction()
        await tr.start()
        try:
            rows = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {compiled}", *positional)
        finally:
            await tr.rollback()
    finally:
        raw.close()
    return "\n".join(r[0] for r in rows)


async def time_claims(outbox: Outbox, claims: int) -> list[float]:
    out = []
    for i in range(claims):
        t = time.perf_counter()
        got = await outbox.store.claims.claim("default", BATCH, f"bench:{i}", 30.0, ordered=True)
        out.append((time.perf_counter() - t) * 1000)
        assert len(got) == BATCH, f"claimed {len(got)}"
        await outbox.store.claims.release([r.id for r in got], f"bench:{i}")
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--claims", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    async with bench_database("bench_ordered") as url:
        outbox = Outbox(
            url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(ordered=True)
        )
        await outbox.create_tables()
        try:
            t = time.monotonic()
            raw = await outbox.engine.raw_connection()
            try:
                conn: Any = raw.driver_connection
                await conn.execute(
                    BACKLOG_SQL,
                    "default",
                    "bench_ordered",
                    args.rows,
                    "pending",
                )
                await conn.execute(f"ANALYZE {outbox.table.name}")
            finally:
                raw.close()
            print(f"filled {args.rows:,} pending rows in {time.monotonic() - t:.1f} s")
            banner("EXPLAIN (ANALYZE, BUFFERS) of the ordered claim, with the ordered index")
            print(await explain(outbox))
            index = ordered_index_name(outbox.table.name)
            with_index: list[float] = []
            without: list[float] = []
            for _ in range(args.rounds):
                with_index += await time_claims(outbox, args.claims)
                async with outbox.engine.begin() as c:
                    await c.exec_driver_sql(f"DROP INDEX {index}")
                without += await time_claims(outbox, max(3, args.claims // 5))
                async with outbox.engine.begin() as c:
                    await c.exec_driver_sql(
                        f"CREATE INDEX {index} ON {outbox.table.name} (broker, seq) "
                        "WHERE status IN ('pending', 'processing', 'failed')"
                    )
                    await c.exec_driver_sql(f"ANALYZE {outbox.table.name}")
            banner(f"ordered claim of {BATCH} rows with {args.rows:,} pending")
            print(
                table(
                    ["layout", "claims", "median ms", "max ms"],
                    [
                        [
                            "with ix_…_ordered",
                            len(with_index),
                            f"{median(with_index):.2f}",
                            f"{max(with_index):.2f}",
                        ],
                        [
                            "without (old layout)",
                            len(without),
                            f"{median(without):.2f}",
                            f"{max(without):.2f}",
                        ],
                    ],
                )
            )
            print(machine_note())
        finally:
            await outbox.aclose()


if __name__ == "__main__":
    asyncio.run(main())
