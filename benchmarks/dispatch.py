"""Dispatch: drain rate, commit-to-publish latency and claim time.

(a) **Drain**: a backlog (100,000 rows; ``--quick`` 10,000) inserted in one
``INSERT … SELECT generate_series`` is drained to Redis Streams and to NATS JetStream by
the library's relay (``python -m fastapi_outbox dispatch --app
benchmarks.bench_app:outbox``; default settings — adaptive claims of 25 up to 500 rows,
workers 2 — and workers 1; de-duplication on: the
Redis script, ``Nats-Msg-Id``) with 1 and 2 processes, and by a minimal hand-written
batched relay (``benchmarks/_roles.py``) with 1 and 2 processes, in alternating rounds.
Rate = rows / (last ``published_at`` - commit of the backlog), both on the database clock;
completion is polled every 100 ms. CPU per message of the relay processes and of the
PostgreSQL backends is read from ``/proc``. Each group of processes drains only rows of its
own broker name, so all groups of a stage stay up and the rounds alternate without
restarts. One more drain runs under py-spy for the library and the baseline (hot spots).

(b) **Latency**: one producer process commits one message per transaction through
``outbox.unit_of_work()`` at a steady 1,000 msg/s for 10 s (``--quick`` 3 s); a consumer
process reads the Redis stream with XREAD BLOCK (``--latency-broker nats``: subscribes to
the JetStream subject); latency = receipt - commit (the producer's ``after_commit`` time).
Twice: with a separate relay process (woken by LISTEN/NOTIFY) and with the relay
in the producer's process (in-process wake-up).

(c) **Claim time**: ``Claims.claim`` of 100 pending rows, 50 times, with 1,000,000 published
rows in the table (``--quick`` 100,000) and with none; the raw SQL claim alongside.

    python benchmarks/dispatch.py             # full (~4-5 minutes)
    python benchmarks/dispatch.py --quick     # smoke run
    python benchmarks/dispatch.py --only drain --brokers redis
    python benchmarks/dispatch.py --only drain --brokers kafka --backlog 50000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    BROKER_URLS,
    NATS_URL,
    REDIS_URL,
    Proc,
    asyncpg_dsn,
    banner,
    bench_database,
    fmt,
    kafka_server,
    load_profile,
    loopback,
    machine_note,
    median,
    package_table,
    percentile,
    pg_cpu,
    proc_cpu,
    processes,
    py_spy,
    record_ratio,
    redis_client,
    start_profile,
    summarize_profile,
    table,
    unique,
)
from benchmarks._roles import CLAIM_SQL

TABLE = "outbox_messages"
#: The exchange both RabbitMQ relays publish to (the library's default).
RABBITMQ_EXCHANGE = "outbox"
APP = "benchmarks.bench_app:outbox"
#: The library's drain rate at least this much of the hand-written batched relay's, by
#: number of relay processes.
DRAIN_FLOORS = {1: 1.2, 2: 1.0}
LATENCY_GOALS_MS = (3.0, 15.0)  # p50, p99

# A backlog row as the unit of work writes it: ~200-byte JSON payload, the standard
# headers (message-id equal to the row id), due now; ids are UUIDv7 as the library makes
# them (time-ordered: a table partitioned by id keeps them in today's partition). ``$4`` is
# the status: 'pending' for a backlog, 'published' for the claim-time filler.
BACKLOG_SQL = f"""
INSERT INTO {TABLE}
    (id, broker, stream, type, key, payload, headers, status, attempts, next_attempt_at,
     created_at, published_at)
SELECT u.id, $1, $2, 'OrderPlaced', (u.i % 1000)::text,
    jsonb_build_object('order_id', u.i, 'customer', 'customer-' || u.i, 'total', 42.5,
                       'currency', 'EUR', 'note', repeat('x', 100)),
    jsonb_build_object('message-id', u.id::text, 'type', 'OrderPlaced',
                       'occurred-at', to_char(now() AT TIME ZONE 'UTC',
                                              'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
                       'correlation-id', gen_random_uuid()::text),
    $4::text, CASE WHEN $4::text = 'published' THEN 1 ELSE 0 END, now(), now(),
    CASE WHEN $4::text = 'published' THEN now() END
FROM (SELECT (lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::bigint), 12, '0')
              || '7' || substr(md5(random()::text), 1, 3) || '8'
              || substr(md5(random()::text), 1, 15))::uuid AS id, i
      FROM generate_series(1, $3::int) AS i) AS u
