"""Consume: handled messages/s of ``@outbox.subscriber`` (inbox, effects once) against a
minimal hand-written consumer, on Redis Streams, NATS JetStream, RabbitMQ and Kafka.

Each round fills a new stream with N messages in the outbox's publish format (the
library's own broker ``publish``), then drains it into PostgreSQL:

* **library** (per message): ``Outbox`` + ``@outbox.subscriber(stream, group=…,
  start="all")`` whose handler adds one ORM object per message (``session.add(Effect(…))``);
  default settings (batch transactions, ``consumer_batch_size=100``), ``consumer_concurrency``
  from ``--concurrency`` (default: the library's default, 8);
* **library_insert** / **library_arrays**: a batch handler (``ticks: list[Tick]``) writing
  the batch's effects in one statement: ``session.execute(insert(Effect), [dicts])``
  (executemany), or ``INSERT … SELECT unnest(:ns, :ids)`` (the baseline's statement);
  the engine's connections are opened before the clock starts (the baseline's pool is
  created before it too);
* **baseline**: ``--loops`` (default 4) concurrent loops, each: read a batch of 100
  (``XREADGROUP`` / pull ``fetch`` / up to 100 pushed to an aio-pika consumer on a channel
  of the loop's own, prefetch 200), one asyncpg transaction inserting the processed ids
  (``INSERT … SELECT unnest … ON CONFLICT DO NOTHING RETURNING``) and the effects of the new
  ones (``INSERT … SELECT unnest``), then ack the batch (``XACK`` / ``msg.ack()`` /
  ``basic.ack`` with ``multiple``). On Kafka: one aiokafka consumer in a group of its own,
  a loop per partition (``getmany`` of up to 100 records of it, the transaction, then
  ``commit`` of the offset after the batch). On RabbitMQ each stream gets the library group's quorum
  queue and the baseline's before it is filled (a queue holds what comes after it).

* **baseline (ORM effects)**: the same loops, the transaction through a SQLAlchemy
  ``AsyncSession`` with the effects as ORM objects (``session.add_all``), as the library's
  handler writes them: the ratio against it is the library's own overhead.

Each side first handles ``--warmup`` messages (default 5,000) of the stream; rate = the
N messages after them / the time they took — every side in its steady state (the library
builds its ``Outbox`` per round: its pool, prepared statements and type caches are cold at
first, while the baseline's asyncpg pool lives through the whole run). Rounds alternate
(A B C, C B A, …); the table prints medians and the ratios library / baseline.

    python benchmarks/consume.py              # N=100,000, 3 rounds per broker
    python benchmarks/consume.py --concurrency 4   # as many handlers as baseline loops
    python benchmarks/consume.py --sides library_arrays,baseline
    python benchmarks/consume.py --quick      # N=5,000, 2 rounds
    python benchmarks/consume.py --brokers redis
    python benchmarks/consume.py --brokers rabbitmq
    python benchmarks/consume.py --brokers kafka   # BENCH_KAFKA_URL, else a private Tansu
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import BigInteger, Text, insert, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from benchmarks._common import (
    BROKER_URLS,
    asyncpg_dsn,
    banner,
    bench_database,
    fmt,
    kafka_server,
    loopback,
    machine_note,
    median,
    record_ratio,
    redis_client,
    table,
    unique,
)
from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWork, uuid7
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.consume.subscriber import BatchUnitOfWork
from fastapi_outbox.events import Envelope

BASELINE_BATCH = 100
SIDES = ("library", "library_insert", "library_arrays", "baseline", "baseline_orm")
TIMEOUT_SECONDS = 300.0


class Tick(Event, stream="bench_ticks"):
    n: int


def _tick_on(stream: str) -> type[Tick]:
    """``Tick`` on a run's own stream (a subscriber takes the events of its stream)."""

    class OwnTick(Tick, stream=stream, type_name="Tick"):
        pass

    return OwnTick


class Base(DeclarativeBase):
    pass


class Effect(Base):
    __tablename__ = "effects"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    n: Mapped[int]
    message_id: Mapped[str] = mapped_column(Text)


