"""Producer: one-event transactions, the library vs a bare ``AsyncSession`` in the same run.

Sequential transactions on one process, so the figure is the cost of one transaction (wall
time and this process's CPU), not the database's throughput:

* ``uow``: ``async with outbox.unit_of_work() as uow: uow.publish(event)`` — a script
  without a lifespan, wake-ups on (the default settings);
* ``bare``: the same INSERT into the same outbox table through a bare ``AsyncSession``
  (``session.execute(insert(table), row)``; ``commit()``) — the floor;
* ``uow, notify=False``: the same without wake-ups (for information: the NOTIFY's cost);
* ``asgi-uow``: ``POST`` to a route taking ``Depends(unit_of_work)`` that publishes one
  event, through an in-process ASGI client (httpx ``ASGITransport``), app started with
  ``outbox.lifespan`` (relays off: only the write path);
* ``asgi-bare``: the same request to a route whose dependency opens a bare session and
  commits the same INSERT before the response (``scope="function"``, as ``unit_of_work``).

The cases alternate transaction by transaction (uow, bare, …, uow, bare, …), each
transaction timed on its own; the median of each round, then the median of the rounds, are
printed with the ratios against their floor (1.1: the library costs at most 10 % more). ``--quick``
runs fewer, shorter rounds (``nox -s perf``).

    python benchmarks/producer.py            # 5 rounds of 2,000 transactions
    python benchmarks/producer.py --quick    # 3 rounds of 600
"""

# No `from __future__ import annotations`: the routes' dependencies are local names.
import argparse
import asyncio
import contextlib
import datetime as dt
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from fastapi import Depends, FastAPI
from sqlalchemy.ext.asyncio import AsyncSession

from benchmarks._common import (
    banner,
    bench_database,
    fmt,
    machine_note,
    median,
    record_ratio,
    table,
)
from fastapi_outbox import Event, Outbox, UnitOfWork, unit_of_work
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.statements.inserts import insert_rows

#: The library may cost at most this much more than the bare session (wall and CPU).
FLOOR_RATIO = 1.1


class OrderPlaced(Event, stream="orders", key="order_id"):
    order_id: int
    customer: str
    total: float