"""
ACTIVE = "status IN ('pending', 'processing', 'failed')"


# -- helpers ----------------------------------------------------------------------------------


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


class Brokers:
    """Creates and deletes the per-run Redis streams and JetStream streams.

    ``urls`` overrides the broker URLs (kind -> URL; a NATS URL may list several servers,
    comma-separated: a cluster); ``replicas`` is the ``num_replicas`` of the JetStream
    streams it creates."""

    def __init__(self, urls: dict[str, str] | None = None, *, replicas: int = 1) -> None:
        self.urls = {**BROKER_URLS, **(urls or {})}
        self.replicas = replicas
        self.redis: Any = None
        self.nc: Any = None
        self.js: Any = None
        self.amqp: Any = None
        self.amqp_channel: Any = None
        self.kafka: Any = None
        self.created: list[tuple[str, str]] = []

    async def connect(self, kinds: list[str]) -> None:
        if "kafka" in kinds:
            from aiokafka.admin import AIOKafkaAdminClient

            from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

            self.kafka = AIOKafkaAdminClient(
                bootstrap_servers=bootstrap_servers(loopback(self.urls["kafka"]))
            )
            await self.kafka.start()
        if "redis" in kinds:
            self.redis = redis_client(self.urls["redis"])
            await self.redis.ping()
        if "nats" in kinds:
            import nats

            servers = [loopback(u) for u in self.urls["nats"].split(",")]
            self.nc = await nats.connect(servers=servers)
            self.js = self.nc.jetstream()
        if "rabbitmq" in kinds:
            import aio_pika

            self.amqp = await aio_pika.connect(loopback(self.urls["rabbitmq"]))
            self.amqp_channel = await self.amqp.channel()
            await self.amqp_channel.declare_exchange(RABBITMQ_EXCHANGE, "topic", durable=True)

    async def prepare(self, kind: str, stream: str) -> None:
        """A JetStream stream for the subject (duplicate window of the outbox's default
        de-duplication window), so library and baseline publish to the same setup."""
        self.created.append((kind, stream))
        if kind == "kafka":
            # The topic the library would create (its default partitions), for both relays.
            from aiokafka.admin import NewTopic

            from fastapi_outbox.brokers.kafka import TOPIC_PARTITIONS

            await self.kafka.create_topics([NewTopic(stream, TOPIC_PARTITIONS, 1)])
        if kind == "rabbitmq":
            # The queue a subscriber group would have: durable quorum, bound to the stream.
            queue = await self.amqp_channel.declare_queue(
                stream, durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.bind(RABBITMQ_EXCHANGE, routing_key=stream)
        if kind == "nats":
            from fastapi_outbox import OutboxSettings

            window = OutboxSettings().dedup_window_seconds
            await self.js.add_stream(
                name=stream,
                subjects=[stream],
                duplicate_window=window,
                num_replicas=self.replicas,
            )

    async def count(self, kind: str, stream: str) -> int:
        if kind == "kafka":
            return await _kafka_records(self.urls["kafka"], stream)
        if kind == "redis":
            return int(await self.redis.xlen(stream))
        if kind == "rabbitmq":
            queue = await self.amqp_channel.declare_queue(stream, passive=True)
            return int(queue.declaration_result.message_count or 0)
        info = await self.js.stream_info(stream)
        return int(info.state.messages)

    async def delete(self, kind: str, stream: str) -> None:
        if kind == "redis":
            await self.redis.delete(stream)
            # The library's de-duplication keys of this stream.
            batch: list[bytes] = []
            async for key in self.redis.scan_iter(match=f"outbox:dedup:{{{stream}}}:*", count=2000):
                batch.append(key)
                if len(batch) >= 2000:
                    await self.redis.unlink(*batch)
                    batch = []
            if batch:
                await self.redis.unlink(*batch)
        elif kind == "rabbitmq":
            await self.amqp_channel.queue_delete(stream)
        elif kind == "kafka":
            await self.kafka.delete_topics([stream])
        else:
            import nats.js.errors

            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.delete_stream(stream)
        if (kind, stream) in self.created:
            self.created.remove((kind, stream))

    async def close(self) -> None:
        for kind, stream in list(self.created):
            try:
                await self.delete(kind, stream)
            except Exception as exc:
                print(f"  cleanup of {kind} stream {stream} failed: {exc}")
        if self.redis is not None:
            await self.redis.aclose()
        if self.nc is not None:
            await self.nc.close()
        if self.amqp is not None:
            await self.amqp.close()
        if self.kafka is not None:
            await self.kafka.close()


async def _kafka_records(url: str, topic: str) -> int:
    """Records on ``topic``, read to the end: Tansu 0.6's latest offsets fall short of the
    partition's last record (the base offset of its last batch), so they are counted."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    from fastapi_outbox.brokers.kafka import TOPIC_PARTITIONS
    from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers(url), enable_auto_commit=False)
    await reader.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(TOPIC_PARTITIONS)]
        reader.assign(tps)
        await reader.seek_to_beginning(*tps)
        count = 0
        while batches := await reader.getmany(timeout_ms=1000, max_records=10_000):
            count += sum(len(records) for records in batches.values())
        return count
    finally:
        await reader.stop()