class Meter:
    """Rate over the messages handled after the first ``warmup`` ones: every side is
    measured in its steady state (pools, prepared statements, type caches warm). The clock
    stops when the ``total``-th message is handled (not when idle loops notice it)."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup = warmup
        self.total = total
        self.since: tuple[float, int] | None = (time.perf_counter(), 0) if warmup <= 0 else None
        self.until: tuple[float, int] | None = None
        self.cpu = [time.process_time(), 0.0]

    def seen(self, done: int) -> None:
        if self.since is None and done >= self.warmup:
            self.since = (time.perf_counter(), done)
            self.cpu[0] = time.process_time()
        if self.until is None and done >= self.total:
            self.until = (time.perf_counter(), done)
            self.cpu[1] = time.process_time()

    def cpu_us(self) -> float:
        """This process's CPU time (``time.process_time``) per message over the measured
        span, in µs: the library's own cost, less noisy than the rate on a shared machine."""
        assert self.since is not None and self.until is not None
        return 1e6 * (self.cpu[1] - self.cpu[0]) / (self.until[1] - self.since[1])

    def rate(self) -> float:
        assert self.since is not None and self.until is not None
        (started, base), (ended, done) = self.since, self.until
        return (done - base) / (ended - started)


def envelopes(stream: str, count: int) -> list[Envelope]:
    out = []
    for n in range(count):
        mid = str(uuid7())
        out.append(
            Envelope(
                mid,
                stream,
                "Tick",
                None,
                json.dumps({"n": n}).encode(),
                {"message-id": mid, "type": "Tick", "correlation-id": "bench"},
            )
        )
    return out


async def rabbit_queues(url: str, stream: str, *, delete: bool = False) -> None:
    """The library group's queue (as it declares it) and the baseline's, bound to
    ``stream`` on the library's default exchange; or, ``delete``, gone."""
    import aio_pika

    from fastapi_outbox.brokers.rabbitmq.consumer import DELIVERY_LIMIT

    conn = await aio_pika.connect(url)
    try:
        channel = await conn.channel()
        for name in (f"{stream}.bench", f"{stream}.bench.dlq", f"{stream}.baseline"):
            if delete:
                await channel.queue_delete(name)
            elif not name.endswith(".dlq"):
                queue = await channel.declare_queue(
                    name,
                    durable=True,
                    arguments={"x-queue-type": "quorum", "x-delivery-limit": DELIVERY_LIMIT},
                )
                await queue.bind("outbox", routing_key=stream)
    finally:
        await conn.close()


async def fill(url: str, stream: str, count: int, options: dict[str, Any] | None = None) -> None:
    """``count`` messages into ``stream`` through the library's broker (``options``: its
    keyword arguments, e.g. ``replicas=3`` on a NATS cluster)."""
    broker = broker_from_url(url, **(options or {}))
    await broker.connect()
    if url.startswith("amqp"):
        await rabbit_queues(url, stream)
    try:
        batch = envelopes(stream, count)
        for start in range(0, count, 500):
            results = await broker.publish(batch[start : start + 500])
            assert all(r is None for r in results), results
    finally:
        await broker.aclose()


async def cleanup(kind: str, url: str, stream: str) -> None:
    if kind == "rabbitmq":
        await rabbit_queues(url, stream, delete=True)
    elif kind == "kafka":
        from aiokafka.admin import AIOKafkaAdminClient

        from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers(url))
        await admin.start()
        try:
            await admin.delete_topics([stream, f"{stream}.bench.dlq"])
        finally:
            await admin.close()
    elif kind == "redis":
        client = redis_client(url)
        keys = [k async for k in client.scan_iter(match=f"*{stream}*")]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
        await client.aclose()
    else:
        import nats

        from fastapi_outbox.brokers.nats.wire import stream_name_for

        nc = await nats.connect(servers=url.split(","))
        js = nc.jetstream()
        for info in await js.streams_info():
            if info.config.name.startswith(stream_name_for(stream)):
                await js.delete_stream(info.config.name)
        await nc.close()


