"""Child processes of ``benchmarks/dispatch.py``: the hand-written baseline relay, the
latency producer and the latency consumer.

    python -m benchmarks._roles relay    '<json options>'
    python -m benchmarks._roles producer '<json options>'
    python -m benchmarks._roles consumer '<json options>'

Each prints ``READY`` once it is connected and set up, and stops on SIGTERM (or when its
work is done). The relay is the baseline the library is compared with: the minimal
batched relay of the reference figures — claim 500 rows with one ``UPDATE … RETURNING``
(raw asyncpg, ``FOR UPDATE SKIP LOCKED``), publish them in one pipelined round trip (Redis
XADD), as concurrent JetStream publishes with ``Nats-Msg-Id`` or as concurrent aio-pika
publishes with confirms (RabbitMQ, persistent and mandatory) or as aiokafka sends with
``acks="all"`` whose acknowledgements are all awaited (Kafka), mark them with one
``= ANY($1)`` UPDATE. No retries, backoff, fencing checks or de-duplication scripts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CLAIM_SQL = """
WITH due AS (
    SELECT id FROM {table}
    WHERE broker = $1 AND status IN ('pending', 'processing', 'failed')
      AND next_attempt_at <= now()
    ORDER BY next_attempt_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} t
SET status = 'processing', locked_by = $3, locked_until = now() + interval '30 seconds',
    next_attempt_at = now() + interval '30 seconds', attempts = t.attempts + 1