# -- relay processes ----------------------------------------------------------------------


@dataclass
class Group:
    """Relay processes draining the rows of one broker name."""

    label: str
    kind: str  # library | baseline
    broker_name: str
    procs: list[Proc] = field(default_factory=list)
    #: The outbox table its processes drain (``OUTBOX_TABLE_NAME`` of their settings).
    table: str = TABLE


def start_library(
    procs: list[Proc],
    name: str,
    db_url: str,
    broker_url: str,
    broker_name: str,
    workdir: Path,
    *,
    count: int,
    settings: dict[str, str],
) -> list[Proc]:
    started = []
    for i in range(count):
        proc = Proc(
            f"{name}_{i}",
            [sys.executable, "-m", "fastapi_outbox", "dispatch", "--app", APP],
            env={
                "BENCH_DATABASE_URL": db_url,
                "BENCH_BROKER_URL": broker_url,
                "BENCH_BROKER_NAME": broker_name,
                "BENCH_POOL_SIZE": "8",
                **settings,
            },
            logdir=workdir,
        )
        procs.append(proc)
        started.append(proc)
    for proc in started:
        proc.wait_for("outbox relays started", timeout=60)
    return started


def start_baseline(
    procs: list[Proc],
    name: str,
    db_url: str,
    broker_url: str,
    broker_name: str,
    workdir: Path,
    *,
    count: int,
    channel: str,
) -> list[Proc]:
    started = []
    opts = {
        "dsn": asyncpg_dsn(db_url),
        "broker_url": broker_url,
        "broker_name": broker_name,
        "batch": 500,
        "channel": channel,
        "table": TABLE,
    }
    for i in range(count):
        proc = Proc(
            f"{name}_{i}",
            [sys.executable, "-m", "benchmarks._roles", "relay", json.dumps(opts)],
            logdir=workdir,
        )
        procs.append(proc)
        started.append(proc)
    for proc in started:
        proc.wait_for("READY", timeout=60)
    return started


# -- (a) drain ---------------------------------------------------------------------------------


@dataclass
class Drain:
    broker: str
    processes: int
    label: str
    kind: str
    rows: int
    seconds: float
    relay_us: float
    pg_us: float
    delivered: int
    round: int = 0
    note: str = ""

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")

    @property
    def check(self) -> str:
        if self.delivered == self.rows:
            return "ok"
        return f"{self.delivered} delivered (duplicates or losses)"