async def run_library(
    db_url: str,
    url: str,
    stream: str,
    count: int,
    batch: str = "",
    concurrency: int = 8,
    warmup: int = 0,
    *,
    options: dict[str, Any] | None = None,
    probe: Callable[[], Awaitable[None]] | None = None,
) -> tuple[float, float]:
    """Rate and CPU µs per message of a subscriber of a fresh ``Outbox``; ``options``: the
    broker's keyword arguments; ``probe`` is awaited when the clock starts and when it stops
    (while the outbox's connections are still open: PostgreSQL CPU of its backends)."""
    outbox = Outbox(
        db_url,
        brokers={"default": broker_from_url(url, **(options or {}))},
        settings=OutboxSettings(consumer_concurrency=concurrency),
        engine_options={"pool_size": concurrency + 4, "max_overflow": 0},
    )
    _tick_on(stream)

    if batch == "insert":

        @outbox.subscriber(stream, group="bench", start="all")
        async def handle_batch(ticks: list[Tick], uow: BatchUnitOfWork) -> None:
            # SQLAlchemy's bulk insert: one statement, executemany.
            await uow.session.execute(
                insert(Effect),
                [{"n": t.n, "message_id": m} for t, m in zip(ticks, uow.message_ids, strict=True)],
            )
    elif batch == "arrays":

        @outbox.subscriber(stream, group="bench", start="all")
        async def handle_arrays(ticks: list[Tick], uow: BatchUnitOfWork) -> None:
            # One statement with PostgreSQL arrays, as the baseline writes the effects.
            await uow.session.execute(
                _BULK_EFFECTS, {"ns": [t.n for t in ticks], "ids": uow.message_ids}
            )
    else:

        @outbox.subscriber(stream, group="bench", start="all")
        async def handle(tick: Tick, uow: UnitOfWork) -> None:
            uow.session.add(Effect(n=tick.n, message_id=uow.causation_id))

    sub = outbox.subscribers[0]
    try:
        # Connections opened before the clock starts, as the baseline's pool has them.
        async def warm() -> None:
            async with outbox.engine.connect():
                await asyncio.sleep(0.05)

        await asyncio.gather(*(warm() for _ in range(concurrency + 2)))
        meter = Meter(warmup, count)
        async with outbox.relaying():
            deadline = time.perf_counter() + TIMEOUT_SECONDS
            probed = 0
            while meter.until is None:
                meter.seen(sub.stats.handled)
                if probe is not None and probed == 0 and meter.since is not None:
                    probed = 1
                    await probe()
                if time.perf_counter() > deadline:
                    raise SystemExit(f"library: {sub.stats.handled}/{count} after timeout")
                await asyncio.sleep(0.005)
            if probe is not None:
                await probe()
            measured = meter.rate(), meter.cpu_us()
    finally:
        await outbox.aclose()
    return measured


_BULK_EFFECTS = text(
    "INSERT INTO effects (n, message_id) "
    "SELECT * FROM unnest(CAST(:ns AS int[]), CAST(:ids AS text[]))"
)
_PROCESSED = (
    "INSERT INTO processed (grp, message_id) SELECT $1, unnest($2::text[]) "
    "ON CONFLICT DO NOTHING RETURNING message_id"
)
_EFFECTS = "INSERT INTO effects (n, message_id) SELECT * FROM unnest($1::int[], $2::text[])"


async def _store(pool: Any, ids: list[str], ns: list[int]) -> None:
    """asyncpg: processed ids and effects, two array statements in one transaction."""
    async with pool.acquire() as conn, conn.transaction():
        new = {r[0] for r in await conn.fetch(_PROCESSED, "baseline", ids)}
        keep = [(n, m) for n, m in zip(ns, ids, strict=True) if m in new]
        if keep:
            await conn.execute(_EFFECTS, [n for n, _ in keep], [m for _, m in keep])


def _orm_store(sessions: Any) -> Any:
    """The same transaction with the effects as ORM objects (what the library's handler
    does): separates the library's own cost from the ORM's."""
    from sqlalchemy import text

    processed = text(
        "INSERT INTO processed (grp, message_id) SELECT 'baseline', unnest(CAST(:ids AS text[])) "
        "ON CONFLICT DO NOTHING RETURNING message_id"
    )

    async def store(_pool: Any, ids: list[str], ns: list[int]) -> None:
        async with sessions() as session, session.begin():
            new = set((await session.execute(processed, {"ids": ids})).scalars())
            session.add_all(
                Effect(n=n, message_id=m) for n, m in zip(ns, ids, strict=True) if m in new
            )

    return store


