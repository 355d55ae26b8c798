"""Multi-tenant outboxes at scale: ``--tenants`` tenant databases (200 by default) relayed by
one process.

Printed:

* **idle**: the relay running over every tenant with nothing to publish, for ``--idle``
  seconds: the process's CPU (% of one core) and the connections it holds to the tenant
  databases (sampled from ``pg_stat_activity`` every second: the largest count);
* **drain**: ``--messages`` messages (50,000) spread evenly over the tenants, drained by the
  tenant relay (first publish → last publish), against the same backlog in one database
  drained by a single-tenant outbox with the same settings, in ``--rounds`` alternating
  rounds (medians, and their ratio);
* **a quiet tenant beside a backlog**: the commit→publish latency (p50 / p99 of
  ``--samples`` single messages) of a quiet tenant alone, then while another tenant drains
  ``--backlog`` rows (1,000,000 by default; filled with one ``INSERT … SELECT`` statement).

The broker is a counting one (``MemoryBroker`` that keeps no message): the figures are the
relay's and the databases', not a broker's. The tenant databases are created on the
PostgreSQL of ``BENCH_PG_URL`` (``CREATE DATABASE bench_tenant_<random>_<n>``) and dropped at
the end, even when the run fails.

Run: ``.venv/bin/python benchmarks/tenants.py [--tenants 200] [--messages 50000]
[--backlog 1000000] [--idle 20] [--rounds 3] [--samples 50]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg

from benchmarks._common import PG_URL, asyncpg_dsn, banner, loopback, machine_note, percentile
from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.events import Envelope


class CountingBroker(MemoryBroker):
    """Publishes nowhere: counts the messages, and notes when each quiet one arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self.quiet: dict[str, float] = {}
        self._published = asyncio.Event()

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.count += len(batch)
        for envelope in batch:
            if envelope.stream == "quiet":
                self.quiet[envelope.headers["message-id"]] = now
        self._published.set()
        return [None] * len(batch)

    async def until(self, done: Any) -> None:
        """Return once ``done()`` holds, looking again after each publish."""
        while not done():
            self._published.clear()
            await self._published.wait()

    def reset(self) -> None:
        self.count, self.first, self.last = 0, None, None


def tenant_url(name: str) -> str:
    base = PG_URL.rsplit("/", 1)[0]
    return f"{base}/{name}"


async def admin(statements: Sequence[str]) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(PG_URL))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def held_connections(prefix: str) -> int:
    conn = await asyncpg.connect(asyncpg_dsn(PG_URL))
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname LIKE $1 "
                "AND pid <> pg_backend_pid()",
                f"{prefix}%",
            )
        )
    finally:
        await conn.close()


