"""The price of telling a commit's outcome truly: ``outbox.unit_of_work()`` (one INSERT of a
business row, one event, COMMIT) with the library's commit — run in a task of its own that a
cancellation of the caller does not interrupt, the COMMIT noted when sent — vs the same unit
of work committing with a bare ``session.commit()`` (the hand-written baseline), in
alternating rounds in one process, on PostgreSQL. Prints the median time and CPU per unit
of work of each and their ratio; then, without a database (no I/O noise), the CPU the
commit's own task and shield add to one awaited coroutine.

    python benchmarks/commit_outcome.py            # 6 rounds of 2,000 units of work each way
    python benchmarks/commit_outcome.py --quick    # 2 rounds of 300
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Integer
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from benchmarks._common import banner, bench_database, fmt, machine_note, median, table
from fastapi_outbox import Event, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.write import unit_of_work as uow_module


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "bench_commit_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)


class OrderPlaced(Event, stream="bench_commit"):
    n: int


async def bare_commit(session: AsyncSession, committed: Callable[[], None]) -> None:
    await session.commit()
    committed()


async def one_round(outbox: Outbox, count: int) -> tuple[float, float]:
    """(wall µs, CPU µs) per unit of work over ``count`` of them."""
    wall, cpu = time.perf_counter(), time.process_time()
    for n in range(count):
        async with outbox.unit_of_work() as uow:
            uow.session.add(Order())
            uow.publish(OrderPlaced(n=n))
    return (
        (time.perf_counter() - wall) / count * 1e6,
        (time.process_time() - cpu) / count * 1e6,
    )


async def main(rounds: int, count: int) -> None:
    banner("commit outcome: library commit vs bare session.commit()")
    print(machine_note())
    async with bench_database("bench_commit") as url:
        # notify off: the NOTIFY's own round trip is not what is measured.
        outbox = Outbox(
            url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(notify=False)
        )
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        library = uow_module.commit
        results: dict[str, list[tuple[float, float]]] = {"library": [], "bare": []}
        try:
            await one_round(outbox, max(50, count // 10))  # warm-up
            for _ in range(rounds):
                for name, commit in (("library", library), ("bare", bare_commit)):
                    uow_module.commit = commit  # type: ignore[assignment]
                    results[name].append(await one_round(outbox, count))
        finally:
            uow_module.commit = library  # type: ignore[assignment]
            await outbox.aclose()
    rows: list[list[Any]] = []
    base_wall = median(w for w, _ in results["bare"])
    base_cpu = median(c for _, c in results["bare"])
    for name, values in results.items():
        wall = median(w for w, _ in values)
        cpu = median(c for _, c in values)
        rows.append([name, fmt(wall), fmt(cpu), f"{wall / base_wall:.3f}", f"{cpu / base_cpu:.3f}"])
    print(table(["commit", "wall µs/uow", "cpu µs/uow", "wall vs bare", "cpu vs bare"], rows))
    print("per-round wall µs:", {k: [round(w) for w, _ in v] for k, v in results.items()})


async def task_overhead(rounds: int, count: int) -> None:
    """CPU µs the library's way of awaiting a commit adds (a task, ``asyncio.shield``, the
    context variable) to awaiting the same coroutine directly: alternating rounds."""

    async def work() -> None:
        await asyncio.sleep(0)

    async def direct() -> None:
        await work()

    async def shielded() -> None:
        task = asyncio.get_running_loop().create_task(work())
        await asyncio.shield(task)

    results: dict[str, list[float]] = {"direct": [], "task + shield": []}
    for _ in range(rounds):
        for name, way in (("direct", direct), ("task + shield", shielded)):
            cpu = time.process_time()
            for _ in range(count):
                await way()
            results[name].append((time.process_time() - cpu) / count * 1e6)
    base = median(results["direct"])
    print(
        table(
            ["await", "cpu µs", "added µs"],
            [[k, f"{median(v):.1f}", f"{median(v) - base:.1f}"] for k, v in results.items()],
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 300")
    args = parser.parse_args()
    asyncio.run(main(2, 300) if args.quick else main(6, 2000))
    asyncio.run(task_overhead(3 if args.quick else 7, 20_000))