async def run_baseline_redis(
    pool: Any,
    url: str,
    stream: str,
    count: int,
    loops: int,
    store: Any = _store,
    warmup: int = 0,
) -> float:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    await client.xgroup_create(stream, "baseline", id="0", mkstream=True)
    done = 0

    async def loop(i: int) -> None:
        nonlocal done
        while done < count:
            reply = await client.xreadgroup(
                "baseline", f"c{i}", {stream: ">"}, count=BASELINE_BATCH, block=100
            )
            if not reply:
                continue
            entries = reply[0][1]
            ids = [f[b"id"].decode() for _, f in entries]
            ns = [json.loads(f[b"payload"])["n"] for _, f in entries]
            await store(pool, ids, ns)
            await client.xack(stream, "baseline", *[e for e, _ in entries])
            done += len(entries)
            meter.seen(done)

    meter = Meter(warmup, count)
    try:
        await asyncio.wait_for(asyncio.gather(*(loop(i) for i in range(loops))), TIMEOUT_SECONDS)
        return meter.rate(), meter.cpu_us()
    finally:
        await client.aclose()


async def run_baseline_nats(
    pool: Any,
    url: str,
    stream: str,
    count: int,
    loops: int,
    store: Any = _store,
    warmup: int = 0,
) -> float:
    import nats
    import nats.errors
    import nats.js.api as api

    nc = await nats.connect(servers=url.split(","))
    js = nc.jetstream()
    name = await js.find_stream_name_by_subject(stream)
    config = api.ConsumerConfig(
        durable_name="baseline",
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        filter_subject=stream,
        max_ack_pending=-1,
    )
    subs = [
        await js.pull_subscribe(stream, durable="baseline", stream=name, config=config)
        for _ in range(loops)
    ]
    done = 0

    async def loop(psub: Any) -> None:
        nonlocal done
        while done < count:
            try:
                msgs = await psub.fetch(BASELINE_BATCH, timeout=0.5)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            ids = [m.headers["message-id"] for m in msgs]
            ns = [json.loads(m.data)["n"] for m in msgs]
            await store(pool, ids, ns)
            await asyncio.gather(*(m.ack() for m in msgs))
            done += len(msgs)
            meter.seen(done)

    meter = Meter(warmup, count)
    try:
        await asyncio.wait_for(asyncio.gather(*(loop(s) for s in subs)), TIMEOUT_SECONDS)
        return meter.rate(), meter.cpu_us()
    finally:
        await nc.close()


async def run_baseline_rabbitmq(
    pool: Any,
    url: str,
    stream: str,
    count: int,
    loops: int,
    store: Any = _store,
    warmup: int = 0,
) -> float:
    import aio_pika

    conn = await aio_pika.connect(url)
    done = 0

    async def loop() -> None:
        nonlocal done
        channel = await conn.channel()
        await channel.set_qos(prefetch_count=2 * BASELINE_BATCH)
        queue = await channel.declare_queue(f"{stream}.baseline", passive=True)
        pushed: asyncio.Queue[Any] = asyncio.Queue()
        await queue.consume(pushed.put)
        while done < count:
            try:
                msgs = [await asyncio.wait_for(pushed.get(), 0.5)]
            except TimeoutError:
                continue
            while len(msgs) < BASELINE_BATCH and not pushed.empty():
                msgs.append(pushed.get_nowait())
            ids = [m.message_id for m in msgs]
            ns = [json.loads(m.body)["n"] for m in msgs]
            await store(pool, ids, ns)
            await msgs[-1].ack(multiple=True)  # this channel's deliveries up to the last
            done += len(msgs)
            meter.seen(done)

    meter = Meter(warmup, count)
    try:
        await asyncio.wait_for(asyncio.gather(*(loop() for _ in range(loops))), TIMEOUT_SECONDS)
        return meter.rate(), meter.cpu_us()
    finally:
        await conn.close()


