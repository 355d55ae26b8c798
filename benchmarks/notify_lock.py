"""Where the wake-up's NOTIFY goes, priced: concurrent one-row commits on raw asyncpg.

PostgreSQL takes a cluster-wide lock when a transaction that has notified commits, and holds
it through the commit's WAL flush. This measures what that does to concurrent producers,
``--connections`` of them (default 8 and 16) each committing one row per transaction,
in alternating rounds of ``--seconds``:

* **plain**: ``BEGIN; INSERT; COMMIT`` — no wake-up;
* **trigger**: the same table with a statement-level ``AFTER INSERT`` trigger calling
  ``pg_notify`` — the NOTIFY inside the business transaction;
* **after the COMMIT**: ``COMMIT; SELECT set_config('synchronous_commit', 'off', true),
  pg_notify(…)`` in one round trip — what the library sends (the NOTIFY in a small
  transaction of its own, run after the commit, without waiting for its WAL flush).

Commits/s per case (medians of the rounds) and the ratio to plain are printed.

    python benchmarks/notify_lock.py
    python benchmarks/notify_lock.py --quick      # 2 rounds of 2 s, 8 connections
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import asyncpg_dsn, banner, bench_database, fmt, machine_note, median, table

SETUP = """
CREATE TABLE plain_rows (id bigserial PRIMARY KEY, payload jsonb NOT NULL);
CREATE TABLE trigger_rows (id bigserial PRIMARY KEY, payload jsonb NOT NULL);
CREATE FUNCTION wake() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN PERFORM pg_notify(TG_ARGV[0], ''); RETURN NULL; END $$;
CREATE TRIGGER trigger_rows_wake AFTER INSERT ON trigger_rows
  FOR EACH STATEMENT EXECUTE FUNCTION wake('bench_wake');
"""
CASES = {
    "plain": ("plain_rows", "COMMIT"),
    "trigger": ("trigger_rows", "COMMIT"),
    "after the COMMIT": (
        "plain_rows",
        "COMMIT; SELECT set_config('synchronous_commit', 'off', true), pg_notify('bench_wake', '')",
    ),
}


async def _worker(conn: Any, table_name: str, commit: str, until: float) -> int:
    done = 0
    insert = f"INSERT INTO {table_name} (payload) VALUES ($1)"
    while time.monotonic() < until:
        await conn.execute("BEGIN")
        await conn.execute(insert, '{"n": 1}')
        await conn.execute(commit)
        done += 1
    return done


async def run(connections: list[int], rounds: int, seconds: float) -> list[list[str]]:
    import asyncpg

    rows: list[list[str]] = []
    async with bench_database("notify_lock") as url:
        dsn = asyncpg_dsn(url)
        setup = await asyncpg.connect(dsn)
        await setup.execute(SETUP)
        await setup.close()
        for n in connections:
            conns = [await asyncpg.connect(dsn) for _ in range(n)]
            rates: dict[str, list[float]] = {case: [] for case in CASES}
            try:
                for r in range(rounds):
                    order = list(CASES) if r % 2 == 0 else list(CASES)[::-1]
                    for case in order:
                        table_name, commit = CASES[case]
                        until = time.monotonic() + seconds
                        done = await asyncio.gather(
                            *(_worker(c, table_name, commit, until) for c in conns)
                        )
                        rates[case].append(sum(done) / seconds)
            finally:
                for c in conns:
                    await c.close()
            plain = median(rates["plain"])
            for case, values in rates.items():
                rows.append(
                    [
                        str(n),
                        case,
                        fmt(median(values)),
                        " / ".join(fmt(v) for v in values),
                        f"{median(values) / plain:.2f}",
                    ]
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--connections", type=int, nargs="+")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--seconds", type=float)
    args = parser.parse_args()
    connections = args.connections or ([8] if args.quick else [8, 16])
    rounds = args.rounds or (2 if args.quick else 4)
    seconds = args.seconds or (2.0 if args.quick else 3.0)
    banner(f"notify lock: {rounds} alternating rounds of {seconds:g} s — {machine_note()}")
    rows = asyncio.run(run(connections, rounds, seconds))
    print(table(["connections", "wake-up", "commits/s", "rounds", "vs plain"], rows))


if __name__ == "__main__":
    main()
