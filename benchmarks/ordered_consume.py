"""Ordered consumption across processes: handled messages/s of an ``ordered=True``
subscriber run by 1, 2 and 3 processes, against the same handler unordered and a
hand-written single ordered reader, on Redis Streams and NATS JetStream (PostgreSQL inbox).

Each round fills a new stream with N messages of K keys (the outbox's publish format),
then drains it into PostgreSQL with one of:

* **ordered xP**: P processes of ``fastapi-outbox dispatch --app
  tests.acceptance.ordered_app:outbox`` (``ordered=True``: keys hashed into
  ``consumer_ordered_partitions`` = 16 partitions leased in the database, each process
  reading the stream itself; the queued messages of a partition in one transaction, up to
  ``consumer_batch_size``, with the fence); **ordered message x1**: ``batch=False``, a
  transaction per message;
* **unordered batch x1** / **unordered message x1**: one process of the same app with
  ``ordered=False`` (a transaction per fetched batch, the default; ``batch=False``: a
  transaction per message) — what the subscriber costs without the ordering;
* **baseline**: a hand-written ordered consumer in this process: one loop reading the
  stream from its position (``XREAD`` / a JetStream ordered consumer), one asyncpg
  transaction per message (the effect row and the position, as the library's fence
  writes it), in stream order; no inbox, no partitions, no second process.

Rate = the messages from the 10% mark to the last / the time between them (the processes'
start-up is not counted). Rounds alternate their order (A B C, C B A). The machine is shared
and loaded: compare the figures of one run with each other, not with other runs.

    python benchmarks/ordered_consume.py                 # N=3,000, K=64, 2 rounds, both brokers
    python benchmarks/ordered_consume.py --brokers redis --messages 5000 --rounds 3
    python benchmarks/ordered_consume.py --brokers redis --sides "ordered x1,ordered message x1"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg

from benchmarks._common import (
    BROKER_URLS,
    asyncpg_dsn,
    banner,
    bench_database,
    fmt,
    machine_note,
    median,
    table,
    unique,
)
from fastapi_outbox import Outbox, OutboxSettings, uuid7
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.events import Envelope

REPO = Path(__file__).resolve().parent.parent
APP = "tests.acceptance.ordered_app:outbox"


def envelopes(stream: str, count: int, keys: int) -> list[Envelope]:
    out = []
    for n in range(count):
        key = f"key-{n % keys}"
        message_id = str(uuid7())
        body = json.dumps({"key": key, "step": n // keys}).encode()
        headers = {"message-id": message_id, "type": "Step"}
        out.append(Envelope(message_id, stream, "Step", key, body, headers))
    return out


async def fill(url: str, stream: str, count: int, keys: int) -> None:
    broker = broker_from_url(url)
    await broker.connect()
    try:
        batch = envelopes(stream, count, keys)
        for start in range(0, count, 500):
            results = await broker.publish(batch[start : start + 500])
            assert all(r is None for r in results), results
    finally:
        await broker.aclose()


async def cleanup(kind: str, url: str, stream: str) -> None:
    if kind == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        keys = [k async for k in client.scan_iter(match=f"*{stream}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    else:
        import nats

        from fastapi_outbox.brokers.nats.wire import stream_name_for

        nc = await nats.connect(url)
        js = nc.jetstream()
        for info in await js.streams_info():
            if info.config.name.startswith(stream_name_for(stream)):
                await js.delete_stream(info.config.name)
        await nc.close()


async def _prepare(db: str) -> None:
    outbox = Outbox(db, settings=OutboxSettings(run_relays=False))
    await outbox.create_tables()
    await outbox.aclose()
    pg = await asyncpg.connect(asyncpg_dsn(db))
    try:
        await pg.execute(
            "CREATE TABLE IF NOT EXISTS steps (id serial PRIMARY KEY, key text NOT NULL, "
            "step int NOT NULL, member text NOT NULL)"
        )
        await pg.execute(
            "CREATE TABLE IF NOT EXISTS positions (stream text PRIMARY KEY, position text)"
        )
    finally:
        await pg.close()


async def _rate(pg: Any, total: int, deadline: float, where: str = "") -> float:
    """Messages/s between the 10% mark and ``total`` rows of ``steps``."""
    mark = max(1, total // 10)
    t_mark: float | None = None
    while time.monotonic() < deadline:
        n = int(await pg.fetchval(f"SELECT count(*) FROM steps {where}"))
        now = time.monotonic()
        if t_mark is None and n >= mark:
            t_mark, n_mark = now, n
        if n >= total:
            assert t_mark is not None
            return (n - n_mark) / max(1e-6, now - t_mark)
        await asyncio.sleep(0.02)
    raise TimeoutError(f"{total} messages not handled in time")


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL)


async def run_processes(
    kind: str, url: str, db: str, mode: str, processes: int, n: int, keys: int
) -> float:
    stream = unique("ordbench")
    await fill(url, stream, n, keys)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "DATABASE_URL": db,
        "BROKER_URL": url,
        "CONSUMER_STREAM": stream,
        "CONSUMER_GROUP": unique("g"),
        "CONSUMER_MODE": mode,
        "OUTBOX_CONSUMER_CLAIM_IDLE_SECONDS": "5",
        "OUTBOX_CONSUMER_RETRY_MAX_DELAY_SECONDS": "1",
        "PYTHONPATH": str(REPO),
    }
    argv = [sys.executable, "-m", "fastapi_outbox", "dispatch", "--app", APP]
    pg = await asyncpg.connect(asyncpg_dsn(db))
    await pg.execute("TRUNCATE steps")
    procs = [_spawn(argv, env) for _ in range(processes)]
    try:
        return await _rate(pg, n, time.monotonic() + 300)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
        await pg.close()
        await cleanup(kind, url, stream)


async def run_baseline(kind: str, url: str, db: str, n: int, keys: int) -> float:
    """One reader, one transaction per message: the effect and the position."""
    stream = unique("ordbench")
    await fill(url, stream, n, keys)
    pool = await asyncpg.create_pool(asyncpg_dsn(db), min_size=1, max_size=2)
    pg = await asyncpg.connect(asyncpg_dsn(db))
    await pg.execute("TRUNCATE steps")

    async def store(entry: str, body: bytes) -> None:
        step = json.loads(body)
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO positions VALUES ($1, $2) ON CONFLICT (stream) DO UPDATE "
                "SET position = excluded.position",
                stream,
                entry,
            )
            await conn.execute(
                "INSERT INTO steps (key, step, member) VALUES ($1, $2, 'baseline')",
                step["key"],
                step["step"],
            )

    async def consume_redis() -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        position, done = "0-0", 0
        try:
            while done < n:
                reply = await client.xread({stream: position}, count=200, block=1000)
                for _name, entries in reply or []:
                    for entry_id, fields in entries:
                        await store(entry_id.decode(), fields[b"payload"])
                        position, done = entry_id, done + 1
        finally:
            await client.aclose()

    async def consume_nats() -> None:
        import nats

        nc = await nats.connect(url)
        js = nc.jetstream()
        sub = await js.subscribe(stream, ordered_consumer=True)
        done = 0
        try:
            while done < n:
                msg = await sub.next_msg(timeout=5)
                await store(str(msg.metadata.sequence.stream), msg.data)
                done += 1
        finally:
            await nc.close()

    task = asyncio.create_task(consume_redis() if kind == "redis" else consume_nats())
    try:
        return await _rate(pg, n, time.monotonic() + 300)
    finally:
        await task
        await pg.close()
        await pool.close()
        await cleanup(kind, url, stream)


SIDES = {
    "ordered message x1": ("ordered-message", 1),
    "ordered x1": ("ordered", 1),
    "ordered x2": ("ordered", 2),
    "ordered x3": ("ordered", 3),
    "unordered batch x1": ("batch", 1),
    "unordered message x1": ("message", 1),
    "baseline": ("baseline", 1),
}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--brokers", default="redis,nats")
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help="comma-separated sides to run (baseline always runs), e.g. 'ordered x1'",
    )
    args = parser.parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown sides {unknown}; known: {list(SIDES)}")
    if "baseline" not in sides:
        sides.append("baseline")
    banner(f"ordered consumption: N={args.messages}, K={args.keys} keys, {machine_note()}")
    async with bench_database("ordbench") as db:
        await _prepare(db)
        for kind in args.brokers.split(","):
            url = BROKER_URLS[kind]
            rates: dict[str, list[float]] = {side: [] for side in sides}
            order = list(sides)
            for r in range(args.rounds):
                for side in order if r % 2 == 0 else list(reversed(order)):
                    mode, processes = SIDES[side]
                    if mode == "baseline":
                        rate = await run_baseline(kind, url, db, args.messages, args.keys)
                    else:
                        rate = await run_processes(
                            kind, url, db, mode, processes, args.messages, args.keys
                        )
                    rates[side].append(rate)
                    print(f"  {kind} round {r + 1} {side}: {rate:,.0f} msg/s", flush=True)
            base = median(rates["baseline"])
            rows = [[side, fmt(median(v)), f"{median(v) / base:.2f}x"] for side, v in rates.items()]
            banner(f"{kind}: median msg/s ({machine_note()})")
            print(table(["side", "msg/s", "/ baseline"], rows))


if __name__ == "__main__":
    asyncio.run(main())