async def run_baseline_kafka(
    pool: Any,
    url: str,
    stream: str,
    count: int,
    loops: int,
    store: Any = _store,
    warmup: int = 0,
) -> float:
    """One consumer of a group of its own, a loop per partition (``loops`` is the
    partition count here): read up to 100 records, store them, commit past them."""
    from aiokafka import AIOKafkaConsumer

    from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

    consumer = AIOKafkaConsumer(
        stream,
        bootstrap_servers=bootstrap_servers(url),
        group_id=f"{stream}.baseline",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=10_000,
        heartbeat_interval_ms=3_000,
    )
    await consumer.start()
    done = 0

    async def loop(tp: Any) -> None:
        nonlocal done
        while done < count:
            batches = await consumer.getmany(tp, timeout_ms=500, max_records=BASELINE_BATCH)
            records = batches.get(tp)
            if not records:
                continue
            ids = [dict(r.headers)["message-id"].decode() for r in records]
            ns = [json.loads(r.value)["n"] for r in records]
            await store(pool, ids, ns)
            await consumer.commit({tp: records[-1].offset + 1})
            done += len(records)
            meter.seen(done)

    meter = Meter(warmup, count)
    try:
        while not consumer.assignment():  # the group's join
            await consumer.getmany(timeout_ms=100, max_records=1)
            await asyncio.sleep(0)
        for tp in consumer.assignment():  # what the join's getmany may have read comes again
            committed = await consumer.committed(tp)
            consumer.seek(tp, committed or 0)
        tps = sorted(consumer.assignment(), key=lambda tp: tp.partition)
        await asyncio.wait_for(asyncio.gather(*(loop(tp) for tp in tps)), TIMEOUT_SECONDS)
        return meter.rate(), meter.cpu_us()
    finally:
        await consumer.stop()


async def main() -> None:
    with kafka_server() if "kafka" in " ".join(sys.argv) else contextlib.nullcontext(""):
        await _main()


