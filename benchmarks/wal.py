"""capture="wal" against capture="table", in the same run, on a private PostgreSQL cluster.

The shared PostgreSQL runs ``wal_level=replica``, so this script starts a cluster of its own
(``initdb`` as the postgres user, ``wal_level=logical``, ``fsync=off`` like the tests'
cluster — both modes pay the same), and stops it at the end.

(a) **Write path.** ``--connections`` tasks in this process commit, for ``--seconds`` per
round, ``outbox.unit_of_work()`` transactions of one business INSERT (an ORM ``Order``) and
one event; an API-only outbox (``run_relays=False``, its coalesced NOTIFY sender on).
Variants: ``table`` (the outbox row), ``wal`` (``pg_logical_emit_message``), and ``plain``
(the same transaction through a bare ``AsyncSession``, no event) for reference. Rounds
alternate (table, wal, plain, table, …); the table prints medians of commits/s, the
PostgreSQL CPU per commit (``/proc`` of the backends) and the ratios.

(b) **Drain.** A backlog of ``--backlog`` messages (``--per-txn`` per transaction) is
committed with no relay running, then ``outbox.relaying()`` starts in this process
(``batch_size=500``) and the time until the broker holds every message is measured (XLEN /
JetStream stream state, polled every 20 ms; the count must be exact). table and wal
alternate, on Redis and on NATS.

``python benchmarks/wal.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Float, Integer
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from benchmarks._common import (
    banner,
    fmt,
    machine_note,
    median,
    pg_cpu,
    table,
    unique,
)
from benchmarks.dispatch import Brokers
from fastapi_outbox import Event

PORTS = range(56500, 56600)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    total: Mapped[float] = mapped_column(Float)


class OrderPlaced(Event, stream="orders"):
    order_id: int
    total: float


async def write_round(
    url: str, variant: str, seconds: float, connections: int
) -> tuple[float, float]:
    """Commits/s and PostgreSQL CPU µs per commit of one round."""
    import asyncpg
    from sqlalchemy.ext.asyncio import AsyncSession

    from fastapi_outbox import Outbox, OutboxSettings

    capture = "table" if variant == "plain" else variant
    outbox = Outbox(
        url,
        settings=OutboxSettings(capture=capture, run_relays=False),
        engine_options={"pool_size": connections, "max_overflow": 0},
    )
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    admin = await asyncpg.connect(url.replace("+asyncpg", ""))
    done = 0
    stop = time.monotonic() + seconds

    async def producer() -> None:
        nonlocal done
        while time.monotonic() < stop:
            if variant == "plain":
                async with AsyncSession(outbox.engine) as session, session.begin():
                    order = Order(total=10.0)
                    session.add(order)
                    await session.flush()
            else:
                async with outbox.unit_of_work() as uow:
                    order = Order(total=10.0)
                    uow.session.add(order)
                    await uow.session.flush()
                    uow.publish(OrderPlaced(order_id=order.id, total=order.total))
            done += 1

    try:
        async with outbox.relays.notifying():
            # Warm the pool, then measure.
            async with asyncio.TaskGroup() as tg:
                for _ in range(connections):
                    tg.create_task(asyncio.sleep(0))
            before = await pg_cpu(admin)
            started = time.monotonic()
            async with asyncio.TaskGroup() as tg:
                for _ in range(connections):
                    tg.create_task(producer())
            elapsed = time.monotonic() - started
            after = await pg_cpu(admin)
        cpu = sum(v - before.get(pid, 0.0) for pid, v in after.items())
        await admin.execute(f"TRUNCATE orders, {outbox.table.name}")
        return done / elapsed, cpu * 1e6 / max(done, 1)
    finally:
        await admin.close()
        await outbox.aclose()


async def bench_writes(url: str, rounds: int, seconds: float, connections: int) -> None:
    banner(f"(a) write path: {connections} connections, {seconds:g} s rounds, {rounds} rounds")
    rates: dict[str, list[float]] = {"table": [], "wal": [], "plain": []}
    cpus: dict[str, list[float]] = {"table": [], "wal": [], "plain": []}
    for r in range(rounds):
        for variant in ("table", "wal", "plain"):
            rate, cpu = await write_round(url, variant, seconds, connections)
            rates[variant].append(rate)
            cpus[variant].append(cpu)
            print(f"  round {r + 1} {variant}: {rate:,.0f} commits/s, PG {cpu:,.0f} µs/commit")
    rows = [
        (
            v,
            fmt(median(rates[v])),
            fmt(median(cpus[v])),
            f"{median(rates[v]) / median(rates['table']):.2f}x",
        )
        for v in ("table", "wal", "plain")
    ]
    print(table(["variant", "commits/s (median)", "PG CPU µs/commit", "vs table"], rows))


async def drain_round(
    url: str, brokers: Brokers, kind: str, capture: str, backlog: int, per_txn: int
) -> tuple[float, float, float]:
    """msg/s, this process's CPU µs per message (the relay: nothing else runs meanwhile) and
    the PostgreSQL backends' CPU µs per message of one drain."""
    import asyncpg

    from benchmarks._common import NATS_URL, REDIS_URL
    from fastapi_outbox import Message, Outbox, OutboxSettings
    from fastapi_outbox.brokers import NatsJetStreamBroker, RedisStreamsBroker

    stream = unique(f"wal{kind}")
    await brokers.prepare(kind, stream)
    broker: Any = (
        RedisStreamsBroker(REDIS_URL) if kind == "redis" else NatsJetStreamBroker(NATS_URL)
    )
    outbox = Outbox(
        url,
        brokers={"default": broker},
        settings=OutboxSettings(
            capture=capture,
            table_name=unique("drain"),
            batch_size=500,
            run_relays=False,
        ),
    )
    try:
        await outbox.create_tables()
        payload = {"order_id": 1, "total": 10.0, "customer": "x" * 120}
        numbers = iter(range(backlog // per_txn))

        async def producer() -> None:
            for _ in numbers:
                async with outbox.unit_of_work() as uow:
                    for _ in range(per_txn):
                        uow.publish(Message(stream, "OrderPlaced", payload))

        admin = await asyncpg.connect(url.replace("+asyncpg", ""))
        lsn = "SELECT pg_current_wal_lsn()"
        wal0 = await admin.fetchval(lsn)
        async with asyncio.TaskGroup() as tg:
            for _ in range(4):
                tg.create_task(producer())
        try:
            wal1 = await admin.fetchval(lsn)
            pg0, cpu0 = await pg_cpu(admin), time.process_time()
            started = time.monotonic()
            async with outbox.relaying():
                deadline = started + 300
                while (count := await brokers.count(kind, stream)) < backlog:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"drain of {capture} to {kind} stuck at {count}/{backlog}")
                    await asyncio.sleep(0.02)
                elapsed = time.monotonic() - started
                pg1, cpu1 = await pg_cpu(admin), time.process_time()
                wal2 = await admin.fetchval(lsn)
            diff = "SELECT pg_wal_lsn_diff($1, $2)"
            write_wal = float(await admin.fetchval(diff, wal1, wal0)) / backlog
            drain_wal = float(await admin.fetchval(diff, wal2, wal1)) / backlog
        finally:
            await admin.close()
        if count != backlog:
            raise SystemExit(f"{capture} to {kind}: {count} messages for {backlog} committed")
        pg_used = sum(v - pg0.get(pid, 0.0) for pid, v in pg1.items())
        print(
            f"  WAL per message ({capture}): {write_wal:,.0f} bytes written by the commits,"
            f" {drain_wal:,.0f} by the drain (the whole cluster's, this run only)"
        )
        return backlog / elapsed, 1e6 * (cpu1 - cpu0) / backlog, 1e6 * pg_used / backlog
    finally:
        if outbox.wal_slot is not None:
            with contextlib.suppress(Exception):
                await outbox.wal_slot.drop()
        await outbox.aclose()
        await brokers.delete(kind, stream)


async def bench_drain(url: str, kinds: list[str], rounds: int, backlog: int, per_txn: int) -> None:
    banner(
        f"(b) drain: {backlog:,} messages, {per_txn} per transaction, 1 process, {rounds} rounds"
    )
    brokers = Brokers()
    await brokers.connect(kinds)
    rows = []
    try:
        for kind in kinds:
            got: dict[str, list[tuple[float, float, float]]] = {"table": [], "wal": []}
            for r in range(rounds):
                for capture in ("table", "wal") if r % 2 == 0 else ("wal", "table"):
                    res = await drain_round(url, brokers, kind, capture, backlog, per_txn)
                    got[capture].append(res)
                    print(
                        f"  round {r + 1} {kind} {capture}: {res[0]:,.0f} msg/s,"
                        f" relay {res[1]:.1f} µs/msg, PostgreSQL {res[2]:.1f} µs/msg",
                        flush=True,
                    )
            t, w = (median(x[0] for x in got[c]) for c in ("table", "wal"))
            relay = [fmt(median(x[1] for x in got[c]), 1) for c in ("table", "wal")]
            pg = [fmt(median(x[2] for x in got[c]), 1) for c in ("table", "wal")]
            rows.append((kind, fmt(t), fmt(w), f"{w / t:.2f}x", " / ".join(relay), " / ".join(pg)))
    finally:
        await brokers.close()
    print(
        table(
            [
                *("broker", "table msg/s", "wal msg/s", "wal / table"),
                *("relay µs/msg (table / wal)", "PostgreSQL µs/msg (table / wal)"),
            ],
            rows,
        )
    )


async def latency_round(url: str, capture: str, rate: float, seconds: float) -> list[float]:
    """Commit → XREAD latencies (ms) at ``rate`` commits/s of one message each, the
    relay in this process (woken by the in-process signal after each commit)."""
    import redis.asyncio as aioredis

    from benchmarks._common import REDIS_URL
    from fastapi_outbox import Message, Outbox, OutboxSettings
    from fastapi_outbox.brokers import RedisStreamsBroker

    stream = unique("wallat")
    outbox = Outbox(
        url,
        brokers={"default": RedisStreamsBroker(REDIS_URL)},
        settings=OutboxSettings(capture=capture, table_name=unique("lat")),
    )
    reader = aioredis.Redis.from_url(REDIS_URL)
    committed: dict[str, float] = {}
    received: dict[str, float] = {}
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            stop = asyncio.Event()

            async def consume() -> None:
                last = "0-0"  # a new stream: "$" would miss entries added between two calls
                while not stop.is_set():
                    answer = await reader.xread({stream: last}, block=200, count=1000)
                    now = time.perf_counter()
                    for _name, entries in answer:
                        for entry_id, fields in entries:
                            received[fields[b"id"].decode()] = now
                            last = entry_id

            async with asyncio.TaskGroup() as tg:
                tg.create_task(consume())
                await asyncio.sleep(0.3)
                start = time.perf_counter()
                n = 0
                while (elapsed := time.perf_counter() - start) < seconds:
                    async with outbox.unit_of_work() as uow:
                        message_id = uow.publish(Message(stream, "Tick", {"n": n}))
                    committed[str(message_id)] = time.perf_counter()
                    n += 1
                    await asyncio.sleep(max(0.0, n / rate - elapsed))
                for _ in range(200):  # at most 10 s for the last ones to arrive
                    if len(received) >= len(committed):
                        break
                    await asyncio.sleep(0.05)
                stop.set()
        return [(received[i] - t) * 1000 for i, t in committed.items() if i in received]
    finally:
        if outbox.wal_slot is not None:
            with contextlib.suppress(Exception):
                await outbox.wal_slot.drop()
        await outbox.aclose()
        await reader.delete(stream)
        await reader.aclose()


async def bench_latency(url: str, rounds: int, rate: float, seconds: float) -> None:
    from benchmarks._common import percentile

    banner(f"(c) commit → XREAD latency at {rate:g} commits/s, relay in-process")
    got: dict[str, list[float]] = {"table": [], "wal": []}
    for r in range(rounds):
        for capture in ("table", "wal"):
            values = await latency_round(url, capture, rate, seconds)
            got[capture].extend(values)
            print(
                f"  round {r + 1} {capture}: p50 {percentile(values, 50):.1f} ms, "
                f"p99 {percentile(values, 99):.1f} ms ({len(values)} messages)",
                flush=True,
            )
    rows = [
        (c, fmt(percentile(v, 50), 1), fmt(percentile(v, 99), 1), len(v)) for c, v in got.items()
    ]
    print(table(["capture", "p50 ms", "p99 ms", "messages"], rows))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parts = ["write", "drain", "latency"]
    parser.add_argument("--only", nargs="*", choices=parts, default=parts)
    parser.add_argument(
        "--brokers", nargs="*", choices=["redis", "nats"], default=["redis", "nats"]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--backlog", type=int, default=50_000)
    parser.add_argument("--per-txn", type=int, default=10)
    parser.add_argument("--rate", type=float, default=500.0, help="commits/s of (c)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.backlog = 1, 2.0, 5_000
    from tests.servers import PrivatePostgres

    print(machine_note())
    cluster = PrivatePostgres(PORTS)
    cluster.start()
    try:
        import asyncpg

        admin = await asyncpg.connect(cluster.url.replace("+asyncpg", ""))
        await admin.execute("CREATE DATABASE bench_wal")
        await admin.close()
        url = cluster.url.rsplit("/", 1)[0] + "/bench_wal"
        if "write" in args.only:
            await bench_writes(url, args.rounds, args.seconds, args.connections)
        if "drain" in args.only:
            await bench_drain(url, args.brokers, args.rounds, args.backlog, args.per_txn)
        if "latency" in args.only:
            await bench_latency(url, args.rounds, args.rate, args.seconds)
    finally:
        cluster.stop()
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