async def fill(url: str, table: str, rows: int, stream: str = "backlog") -> None:
    """``rows`` pending rows in one statement (UUIDv7-like ids, ~40-byte payloads)."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute(
            f"INSERT INTO {table} (id, broker, stream, type, payload, headers, "
            "next_attempt_at, created_at) "
            "SELECT (lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::bigint), 12,"
            " '0') || '7' || substr(md5(g::text || random()::text), 1, 19))::uuid, "
            f"'default', '{stream}', 'Filler', ('{{\"n\": ' || g || '}}')::jsonb, "
            "json_build_object('message-id', gen_random_uuid()::text, 'type', 'Filler')::jsonb, "
            "now(), now() FROM generate_series(1, $1) g",
            rows,
        )
    finally:
        await conn.close()


async def idle(outbox: Outbox, prefix: str, seconds: float) -> tuple[float, int]:
    async with outbox.relaying():
        await asyncio.sleep(3)  # every tenant had its first turn
        cpu, wall = time.process_time(), time.perf_counter()
        most = 0
        end = wall + seconds
        while time.perf_counter() < end:
            await asyncio.sleep(1)
            most = max(most, await held_connections(prefix))
        used = (time.process_time() - cpu) / (time.perf_counter() - wall)
    return used * 100, most


async def drain(outbox: Outbox, broker: CountingBroker, total: int) -> float:
    broker.reset()
    async with outbox.relaying():
        await broker.until(lambda: broker.count >= total)
    assert broker.first is not None and broker.last is not None
    return total / (broker.last - broker.first)


async def fill_tenants(outbox: Outbox, names: Sequence[str], per_tenant: int) -> None:
    table = outbox.settings.table_name
    gate = asyncio.Semaphore(8)  # the server's max_connections is shared

    async def one(name: str) -> None:
        async with gate:
            await fill(tenant_url(name), table, per_tenant)

    await asyncio.gather(*(one(n) for n in names))


async def quiet_latency(
    outbox: Outbox, broker: CountingBroker, tenant: str, samples: int
) -> list[float]:
    times = []
    for n in range(samples):
        async with outbox.unit_of_work(tenant=tenant) as uow:
            started = time.perf_counter()
            message_id = str(uow.publish(Message("quiet", "Ping", {"n": n})))
        await broker.until(lambda m=message_id: m in broker.quiet)
        times.append(broker.quiet[message_id] - started)
        await asyncio.sleep(0.02)
    return times


def ms(values: Sequence[float]) -> str:
    return f"p50 {percentile(values, 50) * 1000:.1f} / p99 {percentile(values, 99) * 1000:.1f} ms"


async def run(args: argparse.Namespace) -> None:
    loopback(PG_URL)
    prefix = f"bench_tenant_{uuid.uuid4().hex[:6]}_"
    names = [f"{prefix}{i}" for i in range(args.tenants)]
    single = f"{prefix}single"
    print(machine_note(), flush=True)
    banner(f"creating {len(names) + 1} databases")
    await admin([f'CREATE DATABASE "{n}" TEMPLATE template0' for n in [*names, single]])
    settings = OutboxSettings(notify=False, health_cache_seconds=0)
    broker = CountingBroker()
    outbox = Outbox(tenants={n: tenant_url(n) for n in names}, brokers={"default": broker},
                    settings=settings)  # fmt: skip
    one = Outbox(tenant_url(single), brokers={"default": broker}, settings=settings)
    try:
        await outbox.create_tables(groups=False)
        await one.create_tables(groups=False)
        await report(args, outbox, one, broker, names, prefix, single)
    finally:
        await outbox.aclose()
        await one.aclose()
        await admin([f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)' for n in [*names, single]])


async def report(
    args: argparse.Namespace,
    outbox: Outbox,
    one: Outbox,
    broker: CountingBroker,
    names: list[str],
    prefix: str,
    single: str,
) -> None:
    budget = outbox.settings.tenant_connection_budget
    banner(f"idle: {len(names)} tenants, {args.idle:g} s (tenant_connection_budget={budget})")
    cpu, held = await idle(outbox, prefix, args.idle)
    print(f"relay CPU {cpu:.1f} % of one core; most connections held {held}", flush=True)

    per_tenant = args.messages // len(names)
    total = per_tenant * len(names)
    banner(f"drain: {total} messages over {len(names)} tenants vs one database")
    rates: dict[str, list[float]] = {"tenants": [], "one database": []}
    for round_ in range(args.rounds):
        order = ["tenants", "one database"] if round_ % 2 == 0 else ["one database", "tenants"]
        for kind in order:
            if kind == "tenants":
                await fill_tenants(outbox, names, per_tenant)
                rate = await drain(outbox, broker, total)
            else:
                await fill(tenant_url(single), one.settings.table_name, total)
                rate = await drain(one, broker, total)
            rates[kind].append(rate)
            print(f"round {round_ + 1}: {kind}: {rate:,.0f} msg/s", flush=True)
    tenants_rate = statistics.median(rates["tenants"])
    one_rate = statistics.median(rates["one database"])
    print(
        f"median: tenants {tenants_rate:,.0f} msg/s, one database {one_rate:,.0f} msg/s, "
        f"ratio {tenants_rate / one_rate:.2f}",
        flush=True,
    )

    quiet, busy = names[0], names[1]
    banner(f"a quiet tenant's commit→publish latency, alone and beside {args.backlog:,} rows")
    async with outbox.relaying():
        alone = await quiet_latency(outbox, broker, quiet, args.samples)
    print(f"alone: {ms(alone)}", flush=True)
    await fill(tenant_url(busy), outbox.settings.table_name, args.backlog)
    broker.reset()
    async with outbox.relaying():
        await broker.until(lambda: broker.count >= 1000)
        beside = await quiet_latency(outbox, broker, quiet, args.samples)
        drained = broker.count
    print(f"beside the backlog: {ms(beside)} ({drained:,} backlog rows published meanwhile)")
    if drained >= args.backlog:
        print("(the backlog was drained before the samples ended: raise --backlog)")
    print(
        json.dumps(
            {
                "tenants": len(names),
                "idle_cpu_percent": round(cpu, 1),
                "idle_connections": held,
                "drain_tenants": round(tenants_rate),
                "drain_one_database": round(one_rate),
                "ratio": round(tenants_rate / one_rate, 2),
                "quiet_alone_p50_ms": round(percentile(alone, 50) * 1000, 1),
                "quiet_beside_p50_ms": round(percentile(beside, 50) * 1000, 1),
                "backlog": args.backlog,
            }
        )
    )


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=50)
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