FROM due WHERE t.id = due.id
RETURNING t.id, t.stream, t.type, t.key, t.payload::text, t.headers::text
"""

MARK_SQL = """
UPDATE {table}
SET status = 'published', published_at = now(), locked_by = NULL, locked_until = NULL
WHERE id = ANY($1::uuid[]) AND locked_by = $2
"""


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


# -- the baseline relay ----------------------------------------------------------------------


async def relay(opts: dict[str, Any]) -> None:
    import asyncpg

    table = opts.get("table", "outbox_messages")
    claim_sql = CLAIM_SQL.format(table=table)
    mark_sql = MARK_SQL.format(table=table)
    broker_name = opts["broker_name"]
    batch = int(opts.get("batch", 500))
    stop = _stop_event()
    conn = await asyncpg.connect(opts["dsn"])
    listen = await asyncpg.connect(opts["dsn"])
    wake = asyncio.Event()
    await listen.add_listener(opts["channel"], lambda *_: wake.set())
    url: str = opts["broker_url"]
    if url.startswith("redis"):
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        await client.ping()

        async def publish(rows: list[Any]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for r in rows:
                pipe.xadd(
                    r[1],
                    {
                        "id": str(r[0]),
                        "type": r[2],
                        "key": r[3] or "",
                        "headers": r[5],
                        "payload": r[4],
                    },
                )
            await pipe.execute()
            return [r[0] for r in rows]

        async def close() -> None:
            await client.aclose()

    elif url.startswith("kafka"):
        from aiokafka import AIOKafkaProducer

        from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

        # acks="all", the library's batch size and linger; every send of the batch awaited
        # before the mark. No idempotence (Tansu grants no producer id).
        producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap_servers(url),
            acks="all",
            max_batch_size=512 * 1024,
            linger_ms=0,
        )
        await producer.start()

        async def publish(rows: list[Any]) -> list[Any]:
            futures = []
            for r in rows:
                headers = [(k, str(v).encode()) for k, v in json.loads(r[5]).items()]
                futures.append(
                    await producer.send(
                        r[1], r[4].encode(), key=(r[3] or "").encode() or None, headers=headers
                    )
                )
            acks = await asyncio.gather(*futures, return_exceptions=True)
            return [r[0] for r, a in zip(rows, acks, strict=True) if not isinstance(a, Exception)]

        async def close() -> None:
            await producer.stop()

    elif url.startswith("amqp"):
        import aio_pika

        amqp = await aio_pika.connect(url)
        channel = await amqp.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange("outbox", "topic", durable=True)

        async def publish(rows: list[Any]) -> list[Any]:
            # Persistent, mandatory, confirmed: what the library guarantees, by hand.
            confirms = [
                exchange.publish(
                    aio_pika.Message(
                        r[4].encode(),
                        message_id=str(r[0]),
                        type=r[2],
                        headers={**json.loads(r[5]), "key": r[3] or ""},
                        content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=r[1],
                    mandatory=True,
                )
                for r in rows
            ]
            acks = await asyncio.gather(*confirms, return_exceptions=True)
            return [r[0] for r, a in zip(rows, acks, strict=True) if not isinstance(a, Exception)]

        async def close() -> None:
            await amqp.close()

    else:
        import nats

        nc = await nats.connect(url)
        js = nc.jetstream(timeout=10)

        async def publish(rows: list[Any]) -> list[Any]:
            futures = []
            for r in rows:
                headers = {"Nats-Msg-Id": str(r[0]), **json.loads(r[5])}
                futures.append(await js.publish_async(r[1], r[4].encode(), headers=headers))
            acks = await asyncio.gather(*futures, return_exceptions=True)
            return [r[0] for r, a in zip(rows, acks, strict=True) if not isinstance(a, Exception)]

        async def close() -> None:
            await nc.close()

    print("READY", flush=True)
    token_base = f"baseline:{os.getpid()}"
    n = 0
    published = 0
    try:
        while not stop.is_set():
            n += 1
            token = f"{token_base}:{n}"
            rows = await conn.fetch(claim_sql, broker_name, batch, token)
            if not rows:
                wake.clear()
                waiter = asyncio.ensure_future(wake.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait([waiter, stopper], timeout=1.0, return_when="FIRST_COMPLETED")
                waiter.cancel()
                stopper.cancel()
                continue
            ok = await publish(list(rows))
            await conn.execute(mark_sql, ok, token)
            published += len(ok)
    finally:
        print(f"published {published}", flush=True)
        await close()
        await listen.close()
        await conn.close()


# -- latency: producer and consumer ----------------------------------------------------------


async def producer(opts: dict[str, Any]) -> None:
    """Commits one message per transaction through ``outbox.unit_of_work()`` at a steady
    rate; records each message's commit time (SQLAlchemy ``after_commit``)."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    from fastapi_outbox import Message, Outbox, OutboxSettings
    from fastapi_outbox.brokers import broker_from_url

    def committed(session: Session) -> None:
        session.info["committed_at"] = time.time()

    event.listen(Session, "after_commit", committed)
    settings = OutboxSettings(run_relays=opts["in_process"])
    outbox = Outbox(
        opts["db_url"],
        brokers={"default": broker_from_url(opts["broker_url"])},
        settings=settings,
        engine_options={"pool_size": 12, "max_overflow": 0},
    )
    rate = float(opts["rate"])
    total = int(rate * float(opts["seconds"]))
    stream = opts["stream"]
    commit_times: dict[str, float] = {}
    start_times: dict[str, float] = {}
    errors = 0
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        nonlocal errors
        try:
            started = time.time()
            async with outbox.unit_of_work() as uow:
                mid = uow.publish(
                    Message(stream=stream, type="Tick", payload={"seq": i, "pad": "x" * 120})
                )
            commit_times[str(mid)] = uow.session.info["committed_at"]
            start_times[str(mid)] = started
        except Exception as exc:
            errors += 1
            print(f"producer error: {type(exc).__name__}: {exc}", flush=True)
        finally:
            sem.release()

    async def produce() -> float:
        loop = asyncio.get_running_loop()
        tasks = set()
        start = loop.time() + 0.1
        # A producer that falls behind (busy machine) stops at twice the planned time:
        # the run stays bounded and the achieved rate tells what happened.
        stop_at = start + 2 * float(opts["seconds"])
        for i in range(total):
            if loop.time() > stop_at:
                break
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await sem.acquire()
            task = asyncio.ensure_future(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        return loop.time() - start

    print("READY", flush=True)
    # The CPU of the producing only (not the imports and the start-up).
    if opts["in_process"]:
        async with outbox.relaying():
            cpu0 = time.process_time()
            elapsed = await produce()
            cpu = time.process_time() - cpu0
            await asyncio.sleep(float(opts.get("linger", 2.0)))  # let the last ones go out
    else:
        # As an API-only process's lifespan does: the coalesced NOTIFY sender runs.
        async with outbox.relays.notifying():
            cpu0 = time.process_time()
            elapsed = await produce()
            cpu = time.process_time() - cpu0
    await outbox.aclose()
    result = {
        "commits": commit_times,
        "starts": start_times,
        "elapsed": elapsed,
        "errors": errors,
        "cpu": cpu,
    }
    await asyncio.to_thread(Path(opts["out"]).write_text, json.dumps(result))
    print(f"produced {len(commit_times)} in {elapsed:.2f}s", flush=True)


async def consumer(opts: dict[str, Any]) -> None:
    """Reads the stream with XREAD BLOCK (NATS: subscribes to the subject) and records when
    each message arrived."""
    stop = _stop_event()
    expected = int(opts["expected"])
    received: dict[str, float] = {}
    occurred: dict[str, str] = {}
    if opts["broker_url"].startswith("nats"):
        import nats

        nc = await nats.connect(opts["broker_url"])
        done = asyncio.Event()

        async def on_msg(msg: Any) -> None:
            now = time.time()
            mid = msg.headers["Nats-Msg-Id"]
            received.setdefault(mid, now)
            occurred[mid] = msg.headers.get("occurred-at", "")
            if len(received) >= expected:
                done.set()

        await nc.subscribe(opts["stream"], cb=on_msg)
        await nc.flush()
        print("READY", flush=True)
        stopper = asyncio.ensure_future(stop.wait())
        finished = asyncio.ensure_future(done.wait())
        await asyncio.wait(
            [stopper, finished], timeout=float(opts["timeout"]), return_when="FIRST_COMPLETED"
        )
        stopper.cancel()
        finished.cancel()
        await nc.close()
        result = {"received": received, "occurred": occurred}
        await asyncio.to_thread(Path(opts["out"]).write_text, json.dumps(result))
        print(f"received {len(received)}", flush=True)
        return
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(opts["broker_url"])
    last = "0-0"
    deadline = time.monotonic() + float(opts["timeout"])
    print("READY", flush=True)
    while len(received) < expected and time.monotonic() < deadline and not stop.is_set():
        reply: Any = await client.xread({opts["stream"]: last}, count=1000, block=200)
        now = time.time()
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                mid = fields[b"id"].decode()
                received.setdefault(mid, now)
                headers = json.loads(fields[b"headers"])
                occurred[mid] = headers.get("occurred-at", "")
    await client.aclose()
    result = {"received": received, "occurred": occurred}
    await asyncio.to_thread(Path(opts["out"]).write_text, json.dumps(result))
    print(f"received {len(received)}", flush=True)


def main() -> None:
    role, raw = sys.argv[1], sys.argv[2]
    opts = json.loads(raw)
    fn = {"relay": relay, "producer": producer, "consumer": consumer}[role]
    asyncio.run(fn(opts))


if __name__ == "__main__":
    main()