async def drain(
    conn: Any,
    brokers: Brokers,
    kind: str,
    group: Group,
    rows: int,
    channel: str,
    *,
    profile: Path | None = None,
    expected_seconds: float = 10.0,
    streams: int = 1,
) -> Drain:
    """``rows`` messages drained by ``group``; ``streams`` > 1 spreads them over that many
    streams (``<name>_0`` …, the same number of rows in each; on a cluster, over hash
    slots / stream leaders)."""
    base = unique("bench_drain")
    names = [base] if streams == 1 else [f"{base}_{j}" for j in range(streams)]
    for stream in names:
        await brokers.prepare(kind, stream)
    try:
        await conn.execute(f"TRUNCATE {group.table}")
        async with conn.transaction():
            for j, stream in enumerate(names):
                share = rows // streams + (1 if j < rows % streams else 0)
                await conn.execute(
                    BACKLOG_SQL.replace(TABLE, group.table, 1),
                    group.broker_name,
                    stream,
                    share,
                    "pending",
                )
            # In the same transaction: ANALYZE sees our own uncommitted rows, and no
            # relay can start before the commit below.
            await conn.execute(f"ANALYZE {group.table}")
        t0 = await conn.fetchval("SELECT clock_timestamp()")
        relay0 = {p.pid: proc_cpu(p.pid) for p in group.procs}
        pg0 = await pg_cpu(conn)
        spy = None
        if profile is not None:
            spy = start_profile(group.procs[0].pid, expected_seconds + 2, profile)
        await conn.execute("SELECT pg_notify($1, 'bench')", channel)
        deadline = time.monotonic() + max(60.0, rows / 1000)
        while True:
            left = await conn.fetchval(f"SELECT count(*) FROM {group.table} WHERE {ACTIVE}")
            if left == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{group.label}: {left} rows still pending after the deadline")
            await asyncio.sleep(0.1)
        t_end = await conn.fetchval(f"SELECT max(published_at) FROM {group.table}")
        relay_used = sum(proc_cpu(p.pid) - relay0[p.pid] for p in group.procs)
        pg_used = cpu_delta(pg0, await pg_cpu(conn))
        if spy is not None:
            spy.wait(expected_seconds + 40)
        published = await conn.fetchval(
            f"SELECT count(*) FROM {group.table} WHERE status = 'published'"
        )
        if published != rows:
            raise RuntimeError(f"{group.label}: {published} of {rows} rows published")
        delivered = sum([await brokers.count(kind, stream) for stream in names])
    finally:
        for stream in names:
            await brokers.delete(kind, stream)
    return Drain(
        broker=kind,
        processes=len(group.procs),
        label=group.label,
        kind=group.kind,
        rows=rows,
        seconds=(t_end - t0).total_seconds(),
        relay_us=1e6 * relay_used / rows,
        pg_us=1e6 * pg_used / rows,
        delivered=delivered,
    )


async def drain_suite(
    conn: Any, brokers: Brokers, kind: str, args: argparse.Namespace, workdir: Path, db_url: str
) -> tuple[list[Drain], list[tuple[str, Path, Drain]]]:
    from fastapi_outbox.relay.wakeups import channel_name

    channel = channel_name(TABLE)
    url = loopback(BROKER_URLS[kind])
    results: list[Drain] = []
    profiles: list[tuple[str, Path, Drain]] = []
    # The library runs on its defaults (adaptive claims of 25 up to 500 rows, 2 workers):
    # what a user gets without tuning. ``--library-env`` adds OUTBOX_* settings.
    lib_settings = dict(kv.split("=", 1) for kv in args.library_env)
    for nproc in (1, 2):
        with processes() as procs:
            groups = [
                Group(
                    "library",
                    "library",
                    "lib",
                    start_library(
                        procs,
                        f"{kind}_lib{nproc}",
                        db_url,
                        url,
                        "lib",
                        workdir,
                        count=nproc,
                        settings=lib_settings,
                    ),
                ),
            ]
            if nproc == 1 and kind in args.workers1:
                groups.append(
                    Group(
                        "library, workers 1",
                        "library",
                        "lib_w1",
                        start_library(
                            procs,
                            f"{kind}_libw1",
                            db_url,
                            url,
                            "lib_w1",
                            workdir,
                            count=1,
                            settings={**lib_settings, "OUTBOX_WORKERS": "1"},
                        ),
                    )
                )
            groups.append(
                Group(
                    "baseline",
                    "baseline",
                    "base",
                    start_baseline(
                        procs,
                        f"{kind}_base{nproc}",
                        db_url,
                        url,
                        "base",
                        workdir,
                        count=nproc,
                        channel=channel,
                    ),
                )
            )
            # Warm-up: connections, prepared statements, scripts, stream lookups.
            for g in groups:
                await drain(conn, brokers, kind, g, min(args.backlog, 2000), channel)
            for r in range(args.rounds):
                for g in groups:
                    res = await drain(conn, brokers, kind, g, args.backlog, channel)
                    res.round = r + 1
                    results.append(res)
                    print(
                        f"  {kind:5s} {nproc}p round {r + 1} {g.label:19s}"
                        f" {res.rate:8,.0f} msg/s  relay {res.relay_us:5.1f} us/msg"
                        f"  pg {res.pg_us:5.1f} us/msg  {res.check}",
                        flush=True,
                    )
            if nproc == 1 and kind in args.profile_brokers and py_spy() is not None:
                for g in (groups[0], groups[-1]):
                    rate = median(
                        x.rate for x in results if x.label == g.label and x.processes == 1
                    )
                    rows = int(min(max(rate * args.profile_seconds, 5_000), 400_000))
                    out = workdir / f"profile_{kind}_{g.kind}.txt"
                    res = await drain(
                        conn,
                        brokers,
                        kind,
                        g,
                        rows,
                        channel,
                        profile=out,
                        expected_seconds=rows / rate,
                    )
                    res.note = "profiled"
                    profiles.append((f"{kind} {g.label}", out, res))
    return results, profiles


