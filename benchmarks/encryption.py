"""Encryption (``encryption_keys``): CPU µs per message of encrypting on the write path and
decrypting on the consume path, library with and without encryption in the same run,
alternating rounds (plain, encrypted, encrypted, plain, …), medians.

Four measurements, each for a small payload (~130 B) and a 7.3 KB one:

* **publish**: ``uow.publish(event)`` queueing rows on a unit of work (no I/O) — the
  write path's own CPU, where the encryption is;
* **publish + commit**: ``unit_of_work()`` with ``--batch`` events committed to PostgreSQL
  (a fresh database), CPU of this process per message (the database's CPU is not counted:
  it stores a few more bytes, nothing else changes for it);
* **restore + decode**: what a subscriber does with a delivery before its handler: the
  payload stages (decryption) and the pydantic validation, on deliveries as the Redis
  consumer makes them (headers still JSON text);
* **consume (Redis)**: ``@outbox.subscriber`` draining ``--messages`` messages from a Redis
  stream into PostgreSQL (per-message handler, inbox), CPU of this process per message.

    python benchmarks/encryption.py            # 5 rounds per variant
    python benchmarks/encryption.py --quick    # 2 rounds, fewer messages

The machine is shared and loaded: compare the two columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from benchmarks._common import (
    REDIS_URL,
    banner,
    bench_database,
    fmt,
    loopback,
    machine_note,
    median,
    table,
    unique,
)
from fastapi_outbox import Event, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.consume.handlers import Decoder
from fastapi_outbox.payloads import build_payloads

KEYS = {"k1": os.urandom(32)}
SIZES = {"130 B": 1, "7.3 KB": 80}


class Order(Event, stream="bench_enc"):
    order_id: int
    customer: str
    notes: list[str]


def order(n: int, size: int) -> Order:
    return Order(order_id=n, customer="c-42", notes=["x" * 90] * size)


def settings(encrypted: bool, **more: Any) -> OutboxSettings:
    return OutboxSettings(encryption_keys=KEYS if encrypted else None, **more)


def cpu_us_per(n: int, work: Callable[[], None]) -> float:
    start = time.process_time()
    work()
    return (time.process_time() - start) * 1e6 / n


async def publish_only(encrypted: bool, size: int, n: int) -> float:
    outbox = Outbox(
        "sqlite+aiosqlite://", brokers={"default": MemoryBroker()}, settings=settings(encrypted)
    )
    events = [order(i, size) for i in range(n)]
    try:
        session = outbox.session_factory()
        from fastapi_outbox import UnitOfWork

        uow = UnitOfWork(outbox._producer, session)

        def work() -> None:
            for e in events:
                uow.publish(e)

        result = cpu_us_per(n, work)
        await session.close()
        return result
    finally:
        await outbox.aclose()


async def publish_commit(url: str, encrypted: bool, size: int, n: int, batch: int) -> float:
    outbox = Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=settings(encrypted, run_relays=False),
    )
    events = [order(i, size) for i in range(n)]
    try:
        async with outbox.unit_of_work() as uow:  # warm the pool and the statements
            uow.publish(events[0])
        start = time.process_time()
        for i in range(0, n, batch):
            async with outbox.unit_of_work() as uow:
                for e in events[i : i + batch]:
                    uow.publish(e)
        return (time.process_time() - start) * 1e6 / n
    finally:
        async with outbox.engine.begin() as conn:
            from sqlalchemy import text

            await conn.execute(text(f"DELETE FROM {outbox.settings.table_name}"))
        await outbox.aclose()


def deliveries(encrypted: bool, size: int, n: int) -> list[Delivery]:
    import json

    payloads = build_payloads(settings(encrypted))
    out = []
    for i in range(n):
        payload, headers = payloads.seal(
            f"m{i}", "bench_enc", "Order", order(i, size).model_dump_json(), {}, None
        )
        headers = {**headers, "message-id": f"m{i}", "type": "Order"}
        out.append(
            Delivery(
                stream="bench_enc",
                entry_id=f"{i}-0",
                message_id=f"m{i}",
                type="Order",
                key=None,
                payload=payload.encode(),
                attempt=1,
                raw_headers=json.dumps(headers).encode(),
            )
        )
    return out


async def restore_decode(encrypted: bool, size: int, n: int) -> float:
    batch = deliveries(encrypted, size, n)
    payloads = build_payloads(settings(encrypted))
    decoder = Decoder((Order,), "bench")
    start = time.process_time()
    for d in batch:
        decoder.decode(await payloads.restore(d))
    return (time.process_time() - start) * 1e6 / n


async def consume_redis(url: str, encrypted: bool, size: int, n: int) -> float:
    stream = unique("bench_enc")
    producer = Outbox(
        url, brokers={"default": RedisStreamsBroker(REDIS_URL)}, settings=settings(encrypted)
    )
    consumer = Outbox(
        url, brokers={"default": RedisStreamsBroker(REDIS_URL)}, settings=settings(encrypted)
    )
    import redis.asyncio as aioredis

    client = aioredis.from_url(REDIS_URL)

    class Tick(Event, stream=stream):
        order_id: int
        customer: str
        notes: list[str]

    handled = 0

    async def handle(event: Any) -> None:
        nonlocal handled
        handled += 1

    handle.__annotations__ = {"event": Tick, "return": None}
    consumer.subscriber(stream, group="bench", start="all")(handle)
    try:
        async with producer.relaying():
            for i in range(0, n, 500):
                async with producer.unit_of_work() as uow:
                    for j in range(i, min(n, i + 500)):
                        uow.publish(Tick(order_id=j, customer="c-42", notes=["x" * 90] * size))
            while await client.xlen(stream) < n:  # noqa: ASYNC110 - a poll of Redis
                await asyncio.sleep(0.05)
        start = time.process_time()
        async with consumer.relaying():
            deadline = time.monotonic() + 300
            while handled < n and time.monotonic() < deadline:  # noqa: ASYNC110 - bounded
                await asyncio.sleep(0.02)
        if handled < n:
            raise SystemExit(f"consume: {handled} of {n} handled in 300 s")
        return (time.process_time() - start) * 1e6 / n
    finally:
        async for key in client.scan_iter(f"{stream}*"):
            await client.delete(key)
        await client.aclose()
        await producer.aclose()
        await consumer.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-consume", action="store_true", help="skip the Redis consume")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.messages = 2, 500
    loopback(REDIS_URL)
    n = args.messages
    print(f"encryption benchmark: {machine_note()}; {args.rounds} rounds, {n} messages")
    results: dict[tuple[str, str, bool], list[float]] = {}
    async with bench_database("bench_enc") as url:
        setup = Outbox(url, brokers={"default": MemoryBroker()})
        await setup.create_tables()
        await setup.aclose()
        for r in range(args.rounds):
            order_ = (False, True) if r % 2 == 0 else (True, False)
            for size_name, size in SIZES.items():
                for encrypted in order_:
                    runs: list[tuple[str, Any]] = [
                        ("publish", publish_only(encrypted, size, n)),
                        ("publish + commit", publish_commit(url, encrypted, size, n, args.batch)),
                        ("restore + decode", restore_decode(encrypted, size, n)),
                    ]
                    if not args.no_consume:
                        runs.append(("consume (Redis)", consume_redis(url, encrypted, size, n)))
                    for name, coro in runs:
                        value = await coro
                        results.setdefault((name, size_name, encrypted), []).append(value)
            print(f"round {r + 1} done", flush=True)
    banner("CPU µs per message (medians), this process")
    rows = []
    names = ["publish", "publish + commit", "restore + decode", "consume (Redis)"]
    for name in names:
        for size_name in SIZES:
            plain = median(results.get((name, size_name, False), []))
            enc = median(results.get((name, size_name, True), []))
            if plain != plain:  # skipped
                continue
            rows.append(
                (
                    name,
                    size_name,
                    fmt(plain, 1),
                    fmt(enc, 1),
                    fmt(enc - plain, 1),
                    f"{enc / plain:.2f}x",
                )
            )
    print(table(["step", "payload", "plain", "encrypted", "cost", "ratio"], rows))


if __name__ == "__main__":
    asyncio.run(main())
