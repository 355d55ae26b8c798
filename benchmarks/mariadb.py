"""MariaDB: drain rate against a hand-written asyncmy relay, and the write path's cost.

(a) **Drain**: a backlog of 50,000 rows (``--quick`` 10,000), inserted in one transaction,
is drained to Redis Streams by the library's dispatcher (``python -m fastapi_outbox
dispatch --app benchmarks.bench_app:outbox`` on ``mysql+asyncmy://``, default settings:
adaptive claims of 25 up to 500 rows, 2 workers; de-duplication on) with 1 and 2
processes, and by a hand-written asyncmy relay (``python benchmarks/mariadb.py relay``)
with as many: in one transaction ``SELECT … ORDER BY next_attempt_at, id LIMIT 500 FOR
UPDATE SKIP LOCKED``, the batch XADDed in one pipelined round trip, one ``UPDATE … WHERE id
IN (…)`` marking it published, COMMIT; no leases, retries, fencing or de-duplication.
Library and baseline alternate round by round in one run. Rate = rows / (last
``published_at`` - first ``published_at``), on the database's clock: MariaDB has no
LISTEN/NOTIFY, both sides find a backlog committed by another process by polling (the
library every ``poll_interval_seconds``, 1 s by default; the baseline likewise), and that
first wait is a wake-up latency (documented in docs/how-to/mariadb.md), not a rate. CPU per
message of the relay processes and of ``mariadbd`` is read from ``/proc``.

(b) **Write path**: sequential transactions in this process, alternating one by one:
``outbox.unit_of_work()`` adding a business row and publishing one event (``uow, 1
event``) or ten (``uow, 10 events``), and the same business row through a bare
``AsyncSession`` (``bare``). The cost of an event is the difference of the medians.

    python benchmarks/mariadb.py            # full (~3 minutes)
    python benchmarks/mariadb.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from benchmarks._common import (
    REDIS_URL,
    Proc,
    banner,
    fmt,
    loopback,
    machine_note,
    median,
    proc_cpu,
    processes,
    redis_client,
    table,
    unique,
)

MYSQL_URL = os.environ.get("BENCH_MYSQL_URL", "mysql+asyncmy://root@127.0.0.1:3306/test")
APP = "benchmarks.bench_app:outbox"
TABLE = "outbox_messages"
#: The library's drain rate at least this much of the hand-written relay's (issue 34).
DRAIN_FLOOR = 0.9
ACTIVE = "status IN ('pending', 'processing', 'failed')"

CLAIM_SQL = f"""
SELECT id, stream, type, `key`, payload, headers FROM {TABLE}
WHERE broker = %s AND status = 'pending' AND next_attempt_at <= UTC_TIMESTAMP(6)
ORDER BY next_attempt_at, id LIMIT %s FOR UPDATE SKIP LOCKED
"""
MARK_SQL = (
    f"UPDATE {TABLE} SET status = 'published', published_at = UTC_TIMESTAMP(6), "
    "locked_by = NULL, locked_until = NULL WHERE id IN ({ids})"
)


def _connect_args(url: str) -> dict[str, Any]:
    parsed = urlparse(url.replace("+asyncmy", ""))
    return {
        "host": parsed.hostname or "127.0.0.1",
        "port": parsed.port or 3306,
        "user": parsed.username or "root",
        "password": parsed.password or "",
        "db": parsed.path.lstrip("/") or None,
    }


async def _admin(statement: str) -> None:
    import asyncmy

    args = {**_connect_args(MYSQL_URL), "db": None}
    conn = await asyncmy.connect(**args)
    try:
        async with conn.cursor() as cur:
            await cur.execute(statement)
    finally:
        conn.close()


def mariadbd_pid() -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in ("mariadbd", "mysqld"):
                    return int(entry.name)
            except OSError:
                continue
    return None


# -- the baseline relay (a child process) -----------------------------------------------------


async def relay(opts: dict[str, Any]) -> None:
    """The hand-written relay: claim (SELECT … FOR UPDATE SKIP LOCKED), publish, mark, in
    one transaction per batch; polls every ``poll`` seconds when it finds nothing."""
    import asyncmy
    import redis.asyncio as aioredis

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    conn = await asyncmy.connect(**_connect_args(opts["db_url"]), autocommit=False)
    async with conn.cursor() as cur:
        await cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    client = aioredis.Redis.from_url(opts["broker_url"])
    await client.ping()
    print("READY", flush=True)
    published = 0
    try:
        while not stop.is_set():
            async with conn.cursor() as cur:
                await cur.execute(CLAIM_SQL, (opts["broker_name"], int(opts["batch"])))
                rows = await cur.fetchall()
                if not rows:
                    await conn.commit()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), float(opts["poll"]))
                    continue
                pipe = client.pipeline(transaction=False)
                for r in rows:
                    fields = {"id": str(r[0]), "type": r[2], "key": r[3] or ""}
                    pipe.xadd(r[1], {**fields, "headers": r[5], "payload": r[4]})
                await pipe.execute()
                ids = [r[0] for r in rows]
                await cur.execute(MARK_SQL.format(ids=", ".join(["%s"] * len(ids))), ids)
            await conn.commit()
            published += len(rows)
    finally:
        print(f"published {published}", flush=True)
        await client.aclose()
        conn.close()


# -- (a) drain --------------------------------------------------------------------------------


async def insert_backlog(conn: Any, broker: str, stream: str, rows: int) -> None:
    """``rows`` pending rows as the unit of work writes them (~200-byte payload, the
    standard headers), in one transaction."""
    now = time.time()
    values = []
    for i in range(rows):
        mid = uuid.uuid4()
        payload = json.dumps(
            {"order_id": i, "customer": f"customer-{i}", "total": 42.5, "note": "x" * 100}
        )
        headers = json.dumps({"message-id": str(mid), "type": "OrderPlaced", "at": now})
        values.append((mid.hex, broker, stream, "OrderPlaced", str(i % 1000), payload, headers))
    sql = (
        f"INSERT INTO {TABLE} (id, broker, stream, type, `key`, payload, headers, "
        "next_attempt_at, created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, "
        "UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
    )
    async with conn.cursor() as cur:
        for start in range(0, rows, 5000):
            await cur.executemany(sql, values[start : start + 5000])
    await conn.commit()


async def drain(
    conn: Any, redis: Any, label: str, broker: str, procs: list[Proc], rows: int
) -> dict[str, Any]:
    stream = unique("bench_mdb")
    async with conn.cursor() as cur:
        await cur.execute(f"DELETE FROM {TABLE}")
    await conn.commit()
    await insert_backlog(conn, broker, stream, rows)
    relay0 = {p.pid: proc_cpu(p.pid) for p in procs}
    server = mariadbd_pid()
    server0 = proc_cpu(server) if server else 0.0
    deadline = time.monotonic() + max(120.0, rows / 500)
    while True:
        async with conn.cursor() as cur:
            await cur.execute(f"SELECT count(*) FROM {TABLE} WHERE {ACTIVE}")
            (left,) = await cur.fetchone()
        await conn.commit()
        if left == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label}: {left} rows still pending")
        await asyncio.sleep(0.1)
    relay_used = sum(proc_cpu(p.pid) - relay0[p.pid] for p in procs)
    server_used = (proc_cpu(server) - server0) if server else float("nan")
    async with conn.cursor() as cur:
        await cur.execute(
            f"SELECT min(published_at), max(published_at), count(*) FROM {TABLE} "
            "WHERE status = 'published'"
        )
        first, last, published = await cur.fetchone()
    await conn.commit()
    delivered = await redis.xlen(stream)
    await redis.delete(stream)
    if published != rows or delivered != rows:
        raise RuntimeError(f"{label}: {published} published, {delivered} delivered of {rows}")
    seconds = (last - first).total_seconds()
    return {
        "label": label,
        "processes": len(procs),
        "rate": rows / seconds,
        "relay_us": 1e6 * relay_used / rows,
        "server_us": 1e6 * server_used / rows,
    }


def start(
    procs: list[Proc], name: str, args: list[str], env: dict[str, str], ready: str, workdir: Path
) -> Proc:
    proc = Proc(name, [sys.executable, *args], env=env, logdir=workdir)
    procs.append(proc)
    proc.wait_for(ready, timeout=60)
    return proc


async def drain_suite(db_url: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    import asyncmy

    redis_url = loopback(REDIS_URL)
    redis = redis_client(redis_url)
    conn = await asyncmy.connect(**_connect_args(db_url), autocommit=False)
    results: list[dict[str, Any]] = []
    try:
        for nproc in (1, 2):
            with processes() as procs:
                lib = [
                    start(
                        procs,
                        f"lib{nproc}_{i}",
                        ["-m", "fastapi_outbox", "dispatch", "--app", APP],
                        {
                            "BENCH_DATABASE_URL": db_url,
                            "BENCH_BROKER_URL": redis_url,
                            "BENCH_BROKER_NAME": "lib",
                            "BENCH_POOL_SIZE": "8",
                        },
                        "outbox relays started",
                        workdir,
                    )
                    for i in range(nproc)
                ]
                opts = {
                    "db_url": db_url,
                    "broker_url": redis_url,
                    "broker_name": "base",
                    "batch": 500,
                    "poll": 1.0,
                }
                base = [
                    start(
                        procs,
                        f"base{nproc}_{i}",
                        [str(Path(__file__)), "relay", json.dumps(opts)],
                        {},
                        "READY",
                        workdir,
                    )
                    for i in range(nproc)
                ]
                groups = [("library", "lib", lib), ("baseline", "base", base)]
                for label, broker, group in groups:  # warm-up
                    await drain(conn, redis, label, broker, group, min(args.backlog, 2000))
                for r in range(args.rounds):
                    for label, broker, group in groups:
                        res = await drain(conn, redis, label, broker, group, args.backlog)
                        res["round"] = r + 1
                        results.append(res)
                        print(
                            f"  {nproc}p round {r + 1} {label:9s} {res['rate']:8,.0f} msg/s"
                            f"  relay {res['relay_us']:5.1f} us/msg"
                            f"  mariadbd {res['server_us']:5.1f} us/msg",
                            flush=True,
                        )
    finally:
        conn.close()
        await redis.aclose()
    return results


def print_drain(results: list[dict[str, Any]]) -> None:
    rows = []
    for nproc in (1, 2):
        by = {
            label: [r for r in results if r["label"] == label and r["processes"] == nproc]
            for label in ("library", "baseline")
        }
        lib = median(r["rate"] for r in by["library"])
        base = median(r["rate"] for r in by["baseline"])
        for label in ("library", "baseline"):
            rows.append(
                [
                    nproc,
                    label,
                    fmt(median(r["rate"] for r in by[label])),
                    fmt(median(r["relay_us"] for r in by[label]), 1),
                    fmt(median(r["server_us"] for r in by[label]), 1),
                    f"{lib / base:.2f}" if label == "library" else "",
                ]
            )
        print(f"  {nproc} process(es): library / baseline = {lib / base:.2f} (floor {DRAIN_FLOOR})")
    print(table(["proc", "relay", "msg/s", "relay us/msg", "mariadbd us/msg", "lib/base"], rows))


# -- (b) write path ---------------------------------------------------------------------------


async def write_suite(db_url: str, args: argparse.Namespace) -> None:
    from benchmarks.bench_app import Base, Order, OrderPlaced
    from fastapi_outbox import Outbox, OutboxSettings
    from fastapi_outbox.brokers import MemoryBroker

    outbox = Outbox(
        db_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(run_relays=False)
    )
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        factory = outbox.session_factory
        n = 0

        async def uow(events: int) -> None:
            nonlocal n
            n += 1
            async with outbox.unit_of_work() as work:
                work.session.add(Order(id=n, customer="ada", total=42.5))
                for i in range(events):
                    work.publish(OrderPlaced(order_id=n * 100 + i, customer="ada", total=42.5))

        async def bare() -> None:
            nonlocal n
            n += 1
            async with factory() as session:
                session.add(Order(id=n, customer="ada", total=42.5))
                await session.commit()

        cases = {"bare": bare, "uow, 1 event": lambda: uow(1), "uow, 10 events": lambda: uow(10)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(50):  # warm-up
            for case in cases.values():
                await case()
        for _ in range(args.transactions):
            for name, case in cases.items():
                t = time.perf_counter()
                await case()
                times[name].append(time.perf_counter() - t)
        med = {k: 1e6 * median(v) for k, v in times.items()}
        rows = [[k, fmt(v), fmt(v - med["bare"])] for k, v in med.items()]
        print(table(["transaction", "median us", "over bare us"], rows))
        per_event = (med["uow, 10 events"] - med["uow, 1 event"]) / 9
        print(
            f"  one event costs {med['uow, 1 event'] - med['bare']:.0f} us over the bare "
            f"transaction (the outbox INSERT and its commit-time work); each further event "
            f"{per_event:.0f} us"
        )
    finally:
        await outbox.aclose()


# -- main -------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> int:
    from fastapi_outbox import Outbox

    name = unique("bench_mdb")
    await _admin(f"CREATE DATABASE {name}")
    base, _, _ = MYSQL_URL.rpartition("/")
    db_url = f"{base}/{name}"
    try:
        outbox = Outbox(db_url)
        await outbox.create_tables()
        await outbox.aclose()
        print(machine_note())
        if args.only in (None, "drain"):
            banner(f"(a) drain of {args.backlog:,} rows to Redis, {args.rounds} rounds")
            with tempfile.TemporaryDirectory() as tmp:
                results = await drain_suite(db_url, args, Path(tmp))
            print_drain(results)
        if args.only in (None, "write"):
            banner(f"(b) write path, {args.transactions:,} transactions per case")
            await write_suite(db_url, args)
    finally:
        await _admin(f"DROP DATABASE IF EXISTS {name}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--only", choices=["drain", "write"])
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--backlog", type=int)
    parser.add_argument("--transactions", type=int)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.backlog = args.backlog or (10_000 if args.quick else 50_000)
    args.transactions = args.transactions or (300 if args.quick else 2_000)
    return args


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "relay":
        asyncio.run(relay(json.loads(sys.argv[2])))
        sys.exit(0)
    sys.exit(asyncio.run(main(parse_args())))