def print_drain(
    results: list[Drain],
    profiles: list[tuple[str, Path, Drain]],
    ratios_path: str | None = None,
) -> None:
    banner("(a) drain: every round")
    print(
        table(
            [
                *("broker", "procs", "relay", "round", "rows", "seconds", "msg/s"),
                *("relay us/msg", "pg us/msg", "broker check"),
            ],
            [
                [
                    d.broker,
                    d.processes,
                    d.label,
                    d.round,
                    fmt(d.rows),
                    fmt(d.seconds, 2),
                    fmt(d.rate),
                    fmt(d.relay_us, 1),
                    fmt(d.pg_us, 1),
                    d.check,
                ]
                for d in results
            ],
        )
    )
    banner("(a) drain: medians, library vs hand-written relay")
    rows = []
    keys = list(dict.fromkeys((d.broker, d.processes) for d in results))
    for broker, nproc in keys:
        mine = [d for d in results if d.broker == broker and d.processes == nproc]
        base = median(d.rate for d in mine if d.label == "baseline")
        for label in dict.fromkeys(d.label for d in mine):
            sel = [d for d in mine if d.label == label]
            rate = median(d.rate for d in sel)
            ratio = rate / base
            verdict = ""
            floor = DRAIN_FLOORS.get(nproc, 1.0)
            if label != "baseline":
                verdict = f"meets {floor}" if ratio >= floor else f"MISSES {floor}"
                record_ratio(
                    ratios_path,
                    f"drain {broker}, {nproc} process(es), {label} / hand-written",
                    ratio,
                    floor,
                    most=False,
                )
            rows.append(
                [
                    broker,
                    nproc,
                    label,
                    fmt(rate),
                    f"{ratio:.2f}",
                    verdict,
                    fmt(median(d.relay_us for d in sel), 1),
                    fmt(median(d.pg_us for d in sel), 1),
                ]
            )
    print(
        table(
            [
                *("broker", "procs", "relay", "median msg/s", "vs baseline"),
                *("floor (1 proc: 1.2, 2: 1.0)", "relay us/msg", "pg us/msg"),
            ],
            rows,
        )
    )
    if not profiles:
        return
    prof = {name: (load_profile(path), d) for name, path, d in profiles}
    banner("(a) relay-process CPU per message (us) by package: py-spy shares x /proc CPU")
    pairs = list(prof)
    print(package_table({n: (prof[n][0], prof[n][1].relay_us) for n in pairs}))
    for name in pairs:
        p, d = prof[name]
        banner(f"(a) py-spy: {name}, {d.rows:,} rows at {d.rate:,.0f} msg/s")
        print(summarize_profile(p, top=15))


# -- (b) latency ---------------------------------------------------------------------------------


@dataclass
class Latency:
    mode: str
    sent: int
    received: int
    rate: float
    p50: float
    p90: float
    p99: float
    worst: float
    errors: int
    producer_us: float
    #: From the start of the producer's transaction (before ``unit_of_work()``) to the
    #: reader's receipt, and the transaction itself (start to commit), p50 / p99 ms.
    start_p50: float = float("nan")
    start_p99: float = float("nan")
    txn_p50: float = float("nan")
    #: The producer process's CPU over the run, in % of one core.
    producer_cpu_pct: float = float("nan")