async def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=5,000, 2 rounds")
    parser.add_argument("--messages", type=int, help="messages per round")
    parser.add_argument("--rounds", type=int, help="rounds per broker and side")
    parser.add_argument("--loops", type=int, default=4, help="baseline's concurrent loops")
    parser.add_argument("--brokers", default="redis,nats", help="redis,nats,rabbitmq,kafka")
    parser.add_argument(
        "--warmup",
        type=int,
        default=5_000,
        help="messages handled before the clock starts, on every side (0: from the start)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=OutboxSettings().consumer_concurrency,
        help="library's consumer_concurrency (default: the library's default)",
    )
    parser.add_argument("--ratios", help="append the ratios to this JSON-lines file")
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help=f"which consumers run, among {','.join(SIDES)} (ratios need them)",
    )
    args = parser.parse_args()
    count = args.messages or (5_000 if args.quick else 100_000)
    rounds = args.rounds or (2 if args.quick else 3)
    urls = {kind: loopback(url) for kind, url in BROKER_URLS.items()}
    import asyncpg

    banner(
        f"consume: {count} messages per round after a warm-up of {args.warmup}, {rounds} rounds "
        f"per side, library concurrency {args.concurrency} — {machine_note()}"
    )
    rows: list[list[str]] = []
    cpu_rows: list[list[str]] = []
    async with bench_database("consume") as db_url:
        setup = await asyncpg.connect(asyncpg_dsn(db_url))
        await setup.execute(
            "CREATE TABLE effects (id bigserial PRIMARY KEY, n int NOT NULL, "
            "message_id text NOT NULL)"
        )
        await setup.execute(
            "CREATE TABLE processed (grp text, message_id text, PRIMARY KEY (grp, message_id))"
        )
        await setup.close()
        await Outbox(db_url, settings=OutboxSettings()).create_tables()
        pool = await asyncpg.create_pool(asyncpg_dsn(db_url), min_size=args.loops, max_size=8)
        from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

        orm_engine = create_async_engine(db_url, pool_size=args.loops, max_overflow=0)
        orm_store = _orm_store(async_sessionmaker(orm_engine, expire_on_commit=False))
        sides = [s for s in args.sides.split(",") if s]
        try:
            for kind in args.brokers.split(","):
                url = urls[kind]
                rates: dict[str, list[float]] = {side: [] for side in sides}
                cpus: dict[str, list[float]] = {side: [] for side in sides}
                for r in range(rounds):
                    order = sides if r % 2 == 0 else sides[::-1]
                    for side in order:
                        store = orm_store if side == "baseline_orm" else _store
                        stream = unique(f"consume_{side}")
                        total = count + args.warmup
                        await fill(url, stream, total)
                        try:
                            if side.startswith("library"):
                                rate, cpu = await run_library(
                                    db_url,
                                    url,
                                    stream,
                                    total,
                                    batch=side.removeprefix("library").strip("_"),
                                    concurrency=args.concurrency,
                                    warmup=args.warmup,
                                )
                            elif kind == "kafka":
                                rate, cpu = await run_baseline_kafka(
                                    pool, url, stream, total, args.loops, store, args.warmup
                                )
                            elif kind == "rabbitmq":
                                rate, cpu = await run_baseline_rabbitmq(
                                    pool, url, stream, total, args.loops, store, args.warmup
                                )
                            elif kind == "redis":
                                rate, cpu = await run_baseline_redis(
                                    pool, url, stream, total, args.loops, store, args.warmup
                                )
                            else:
                                rate, cpu = await run_baseline_nats(
                                    pool, url, stream, total, args.loops, store, args.warmup
                                )
                        finally:
                            await cleanup(kind, url, stream)
                        rates[side].append(rate)
                        cpus[side].append(cpu)
                        print(
                            f"  {kind} round {r + 1} {side}: {fmt(rate)} msg/s, "
                            f"{cpu:.1f} µs of this process's CPU per message",
                            flush=True,
                        )
                med = {side: median(r) if r else None for side, r in rates.items()}
                rows += _rows(kind, med)
                _record(args.ratios, kind, med)
                cpu_rows += [[kind, side, f"{median(c):.1f}"] for side, c in cpus.items() if c]
        finally:
            await pool.close()
            await orm_engine.dispose()
    print()
    headers = [
        "broker",
        "library",
        "msg/s",
        "hand-written (asyncpg) msg/s",
        "ratio",
        "hand-written (ORM effects) msg/s",
        "ratio",
    ]
    print(table(headers, rows))
    print()
    print(
        "CPU of this process per message handled (medians; PostgreSQL and the broker not counted):"
    )
    print(table(["broker", "side", "µs/msg"], cpu_rows))


#: Floors of the library's rate against a hand-written consumer: the batch handler writing
#: arrays against raw asyncpg; the per-message ORM handler against the ORM baseline.
BATCH_FLOOR = 0.9
ORM_FLOOR = 1.0


def _record(path: str | None, kind: str, med: dict[str, float | None]) -> None:
    base, orm = med.get("baseline"), med.get("baseline_orm")
    arrays, per_message = med.get("library_arrays"), med.get("library")
    if arrays and base and kind != "rabbitmq":
        what = f"consume {kind}, batch handler (arrays) / raw asyncpg"
        record_ratio(path, what, arrays / base, BATCH_FLOOR, most=False)
    if per_message and orm:
        what = f"consume {kind}, per-message ORM handler / hand-written ORM"
        record_ratio(path, what, per_message / orm, ORM_FLOOR, most=False)


def _rows(kind: str, med: dict[str, float | None]) -> list[list[str]]:
    """One table row per library side: its median and the ratios to the baselines."""

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a and b else "-"

    base, orm = med.get("baseline"), med.get("baseline_orm")
    out = []
    for side, label in (
        ("library", "per message, session.add"),
        ("library_insert", "batch, insert() executemany"),
        ("library_arrays", "batch, unnest arrays"),
    ):
        lib = med.get(side)
        if lib is None:
            continue
        out.append(
            [
                kind,
                label,
                fmt(lib),
                fmt(base) if base else "-",
                ratio(lib, base),
                fmt(orm) if orm else "-",
                ratio(lib, orm),
            ]
        )
    return out


if __name__ == "__main__":
    asyncio.run(main())