async def run(rounds: int, per_round: int) -> dict[str, tuple[float, float]]:
    async with bench_database("producer") as url:
        outbox = Outbox(
            url,
            brokers={"default": MemoryBroker()},
            settings=OutboxSettings(run_relays=False),
        )
        await outbox.create_tables()
        # The library's own INSERT (due time from the database's clock): the same statement.
        statement = insert_rows(outbox.table, outbox.engine.dialect)
        factory = outbox.session_factory

        def row(n: int) -> dict[str, Any]:
            event = OrderPlaced(order_id=n, customer="ada lovelace", total=42.5)
            message_id = uuid.uuid4()
            return {
                "id": message_id,
                "broker": "default",
                "stream": "orders",
                "type": "OrderPlaced",
                "key": str(n),
                "payload": event.model_dump_json(),
                "headers": json.dumps(
                    {
                        "message-id": str(message_id),
                        "type": "OrderPlaced",
                        "occurred-at": dt.datetime.now(dt.UTC).isoformat(),
                    },
                    separators=(",", ":"),
                ),
                "delay": dt.timedelta(0),
                "deliver_at": None,
            }

        app = FastAPI(lifespan=outbox.lifespan)

        async def bare_session() -> AsyncIterator[AsyncSession]:
            async with factory() as session, session.begin():
                yield session

        @app.post("/uow", status_code=201)
        async def with_uow(uow: Annotated[UnitOfWork, Depends(unit_of_work)]) -> dict[str, int]:
            uow.publish(OrderPlaced(order_id=1, customer="ada lovelace", total=42.5))
            return {"ok": 1}

        @app.post("/bare", status_code=201)
        async def with_bare(
            session: Annotated[AsyncSession, Depends(bare_session, scope="function")],
        ) -> dict[str, int]:
            await session.execute(statement, row(1))
            return {"ok": 1}

        results: dict[str, list[tuple[float, float]]] = {}
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(outbox.lifespan(app))
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
            )

            def asgi(path: str) -> Callable[[int], Awaitable[None]]:
                async def call(n: int) -> None:
                    response = await client.post(path)
                    assert response.status_code == 201, response.text

                return call

            # A script without a lifespan: a second Outbox on the same database, never
            # started (its commits wake the relays without the lifespan's notifier).
            script = Outbox(
                url,
                brokers={"default": MemoryBroker()},
                settings=OutboxSettings(run_relays=False),
            )
            factory_script = script.session_factory
            # The same without wake-ups (notify=False): what the NOTIFY the COMMIT carries
            # costs, for information.
            quiet = Outbox(
                url,
                brokers={"default": MemoryBroker()},
                settings=OutboxSettings(run_relays=False, notify=False),
            )

            async def uow_quiet(n: int) -> None:
                async with quiet.unit_of_work() as uow:
                    uow.publish(OrderPlaced(order_id=n, customer="ada lovelace", total=42.5))

            async def uow_script(n: int) -> None:
                async with script.unit_of_work() as uow:
                    uow.publish(OrderPlaced(order_id=n, customer="ada lovelace", total=42.5))

            async def bare_script(n: int) -> None:
                async with factory_script() as session:
                    await session.execute(statement, row(n))
                    await session.commit()

            cases: dict[str, Callable[[int], Awaitable[None]]] = {
                "uow (no lifespan)": uow_script,
                "bare (no lifespan)": bare_script,
                "uow, notify=False": uow_quiet,
                "asgi uow": asgi("/uow"),
                "asgi bare": asgi("/bare"),
            }
            for fn in cases.values():  # warm up: pools, prepared statements, caches
                for n in range(100):
                    await fn(n)
            # Cases alternate transaction by transaction (A B C … A B C …) and each
            # transaction is timed on its own: the medians shrug off the bursts of other
            # work on a shared machine. Rounds only split the run for the round medians.
            for _ in range(rounds):
                samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
                for n in range(per_round):
                    for name, fn in cases.items():
                        wall0, cpu0 = time.perf_counter(), time.process_time()
                        await fn(n)
                        samples[name].append(
                            (time.perf_counter() - wall0, time.process_time() - cpu0)
                        )
                for name, values in samples.items():
                    results.setdefault(name, []).append(
                        (median(w for w, _ in values), median(c for _, c in values))
                    )
            await script.engine.dispose()
            await quiet.engine.dispose()
        await outbox.engine.dispose()
    return {
        name: (median(w for w, _ in values), median(c for _, c in values))
        for name, values in results.items()
    }


def report(
    figures: dict[str, tuple[float, float]], ratios_path: str | None = None
) -> list[tuple[str, float, float]]:
    """Print the per-transaction figures and the ratios; returns ``(what, ratio, floor)``."""
    rows = [(name, fmt(w * 1e6), fmt(c * 1e6)) for name, (w, c) in figures.items()]
    print(table(["transaction", "wall µs/txn", "client CPU µs/txn"], rows))
    ratios = []
    for lib, base, label in (
        ("uow (no lifespan)", "bare (no lifespan)", "producer uow / bare session"),
        ("asgi uow", "asgi bare", "producer Depends(unit_of_work) / bare session"),
    ):
        (lw, lc), (bw, bc) = figures[lib], figures[base]
        ratios.append((f"{label}, wall", lw / bw, FLOOR_RATIO))
        ratios.append((f"{label}, CPU", lc / bc, FLOOR_RATIO))
    for what, ratio, floor in ratios:
        verdict = "ok" if ratio <= floor else "OVER"
        print(f"  {what}: {ratio:.2f}x (ceiling {floor}x) {verdict}")
        record_ratio(ratios_path, what, ratio, floor, most=True)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 600 transactions")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--per-round", type=int)
    parser.add_argument("--ratios", help="append the ratios to this JSON-lines file")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    per_round = args.per_round or (600 if args.quick else 2000)
    banner(f"producer: one-event transactions, {rounds} alternating rounds of {per_round}")
    print(machine_note())
    report(asyncio.run(run(rounds, per_round)), args.ratios)


if __name__ == "__main__":
    main()