async def latency_suite(
    conn: Any, brokers: Brokers, args: argparse.Namespace, workdir: Path, db_url: str
) -> list[Latency]:
    out: list[Latency] = []
    kind = args.latency_broker
    broker_url = loopback(REDIS_URL if kind == "redis" else NATS_URL)
    for mode in ("separate relay process (LISTEN/NOTIFY)", "relay in the producer"):
        in_process = mode.startswith("relay in")
        stream = unique("bench_lat")
        await brokers.prepare(kind, stream)
        await conn.execute(f"TRUNCATE {TABLE}")
        expected = int(args.rate * args.latency_seconds)
        tag = "inproc" if in_process else "separate"
        with processes() as procs:
            consumer = Proc(
                f"consumer_{tag}",
                [
                    *(sys.executable, "-m", "benchmarks._roles", "consumer"),
                    json.dumps(
                        {
                            "broker_url": broker_url,
                            "stream": stream,
                            "expected": expected,
                            "timeout": args.latency_seconds + 60,
                            "out": str(workdir / f"consumer_{tag}.json"),
                        }
                    ),
                ],
                logdir=workdir,
            )
            procs.append(consumer)
            consumer.wait_for("READY")
            if not in_process:
                start_library(
                    procs,
                    "lat_dispatcher",
                    db_url,
                    broker_url,
                    "default",
                    workdir,
                    count=1,
                    settings=dict(kv.split("=", 1) for kv in args.library_env),
                )
            producer = Proc(
                f"producer_{tag}",
                [
                    *(sys.executable, "-m", "benchmarks._roles", "producer"),
                    json.dumps(
                        {
                            "db_url": db_url,
                            "broker_url": broker_url,
                            "stream": stream,
                            "rate": args.rate,
                            "seconds": args.latency_seconds,
                            "in_process": in_process,
                            "out": str(workdir / f"producer_{tag}.json"),
                        }
                    ),
                ],
                logdir=workdir,
            )
            procs.append(producer)
            await asyncio.to_thread(producer.popen.wait, 3 * args.latency_seconds + 60)
            # The consumer stops by itself once it has every message; give the last ones
            # 5 s (a producer that fell behind sent fewer than planned), then stop it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(consumer.popen.wait, 5)
            consumer.stop()
        prod = json.loads((workdir / f"producer_{tag}.json").read_text())
        cons = json.loads((workdir / f"consumer_{tag}.json").read_text())
        await brokers.delete(kind, stream)
        commits: dict[str, float] = prod["commits"]
        received: dict[str, float] = cons["received"]
        lat = [1000 * (received[m] - t) for m, t in commits.items() if m in received]
        starts: dict[str, float] = prod.get("starts", {})
        from_start = [1000 * (received[m] - t) for m, t in starts.items() if m in received]
        txn = [1000 * (commits[m] - t) for m, t in starts.items() if m in commits]
        out.append(
            Latency(
                mode=mode,
                sent=len(commits),
                received=len(lat),
                rate=len(commits) / prod["elapsed"],
                p50=percentile(lat, 50),
                p90=percentile(lat, 90),
                p99=percentile(lat, 99),
                worst=max(lat) if lat else float("nan"),
                errors=prod["errors"],
                producer_us=1e6 * prod["cpu"] / max(1, len(commits)),
                start_p50=percentile(from_start, 50),
                start_p99=percentile(from_start, 99),
                txn_p50=percentile(txn, 50),
                producer_cpu_pct=100 * prod["cpu"] / max(prod["elapsed"], 1e-9),
            )
        )
        r = out[-1]
        print(
            f"  latency, {mode}: commit -> reader p50 {r.p50:.1f} ms, p99 {r.p99:.1f} ms;"
            f" transaction start -> reader p50 {r.start_p50:.1f} ms, p99 {r.start_p99:.1f} ms;"
            f" producer transaction p50 {r.txn_p50:.2f} ms, producer CPU"
            f" {r.producer_cpu_pct:.0f} %",
            flush=True,
        )
    return out


def print_latency(results: list[Latency], args: argparse.Namespace) -> None:
    verb = "XADD" if args.latency_broker == "redis" else "JetStream publish"
    banner(f"(b) commit -> {verb} latency at {args.rate:,.0f} msg/s for {args.latency_seconds:g} s")
    print(
        table(
            [
                *("relay", "sent", "received", "msg/s", "p50 ms", "p90 ms", "p99 ms"),
                *("max ms", "producer us/msg", "start->reader p50/p99 ms", "txn p50 ms"),
                "producer CPU %",
            ],
            [
                [
                    r.mode,
                    fmt(r.sent),
                    fmt(r.received),
                    fmt(r.rate),
                    fmt(r.p50, 1),
                    fmt(r.p90, 1),
                    fmt(r.p99, 1),
                    fmt(r.worst, 1),
                    fmt(r.producer_us),
                    f"{r.start_p50:.1f} / {r.start_p99:.1f}",
                    fmt(r.txn_p50, 2),
                    fmt(r.producer_cpu_pct),
                ]
                for r in results
            ],
        )
    )
    p50_goal, p99_goal = LATENCY_GOALS_MS
    for r in results:
        if r.rate < 0.9 * args.rate:
            print(
                f"  {r.mode}: the producer reached only {r.rate:,.0f} msg/s of {args.rate:,.0f}:"
                " these latencies are not at the target load (machine busy, or the write path"
                " is too slow)"
            )
        ok = r.p50 <= p50_goal and r.p99 <= p99_goal and r.received == r.sent
        print(
            f"  {r.mode}: {'meets' if ok else 'MISSES'} the goal p50 <= {p50_goal:g} ms, "
            f"p99 <= {p99_goal:g} ms" + (f" ({r.errors} producer errors)" if r.errors else "")
        )


