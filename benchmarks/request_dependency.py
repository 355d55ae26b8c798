"""The request dependency's own cost: ``Depends(unit_of_work)`` (which maps an outage to a
503 with ``Retry-After``) against the same unit of work opened by hand in the endpoint.

Both endpoints publish one message on an in-memory SQLite outbox (commit included), served
in process through ``httpx.ASGITransport``; rounds alternate (A B A B …) and the medians of
the per-request time are printed with their ratio. What it prices is the dependency's
wrapper (FastAPI's resolution of it, the context manager, the error mapping on the way
out), not the database.

    python benchmarks/request_dependency.py [--requests 2000] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from fastapi import FastAPI

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWorkDep
from fastapi_outbox.brokers import MemoryBroker


def build() -> tuple[FastAPI, Outbox]:
    outbox = Outbox(
        "sqlite+aiosqlite:///:memory:",
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
    )
    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/dependency")
    async def with_dependency(uow: UnitOfWorkDep) -> None:
        uow.publish(Message("orders", "Placed", {"n": 1}))

    @app.post("/by-hand")
    async def by_hand() -> None:
        async with outbox.unit_of_work() as uow:
            uow.publish(Message("orders", "Placed", {"n": 1}))

    return app, outbox


async def round_of(client: httpx.AsyncClient, path: str, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        answer = await client.post(path)
        assert answer.status_code == 200, answer.text
    return (time.perf_counter() - started) / n * 1e6  # µs per request


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, rounds = (300, 3) if args.quick else (args.requests, args.rounds)
    app, outbox = build()
    await outbox.create_tables()
    transport = httpx.ASGITransport(app=app)
    times: dict[str, list[float]] = {"/dependency": [], "/by-hand": []}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://bench") as client,
    ):
        for path in times:  # warm-up
            await round_of(client, path, 50)
        for _ in range(rounds):
            for path in times:
                times[path].append(await round_of(client, path, n))
    await outbox.aclose()
    dep, hand = (statistics.median(times[p]) for p in ("/dependency", "/by-hand"))
    print(f"{n} requests x {rounds} alternating rounds, in process, SQLite in memory")
    print(f"  Depends(unit_of_work): {dep:8.1f} us/request (median of rounds)")
    print(f"  unit of work by hand:  {hand:8.1f} us/request")
    print(f"  ratio dependency/by hand: {dep / hand:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
