"""Claim-check: what a claim-checked message costs against the same payload inline.

Variants, each an ``Outbox`` on one PostgreSQL database (a table of its own) and Redis:

* **inline**: ``claim_check_bytes`` off, ``max_payload_bytes`` 8 MiB: the payload is in the
  outbox row and in the stream entry;
* **database**: ``claim_check_bytes=64 KiB``, ``claim_check_store="database"``: the payload
  is a row of ``<table>_payloads`` written in the producer's transaction, the stream entry
  carries a stub and the reference;
* **file**: the same with ``claim_check_store="file:///<tmp>"`` (a local directory; the
  file is fsynced before the commit).

Two measures per payload size (``--sizes``, default 1 KiB — under the threshold, the check
only — and 1 MiB):

* **write**: one ``outbox.unit_of_work()`` publishing one event and committing, ``--commits``
  times in a row: milliseconds per commit;
* **end to end**: with the relay and one subscriber running, ``--messages`` messages
  committed one per unit of work: milliseconds per message from the first commit until the
  handler has seen every one whole (the commits, dispatch to Redis, the subscriber's fetch,
  the claim-check look-up, decoding, the handler's transaction, pipelined).

Each figure also in this process's CPU time (producer, relay and subscriber run in
it; the database server's and Redis's CPU are not counted), steadier than wall time on a
loaded machine. Rounds alternate the variants' order (A B C, C B A, …); the tables print
medians and the ratio to inline.

    python benchmarks/claim_check.py           # 5 rounds
    python benchmarks/claim_check.py --quick   # 2 rounds, fewer messages
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
from fastapi_outbox import Event, UnitOfWork

VARIANTS = ("inline", "database", "file")
KIB = 1024
#: The stream of this run (deleted after each round).
STREAM = unique("bench_claim")


class Blob(Event, stream=STREAM):
    n: int
    data: str


def _settings(variant: str, directory: Path) -> dict[str, Any]:
    base: dict[str, Any] = {
        "table_name": f"ob_{variant}",
        "max_payload_bytes": 8 * KIB * KIB,
        "notify": False,
        "poll_interval_seconds": 0.01,
        "max_poll_interval_seconds": 0.05,
    }
    if variant == "database":
        base.update(claim_check_bytes=64 * KIB)
    elif variant == "file":
        base.update(claim_check_bytes=64 * KIB, claim_check_store=f"file://{directory}")
    return base


async def _round(
    db_url: str, variant: str, size: int, directory: Path, commits: int, messages: int
) -> tuple[float, float, float, float]:
    """(ms per commit, ms per message end to end, and the same in this process's CPU) of
    one round of ``variant``."""
    import redis.asyncio as aioredis

    from fastapi_outbox import Outbox, OutboxSettings
    from fastapi_outbox.brokers import RedisStreamsBroker

    stream = STREAM
    broker = RedisStreamsBroker(REDIS_URL)
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(**_settings(variant, directory)),
    )
    seen: list[int] = []
    target = [commits]
    done = asyncio.Event()

    @outbox.subscriber(stream, group="bench", start="all")
    async def handle(event: Blob, uow: UnitOfWork) -> None:
        assert len(event.data) == size
        seen.append(event.n)
        if len(seen) >= target[0]:
            done.set()

    await outbox.create_tables()
    data = "x" * size
    try:
        start, cpu = time.perf_counter(), time.process_time()
        for n in range(commits):
            async with outbox.unit_of_work() as uow:
                uow.publish(Blob(n=n, data=data))
        write_ms = (time.perf_counter() - start) * 1000 / commits
        write_cpu = (time.process_time() - cpu) * 1000 / commits
        # End to end: the messages of the write measure are drained first (not timed).
        async with outbox.relaying():
            await asyncio.wait_for(done.wait(), 120)
            seen.clear()
            done.clear()
            target[0] = messages
            start, cpu = time.perf_counter(), time.process_time()
            for n in range(messages):
                async with outbox.unit_of_work() as uow:
                    uow.publish(Blob(n=n, data=data))
            try:
                await asyncio.wait_for(done.wait(), 120)
            except TimeoutError:
                raise SystemExit(f"{variant}: {len(seen)} of {messages} handled in 120 s") from None
            e2e_ms = (time.perf_counter() - start) * 1000 / messages
            e2e_cpu = (time.process_time() - cpu) * 1000 / messages
        return write_ms, e2e_ms, write_cpu, e2e_cpu
    finally:
        await outbox.drop_tables()
        await outbox.aclose()
        client = aioredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=f"*{stream}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        _empty(directory)


def _empty(directory: Path) -> None:
    """Remove the file store's payloads of a round."""
    for path in directory.glob("*.payload"):
        path.unlink()


async def main(args: argparse.Namespace) -> None:
    loopback(REDIS_URL)
    sizes = [int(s) * KIB for s in args.sizes.split(",")]
    results: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    async with bench_database("bench_claim") as db_url:
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            for size in sizes:
                banner(f"payload {fmt(size // KIB)} KiB: {args.rounds} rounds")
                for r in range(args.rounds):
                    order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
                    for variant in order:
                        figures = await _round(
                            db_url, variant, size, directory, args.commits, args.messages
                        )
                        results.setdefault((variant, size), []).append(figures)
                        print(
                            f"  round {r + 1} {variant}: {figures[0]:.2f} ms/commit "
                            f"({figures[2]:.2f} CPU), {figures[1]:.2f} ms/message end to "
                            f"end ({figures[3]:.2f} CPU)",
                            flush=True,
                        )
    rows = []
    for size in sizes:
        base = [median(f[i] for f in results[("inline", size)]) for i in range(4)]
        for variant in VARIANTS:
            m = [median(f[i] for f in results[(variant, size)]) for i in range(4)]
            rows.append(
                [
                    f"{fmt(size // KIB)} KiB",
                    variant,
                    *(f"{fmt(m[i], 2)} ({m[i] / base[i]:.2f}x)" for i in (0, 2, 1, 3)),
                ]
            )
    banner(f"claim-check vs inline (medians, ratio to inline; {machine_note()})")
    print(
        table(
            [
                "payload",
                "variant",
                "ms/commit",
                "CPU ms/commit",
                "ms/msg end to end",
                "CPU ms/msg end to end",
            ],
            rows,
        )
    )
    print(
        "CPU: this process's (producer, relay and subscriber together), not the "
        "database server's nor Redis's."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--commits", type=int, default=50)
    parser.add_argument("--messages", type=int, default=50)
    parser.add_argument("--sizes", default="1,1024", help="payload sizes in KiB")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 10 messages")
    parsed = parser.parse_args()
    if parsed.quick:
        parsed.rounds, parsed.commits, parsed.messages = 2, 10, 10
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parsed))