# -- (c) claim time --------------------------------------------------------------------------------


async def claim_suite(conn: Any, args: argparse.Namespace, db_url: str) -> list[list[Any]]:
    from fastapi_outbox import Outbox
    from fastapi_outbox.brokers import MemoryBroker

    outbox = Outbox(
        db_url,
        brokers={"claim": MemoryBroker()},
        engine_options={"pool_size": 2, "max_overflow": 0},
    )
    store = outbox.store
    claims, size = args.claims, 100
    raw_sql = CLAIM_SQL.format(table=TABLE)
    rows: list[list[Any]] = []
    try:
        for label, filler in (("empty table", 0), (f"{args.filler:,} published rows", args.filler)):
            await conn.execute(f"TRUNCATE {TABLE}")
            t = time.perf_counter()
            if filler:
                await conn.execute(BACKLOG_SQL, "claim", "bench_claim", filler, "published")
            await conn.execute(
                BACKLOG_SQL, "claim", "bench_claim", (2 * claims + 10) * size, "pending"
            )
            await conn.execute(f"VACUUM ANALYZE {TABLE}")
            fill_seconds = time.perf_counter() - t
            lib: list[float] = []
            raw: list[float] = []
            for i in range(claims + 3):
                t = time.perf_counter()
                got = await store.claims.claim("claim", size, f"bench:lib:{i}", 30.0)
                if i >= 3:
                    lib.append(1000 * (time.perf_counter() - t))
                assert len(got) == size, f"claimed {len(got)}"
                t = time.perf_counter()
                got_raw = await conn.fetch(raw_sql, "claim", size, f"bench:raw:{i}")
                if i >= 3:
                    raw.append(1000 * (time.perf_counter() - t))
                assert len(got_raw) == size, f"claimed {len(got_raw)}"
            rows.append(
                [
                    label,
                    "Claims.claim",
                    fmt(median(lib), 2),
                    fmt(percentile(lib, 90), 2),
                    fmt(max(lib), 2),
                    fmt(fill_seconds, 1),
                ]
            )
            rows.append(
                [
                    label,
                    "raw SQL claim",
                    fmt(median(raw), 2),
                    fmt(percentile(raw, 90), 2),
                    fmt(max(raw), 2),
                    "",
                ]
            )
            print(f"  claim, {label}: Claims.claim median {median(lib):.2f} ms", flush=True)
        await conn.execute(f"TRUNCATE {TABLE}")
    finally:
        await outbox.aclose()
    return rows


def print_claims(rows: list[list[Any]], args: argparse.Namespace) -> None:
    banner(f"(c) claim of 100 pending rows, {args.claims} claims per case")
    print(table(["table", "claim", "median ms", "p90 ms", "max ms", "fill s"], rows))
    lib = [r for r in rows if r[1] == "Claims.claim"]
    if len(lib) == 2:
        ratio = float(lib[1][2].replace(",", "")) / float(lib[0][2].replace(",", ""))
        verdict = "flat" if ratio <= 1.5 else "NOT flat"
        print(f"  Claims.claim, full / empty table: {ratio:.2f}x ({verdict}; goal: flat)")


