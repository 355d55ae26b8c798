"""End to end at a steady rate: the library against txoutbox, in the same run.

One producer process commits one message per transaction at ``--rate`` (default 500/s) for
``--seconds``; a relay in a process of its own publishes to Redis Streams; a reader
process (XREAD BLOCK) notes when each message arrives. Latency is counted from the start of
the producer's transaction to the reader's receipt (and from the commit, for reference);
the producer's transaction time (start to commit) and its CPU over the run are printed too.

* **library**: ``outbox.unit_of_work()`` in an API-only producer (``outbox.relays.notifying()``, as
  an API process's lifespan), ``fastapi-outbox dispatch`` on default settings, woken by
  LISTEN/NOTIFY;
* **txoutbox** (``pip install txoutbox``; skipped without it): raw asyncpg transactions
  with ``PostgresStorage.insert`` (its NOTIFY trigger on), its ``Relay`` publishing each
  message with XADD (``batch_size`` 100), woken by its listener.

Sides alternate round by round; medians of the rounds are printed. Goals: p50 at most
txoutbox's, p99 at most 10 ms, producer CPU at most 1.2x txoutbox's.

    python benchmarks/e2e.py                 # 3 rounds of 8 s per side at 500/s
    python benchmarks/e2e.py --quick         # 1 round of 4 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    REDIS_URL,
    Proc,
    asyncpg_dsn,
    banner,
    bench_database,
    fmt,
    loopback,
    machine_note,
    median,
    percentile,
    processes,
    redis_client,
    table,
    unique,
)

TXO_TABLE = "txo_outbox"
TXO_CHANNEL = "txo_outbox"
P99_GOAL_MS = 10.0
CPU_CEILING = 1.2


# -- txoutbox's roles (run as ``python -m benchmarks.e2e <role> <json>``) ----------------------


async def txo_producer(opts: dict[str, Any]) -> None:
    import asyncpg
    from txoutbox.adapters.postgres import PostgresStorage

    pool = await asyncpg.create_pool(opts["dsn"], min_size=4, max_size=12)
    storage = PostgresStorage(pool, table=TXO_TABLE, notify_channel=TXO_CHANNEL)
    rate, total = float(opts["rate"]), int(float(opts["rate"]) * float(opts["seconds"]))
    commits: dict[str, float] = {}
    starts: dict[str, float] = {}
    errors = 0
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        nonlocal errors
        try:
            started = time.time()
            async with pool.acquire() as conn, conn.transaction():
                row_id = await storage.insert(
                    conn, opts["stream"], {"seq": i, "pad": "x" * 120}, headers={"type": "Tick"}
                )
            commits[str(row_id)] = time.time()
            starts[str(row_id)] = started
        except Exception as exc:
            errors += 1
            print(f"producer error: {type(exc).__name__}: {exc}", flush=True)
        finally:
            sem.release()

    loop = asyncio.get_running_loop()
    print("READY", flush=True)
    cpu0 = time.process_time()
    tasks = set()
    start = loop.time() + 0.1
    for i in range(total):
        if loop.time() > start + 2 * float(opts["seconds"]):
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
    elapsed = loop.time() - start
    cpu = time.process_time() - cpu0
    await pool.close()
    result = {"commits": commits, "starts": starts, "elapsed": elapsed, "errors": errors}
    result["cpu"] = cpu
    await asyncio.to_thread(Path(opts["out"]).write_text, json.dumps(result))


async def txo_relay(opts: dict[str, Any]) -> None:
    import asyncpg
    import redis.asyncio as aioredis
    from txoutbox import Relay, RelayConfig
    from txoutbox.adapters.postgres import PostgresStorage

    pool = await asyncpg.create_pool(opts["dsn"], min_size=2, max_size=4)
    storage = PostgresStorage(pool, table=TXO_TABLE, notify_channel=TXO_CHANNEL)
    client = aioredis.Redis.from_url(opts["redis_url"])

    async def publish(message: Any) -> None:
        await client.xadd(
            message.topic,
            {"id": str(message.id), "headers": "{}", "payload": message.payload},
        )

    relay = Relay(storage, publish, config=RelayConfig(batch_size=100))
    listener = await storage.listen(relay.wake)
    async with relay:
        print("READY", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    await listener.close()
    await client.aclose()
    await pool.close()


# -- the run -----------------------------------------------------------------------------------


def _role(name: str, role: str, opts: dict[str, Any], logdir: Path) -> Proc:
    return Proc(
        name, [sys.executable, "-m", "benchmarks.e2e", role, json.dumps(opts)], logdir=logdir
    )


async def one_run(side: str, db_url: str, args: argparse.Namespace, workdir: Path) -> dict:
    from benchmarks.dispatch import start_library

    redis_url = loopback(REDIS_URL)
    stream = unique(f"e2e_{side}")
    tag = unique(side)
    expected = int(args.rate * args.seconds)
    with processes() as procs:
        consumer = Proc(
            f"reader_{tag}",
            [
                *(sys.executable, "-m", "benchmarks._roles", "consumer"),
                json.dumps(
                    {
                        "broker_url": redis_url,
                        "stream": stream,
                        "expected": expected,
                        "timeout": args.seconds + 60,
                        "out": str(workdir / f"reader_{tag}.json"),
                    }
                ),
            ],
            logdir=workdir,
        )
        procs.append(consumer)
        consumer.wait_for("READY")
        out = str(workdir / f"producer_{tag}.json")
        if side == "library":
            start_library(
                procs, f"dispatcher_{tag}", db_url, redis_url, "default", workdir,
                count=1, settings={},
            )  # fmt: skip
            producer = Proc(
                f"producer_{tag}",
                [
                    *(sys.executable, "-m", "benchmarks._roles", "producer"),
                    json.dumps(
                        {
                            "db_url": db_url,
                            "broker_url": redis_url,
                            "stream": stream,
                            "rate": args.rate,
                            "seconds": args.seconds,
                            "in_process": False,
                            "out": out,
                        }
                    ),
                ],
                logdir=workdir,
            )
        else:
            dsn = asyncpg_dsn(db_url)
            relay = _role(
                f"relay_{tag}", "txo_relay", {"dsn": dsn, "redis_url": redis_url}, workdir
            )
            procs.append(relay)
            relay.wait_for("READY")
            producer = _role(
                f"producer_{tag}",
                "txo_producer",
                {"dsn": dsn, "stream": stream, "rate": args.rate, "seconds": args.seconds,
                 "out": out},
                workdir,
            )  # fmt: skip
        procs.append(producer)
        await asyncio.to_thread(producer.popen.wait, 3 * args.seconds + 60)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(consumer.popen.wait, 5)
        consumer.stop()
    prod = json.loads(await asyncio.to_thread(Path(out).read_text))
    reader = await asyncio.to_thread((workdir / f"reader_{tag}.json").read_text)
    received: dict[str, float] = json.loads(reader)["received"]
    client = redis_client(redis_url)
    await client.delete(stream)
    await client.aclose()
    starts, commits = prod["starts"], prod["commits"]
    from_start = [1000 * (received[m] - t) for m, t in starts.items() if m in received]
    from_commit = [1000 * (received[m] - t) for m, t in commits.items() if m in received]
    txn = [1000 * (commits[m] - t) for m, t in starts.items() if m in commits]
    result = {
        "side": side,
        "sent": len(commits),
        "received": len(from_start),
        "rate": len(commits) / prod["elapsed"],
        "p50": percentile(from_start, 50),
        "p99": percentile(from_start, 99),
        "commit_p50": percentile(from_commit, 50),
        "commit_p99": percentile(from_commit, 99),
        "txn_p50": percentile(txn, 50),
        "cpu_pct": 100 * prod["cpu"] / prod["elapsed"],
        "cpu_us": 1e6 * prod["cpu"] / max(1, len(commits)),
    }
    print(
        f"  {side}: start->reader p50 {result['p50']:.1f} / p99 {result['p99']:.1f} ms, "
        f"txn p50 {result['txn_p50']:.2f} ms, producer CPU {result['cpu_pct']:.0f} % "
        f"({result['sent']} sent, {result['received']} received)",
        flush=True,
    )
    return result


async def main(args: argparse.Namespace) -> int:
    import asyncpg

    try:
        import txoutbox  # noqa: F401

        sides = ["library", "txoutbox"]
    except ImportError:
        print("txoutbox is not installed (pip install txoutbox): the library alone")
        sides = ["library"]
    banner(
        f"e2e at {args.rate:g}/s, {args.rounds} round(s) of {args.seconds:g} s per side — "
        f"{machine_note()}"
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    results: list[dict] = []
    async with bench_database("bench_e2e") as db_url:
        import os

        os.environ["BENCH_DATABASE_URL"] = db_url
        from benchmarks import bench_app

        await bench_app.create_schema()
        await bench_app.outbox.engine.dispose()
        if "txoutbox" in sides:
            from txoutbox.adapters.postgres import PostgresStorage

            pool = await asyncpg.create_pool(asyncpg_dsn(db_url), min_size=1, max_size=1)
            await PostgresStorage(pool, table=TXO_TABLE, notify_channel=TXO_CHANNEL).create_schema()
            await pool.close()
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                results.append(await one_run(side, db_url, args, workdir))
    rows = []
    med: dict[str, dict[str, float]] = {}
    for side in sides:
        mine = [x for x in results if x["side"] == side]
        med[side] = {k: median(x[k] for x in mine) for k in mine[0] if k != "side"}
        m = med[side]
        rows.append(
            [
                side,
                fmt(m["rate"]),
                f"{m['p50']:.1f} / {m['p99']:.1f}",
                f"{m['commit_p50']:.1f} / {m['commit_p99']:.1f}",
                fmt(m["txn_p50"], 2),
                fmt(m["cpu_pct"]),
                fmt(m["cpu_us"]),
            ]
        )
    banner("e2e: medians of the rounds")
    print(
        table(
            [
                *("side", "msg/s", "start->reader p50 / p99 ms", "commit->reader p50 / p99"),
                *("producer txn p50 ms", "producer CPU %", "producer CPU us/msg"),
            ],
            rows,
        )
    )
    lib = med["library"]
    print(f"  library p99 {lib['p99']:.1f} ms: {'ok' if lib['p99'] <= P99_GOAL_MS else 'OVER'}"
          f" (goal <= {P99_GOAL_MS:g} ms)")  # fmt: skip
    if "txoutbox" in med:
        txo = med["txoutbox"]
        print(f"  p50 library / txoutbox: {lib['p50'] / txo['p50']:.2f}x (goal <= 1.0)")
        print(
            f"  producer CPU library / txoutbox: {lib['cpu_pct'] / txo['cpu_pct']:.2f}x "
            f"(goal <= {CPU_CEILING})"
        )
    print(f"  {machine_note()}")
    return 0


def cli() -> None:
    if len(sys.argv) > 2 and sys.argv[1] in ("txo_producer", "txo_relay"):
        role = {"txo_producer": txo_producer, "txo_relay": txo_relay}[sys.argv[1]]
        asyncio.run(role(json.loads(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args()
    args.seconds = args.seconds or (4.0 if args.quick else 8.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    raise SystemExit(asyncio.run(main(args)))


if __name__ == "__main__":
    cli()
