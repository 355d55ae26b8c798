"""The house move at run time: the package before the move and now, in the same run.

Issue 18 moved the flat package into capability packages (storage, write, relay, consume,
ops, brokers) and split its largest classes. This script checks that the move costs
nothing at run time: it extracts the package of a commit from before the move
(``--before``, default ``d26d8b2``, the last flat layout) into a temporary folder and runs
the same workloads against it and against this checkout, in alternating rounds (before,
after, after, before, …), and prints medians, spreads and the ratio after/before:

* **drain** — a backlog (20,000 rows; ``--quick`` 5,000) drained to Redis and NATS by one
  ``fastapi-outbox dispatch`` process at default settings (``benchmarks/dispatch.py`` (a));
* **latency** — commit → XADD at 1,000 msg/s for 5 s (``--quick`` 2 s), relay in a
  separate process woken by LISTEN/NOTIFY (``benchmarks/dispatch.py`` (b));
* **consume** — handled msg/s of a per-message handler and of a batch handler with one
  array insert on Redis and NATS, with the inbox (``benchmarks/consume.py``), 10,000
  messages after a 2,000-message warm-up (``--quick`` 3,000 / 500).

Each side runs in its own processes with ``PYTHONPATH`` pointing at its package; the
benchmark code itself (this checkout's ``benchmarks/``) is the same for both and only uses
import paths that exist in both layouts.

    python benchmarks/house.py                  # ~6 minutes
    python benchmarks/house.py --quick          # smoke run
    python benchmarks/house.py --only consume --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    NATS_URL,
    REDIS_URL,
    ROOT,
    asyncpg_dsn,
    banner,
    bench_database,
    loopback,
    machine_note,
    median,
    processes,
    table,
    unique,
)

SIDES = ("before", "after")
URLS = {"redis": loopback(REDIS_URL), "nats": loopback(NATS_URL)}


def extract(rev: str, into: Path) -> Path:
    """The package as it was at ``rev``, in ``into`` (``git archive``: no work tree)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "fastapi_outbox"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def pythonpath(side: str, before: Path) -> str:
    return f"{before}{os.pathsep}{ROOT}" if side == "before" else str(ROOT)


def order(round_: int) -> tuple[str, ...]:
    return SIDES if round_ % 2 == 0 else SIDES[::-1]


# -- drain and latency: benchmarks/dispatch.py's functions, one side's PYTHONPATH per round ----


async def drain_rounds(conn: Any, db_url: str, args: argparse.Namespace, before: Path) -> list:
    from benchmarks.dispatch import Brokers, Group, drain, start_library
    from fastapi_outbox.relay.wakeups import channel_name

    rows: list[list[Any]] = []
    brokers = Brokers()
    await brokers.connect(args.brokers)
    workdir = Path(tempfile.mkdtemp(prefix="bench_house_"))
    try:
        for kind in args.brokers:
            rates: dict[str, list[float]] = {s: [] for s in SIDES}
            cpus: dict[str, list[float]] = {s: [] for s in SIDES}
            for r in range(args.rounds):
                for side in order(r):
                    os.environ["PYTHONPATH"] = pythonpath(side, before)
                    with processes() as procs:
                        start_library(
                            procs,
                            f"{side}_{kind}_{r}",
                            db_url,
                            URLS[kind],
                            "default",
                            workdir,
                            count=1,
                            settings={},
                        )
                        group = Group(side, "library", "default", procs)
                        result = await drain(
                            conn,
                            brokers,
                            kind,
                            group,
                            args.backlog,
                            channel_name("outbox_messages"),
                        )
                    if result.check != "ok":
                        raise SystemExit(f"drain {side} {kind}: {result.check}")
                    rates[side].append(result.rate)
                    cpus[side].append(result.relay_us)
                    print(
                        f"  drain {kind} round {r + 1} {side}: {result.rate:,.0f} msg/s, "
                        f"{result.relay_us:.1f} µs CPU/msg",
                        flush=True,
                    )
            rows.append(figure(f"drain {kind} msg/s", rates))
            rows.append(figure(f"drain {kind} relay CPU µs/msg", cpus))
    finally:
        os.environ.pop("PYTHONPATH", None)
        await brokers.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


async def latency_rounds(conn: Any, db_url: str, args: argparse.Namespace, before: Path) -> list:
    from benchmarks.dispatch import Brokers, latency_suite

    brokers = Brokers()
    await brokers.connect(["redis"])
    workdir = Path(tempfile.mkdtemp(prefix="bench_house_"))
    opts = argparse.Namespace(
        latency_broker="redis",
        rate=1000.0,
        latency_seconds=args.latency_seconds,
        library_env=[],
    )
    p50: dict[str, list[float]] = {s: [] for s in SIDES}
    p99: dict[str, list[float]] = {s: [] for s in SIDES}
    inproc50: dict[str, list[float]] = {s: [] for s in SIDES}
    try:
        for r in range(args.rounds):
            for side in order(r):
                os.environ["PYTHONPATH"] = pythonpath(side, before)
                result, inproc = await latency_suite(conn, brokers, opts, workdir, db_url)
                inproc50[side].append(inproc.p50)
                if result.received < result.sent:
                    raise SystemExit(f"latency {side}: {result.received}/{result.sent} received")
                p50[side].append(result.p50)
                p99[side].append(result.p99)
                print(
                    f"  latency round {r + 1} {side}: p50 {result.p50:.2f} ms, "
                    f"p99 {result.p99:.2f} ms",
                    flush=True,
                )
    finally:
        os.environ.pop("PYTHONPATH", None)
        await brokers.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return [
        figure("latency p50 ms (relay process)", p50),
        figure("latency p99 ms (relay process)", p99),
        figure("latency p50 ms (relay in the producer)", inproc50),
    ]