# -- main -----------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> int:
    print("dispatch benchmark (noisy if the machine is busy)")
    print(
        f"  backlog {args.backlog:,} rows x {args.rounds} rounds,"
        f" brokers {', '.join(args.brokers)},"
        f" latency {args.rate:,.0f} msg/s x {args.latency_seconds:g} s,"
        f" claim filler {args.filler:,} rows; {machine_note()}"
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench_dispatch_"))
    brokers = Brokers()
    started = time.monotonic()
    kafka = kafka_server() if "kafka" in args.brokers else contextlib.nullcontext("")
    with kafka as kafka_url:
        if kafka_url:
            brokers.urls["kafka"] = kafka_url
        return await _main(args, workdir, brokers, started)


async def _main(args: argparse.Namespace, workdir: Path, brokers: Brokers, started: float) -> int:
    import asyncpg

    drains: list[Drain] = []
    profiles: list[tuple[str, Path, Drain]] = []
    latencies: list[Latency] = []
    claims: list[list[Any]] = []
    try:
        latency = [args.latency_broker] if "latency" in args.only else []
        await brokers.connect(list(dict.fromkeys([*args.brokers, *latency])))
        async with bench_database("bench_dispatch") as db_url:
            os.environ["BENCH_DATABASE_URL"] = db_url
            from benchmarks import bench_app

            await bench_app.create_schema()
            await bench_app.outbox.engine.dispose()
            conn = await asyncpg.connect(asyncpg_dsn(db_url))
            try:
                if "drain" in args.only:
                    banner("(a) drain")
                    for kind in args.brokers:
                        t = time.monotonic()
                        res, prof = await drain_suite(conn, brokers, kind, args, workdir, db_url)
                        drains += res
                        profiles += prof
                        print(f"  ({kind} drains took {time.monotonic() - t:.0f} s)")
                if "latency" in args.only:
                    banner("(b) latency")
                    t = time.monotonic()
                    latencies = await latency_suite(conn, brokers, args, workdir, db_url)
                    print(f"  (latency runs took {time.monotonic() - t:.0f} s)")
                if "claim" in args.only:
                    banner("(c) claim time")
                    t = time.monotonic()
                    claims = await claim_suite(conn, args, db_url)
                    print(f"  (claim runs took {time.monotonic() - t:.0f} s)")
            finally:
                await conn.close()
    finally:
        await brokers.close()
    if drains:
        print_drain(drains, profiles, args.ratios)
    if latencies:
        print_latency(latencies, args)
    if claims:
        print_claims(claims, args)
    print(f"\nfinished in {time.monotonic() - started:.0f} s; {machine_note()}")
    bad = [d for d in drains if d.check != "ok"]
    if bad:
        print(f"{len(bad)} drain(s) delivered a different number of messages than rows")
        return 1
    if args.keep_logs:
        print(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run with small sizes")
    p.add_argument(
        "--library-env",
        nargs="*",
        default=[],
        metavar="OUTBOX_X=V",
        help="settings of the library's relay processes (default: none, the defaults)",
    )
    p.add_argument("--backlog", type=int, help="drain backlog (default 100,000; quick 10,000)")
    p.add_argument("--rounds", type=int, help="drain rounds per relay (default 2; quick 1)")
    p.add_argument(
        "--brokers",
        nargs="+",
        choices=["redis", "nats", "rabbitmq", "kafka"],
        default=["redis", "nats"],
        help="drain targets (rabbitmq: the exchange 'outbox', a quorum queue per run; kafka: "
        "BENCH_KAFKA_URL, else a private Tansu broker; a topic of 3 partitions per run)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=["drain", "latency", "claim"],
        default=["drain", "latency", "claim"],
    )
    p.add_argument("--rate", type=float, default=1000.0, help="latency: messages per second")
    p.add_argument("--latency-seconds", type=float, help="latency run (default 10; quick 3)")
    p.add_argument(
        "--latency-broker",
        choices=["redis", "nats"],
        default="redis",
        help="latency: the broker published to (default redis)",
    )
    p.add_argument("--filler", type=int, help="claim: published rows (default 1M; quick 100k)")
    p.add_argument("--claims", type=int, default=50, help="claim: timed claims per case")
    p.add_argument(
        "--workers1",
        nargs="*",
        help="brokers on which to also run the library with workers=1 (default: redis; quick:"
        " none)",
    )
    p.add_argument(
        "--profile",
        nargs="*",
        dest="profile_brokers",
        default=["redis", "nats"],
        help="brokers on which to py-spy one library and one baseline drain (default: both)",
    )
    p.add_argument("--profile-seconds", type=float, help="length of a profiled drain (5; quick 2)")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    p.add_argument("--ratios", help="append the drain ratios to this JSON-lines file")
    args = p.parse_args(argv)
    if args.workers1 is None:
        args.workers1 = [] if args.quick else ["redis"]
    args.backlog = args.backlog or (10_000 if args.quick else 100_000)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.latency_seconds = args.latency_seconds or (3.0 if args.quick else 10.0)
    args.filler = args.filler or (100_000 if args.quick else 1_000_000)
    args.profile_seconds = args.profile_seconds or (2.0 if args.quick else 5.0)
    return args


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse_args())))