# -- consume: benchmarks/consume.py's library side in a child process per round ---------------


def consume_child(options: dict[str, Any]) -> None:
    """In the child: fill a stream, consume it with the library, print the figures."""
    try:
        import fastapi_outbox.consume.subscriber  # noqa: F401
    except ImportError:  # the flat layout: the same class at its old path
        import fastapi_outbox.subscribers as flat

        sys.modules["fastapi_outbox.consume.subscriber"] = flat
    from benchmarks.consume import fill, run_library

    async def run() -> tuple[float, float]:
        total = options["messages"] + options["warmup"]
        await fill(options["url"], options["stream"], total)
        return await run_library(
            options["db_url"],
            options["url"],
            options["stream"],
            total,
            batch=options["batch"],
            warmup=options["warmup"],
        )

    rate, cpu = asyncio.run(run())
    print(json.dumps({"rate": rate, "cpu": cpu}), flush=True)


async def consume_rounds(db_url: str, args: argparse.Namespace, before: Path) -> list:
    from benchmarks.consume import cleanup

    rows: list[list[Any]] = []
    for kind in args.brokers:
        for batch, label in (("", "per message"), ("arrays", "batch, array insert")):
            rates: dict[str, list[float]] = {s: [] for s in SIDES}
            for r in range(args.rounds):
                for side in order(r):
                    stream = unique(f"house_{side}")
                    options = {
                        "db_url": db_url,
                        "url": URLS[kind],
                        "stream": stream,
                        "batch": batch,
                        "messages": args.messages,
                        "warmup": args.warmup,
                    }
                    env = {**os.environ, "PYTHONPATH": pythonpath(side, before)}
                    try:
                        done = await asyncio.to_thread(
                            subprocess.run,
                            [sys.executable, __file__, "--consume-child", json.dumps(options)],
                            env=env,
                            capture_output=True,
                            text=True,
                            timeout=600,
                        )
                    finally:
                        await cleanup(kind, URLS[kind], stream)
                    if done.returncode != 0:
                        raise SystemExit(f"consume {side} {kind}: {done.stderr[-2000:]}")
                    rate = json.loads(done.stdout.strip().splitlines()[-1])["rate"]
                    rates[side].append(rate)
                    print(
                        f"  consume {kind} {label} round {r + 1} {side}: {rate:,.0f} msg/s",
                        flush=True,
                    )
            rows.append(figure(f"consume {kind} {label} msg/s", rates))
    return rows


def figure(name: str, values: dict[str, list[float]]) -> list[Any]:
    b, a = median(values["before"]), median(values["after"])

    def spread(v: list[float]) -> str:
        return f"{min(v):,.1f} to {max(v):,.1f}"

    return [
        name,
        f"{b:,.1f}",
        spread(values["before"]),
        f"{a:,.1f}",
        spread(values["after"]),
        f"{a / b:.2f}" if b else "-",
    ]


async def main(args: argparse.Namespace) -> None:
    import asyncpg

    banner(
        f"the house move: {args.before} (before) vs this checkout (after), "
        f"{args.rounds} alternating rounds — {machine_note()}"
    )
    started = time.monotonic()
    before = extract(args.before, Path(tempfile.mkdtemp(prefix="house_before_")))
    rows: list[list[Any]] = []
    try:
        async with bench_database("house") as db_url:
            os.environ["BENCH_DATABASE_URL"] = db_url
            from benchmarks import bench_app

            await bench_app.create_schema()
            await bench_app.outbox.engine.dispose()
            conn = await asyncpg.connect(asyncpg_dsn(db_url))
            await conn.execute(
                "CREATE TABLE effects (id bigserial PRIMARY KEY, n int NOT NULL, "
                "message_id text NOT NULL)"
            )
            try:
                if "drain" in args.only:
                    rows += await drain_rounds(conn, db_url, args, before)
                if "latency" in args.only:
                    rows += await latency_rounds(conn, db_url, args, before)
                if "consume" in args.only:
                    rows += await consume_rounds(db_url, args, before)
            finally:
                await conn.close()
    finally:
        shutil.rmtree(before, ignore_errors=True)
    print()
    print(table(["figure", "before", "spread", "after", "spread", "after/before"], rows))
    print(f"\nfinished in {time.monotonic() - started:.0f} s; {machine_note()}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="d26d8b2", help="commit of the flat layout")
    p.add_argument("--quick", action="store_true", help="smoke run with small sizes")
    p.add_argument("--rounds", type=int, help="rounds per side (default 3; quick 2)")
    p.add_argument(
        "--only",
        nargs="+",
        default=["drain", "latency", "consume"],
        choices=["drain", "latency", "consume"],
    )
    p.add_argument("--brokers", nargs="+", default=["redis", "nats"], choices=["redis", "nats"])
    p.add_argument("--consume-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.backlog = 5_000 if args.quick else 20_000
    args.latency_seconds = 2.0 if args.quick else 5.0
    args.messages = 3_000 if args.quick else 10_000
    args.warmup = 500 if args.quick else 2_000
    return args


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.consume_child:
        consume_child(json.loads(parsed.consume_child))
    else:
        asyncio.run(main(parsed))
