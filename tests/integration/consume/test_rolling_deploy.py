"""Two code versions of one consumer group side by side, as during a rolling deploy, on
every broker: a message is never settled by a process while another live process of its
group takes its type. Each "version" is an ``Outbox`` of its own (another broker object,
as another process has) whose subscriber takes another set of types, for the same stream
and group. Effects are rows per message id, counted."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from fastapi_outbox import Event, Message, Outbox, OutboxSettings, UnitOfWork, uuid7
from tests.conftest import wait_until
from tests.integration.consume.test_consumer_contract import (
    FAST,
    Base,
    Harness,
    Invoice,
    effects,
    harness,
)

__all__ = ["harness"]

pytestmark = pytest.mark.usefixtures("quick_fetch")

GROUP = "deploys"
PER_TYPE = 8


@pytest.fixture(autouse=True)
def quick_hand_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Handed-back messages go to the group again after 0.2 s (1 s in the library)."""
    monkeypatch.setattr("fastapi_outbox.consume.versions.HAND_BACK_SECONDS", 0.2)


@pytest.fixture(autouse=True)
async def versions_closed() -> AsyncIterator[None]:
    """The versions' engines closed after the test."""
    yield
    while OPEN:
        await OPEN.pop().aclose()


OPEN: list[Outbox] = []


def three_types(stream: str) -> tuple[type[Event], type[Event], type[Event]]:
    def event(name: str) -> type[Event]:
        return type(name, (Event,), {"__annotations__": {"order_id": int}}, stream=stream)

    return event("Placed"), event("Paid"), event("Shipped")


async def version(h: Harness, stream: str, takes: Any, **settings: Any) -> Outbox:
    """An Outbox whose subscriber of (``stream``, GROUP) takes ``takes`` (a type, a union
    or ``Message``) and writes one Invoice row per message."""
    assert h.twin is not None
    outbox = Outbox(
        h.db_url,
        brokers={"default": h.twin()},
        settings=OutboxSettings(**{**FAST, **settings}),
    )

    async def handle(message: Any, uow: UnitOfWork) -> None:
        assert uow.causation_id is not None
        uow.session.add(Invoice(order_id=0, message_id=uow.causation_id))

    handle.__annotations__["message"] = takes
    outbox.subscriber(stream, group=GROUP, start="all")(handle)
    OPEN.append(outbox)
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    return outbox


async def publish(outbox: Outbox, *events: Event) -> list[str]:
    async with outbox.unit_of_work() as uow:
        return [str(uow.publish(e)) for e in events]


def each(*classes: type[Event]) -> list[Event]:
    return [cls(order_id=n) for cls in classes for n in range(PER_TYPE)]  # type: ignore[call-arg]


async def handled(outbox: Outbox, ids: list[str]) -> dict[str, int]:
    rows = await effects(outbox)
    return {m: rows[m] for m in ids if m in rows}


def settled(outbox: Outbox) -> int:
    """Messages the outbox's subscriber handled or skipped so far."""
    stats = outbox.subscribers[0].stats
    return stats.handled + stats.skipped + stats.duplicates


@contextlib.asynccontextmanager
async def deployed() -> AsyncIterator[Any]:
    """``start(outbox)`` runs its relay until ``stop(outbox)`` (or the end)."""
    stops: dict[int, anyio.Event] = {}
    done: dict[int, anyio.Event] = {}
    async with anyio.create_task_group() as tg:

        async def run(outbox: Outbox, task_status: Any) -> None:
            async with outbox.relaying():
                task_status.started()
                await stops[id(outbox)].wait()
            done[id(outbox)].set()

        class Deploy:
            async def start(self, outbox: Outbox) -> None:
                stops[id(outbox)], done[id(outbox)] = anyio.Event(), anyio.Event()
                await tg.start(run, outbox)

            async def stop(self, outbox: Outbox) -> None:
                stops[id(outbox)].set()
                await done[id(outbox)].wait()

        try:
            yield Deploy()
        finally:
            for stop in stops.values():
                stop.set()


@pytest.mark.parametrize("order", ["old_first", "new_first"])
async def test_two_versions_of_a_group_settle_nothing_the_other_takes(
    harness: Harness, order: str
) -> None:
    """v1 takes Placed and Paid; v2 takes Placed and Shipped (Shipped added, Paid
    removed). The first version runs alone, the second joins, the first leaves; each
    phase publishes every type. Old code: while both ran, each skipped the other's
    type (never handled)."""
    h = harness
    if h.kind == "kafka":
        pytest.skip(
            "on Kafka a partition has one process of the group: a type its process does not "
            "take waits there until the partition moves (docs: brokers, Kafka, rolling deploys)"
        )
    stream = h.stream()
    Placed, Paid, Shipped = three_types(stream)
    v1 = await version(h, stream, Placed | Paid)
    v2 = await version(h, stream, Placed | Shipped)
    first, second = (v1, v2) if order == "old_first" else (v2, v1)
    takes = {id(v1): (Placed, Paid), id(v2): (Placed, Shipped)}

    async def alone(outbox: Outbox) -> None:
        """Every type published: the outbox's types handled once, the other skipped."""
        before = settled(outbox)
        events = each(Placed, Paid, Shipped)
        ids = await publish(first, *events)
        mine = [m for m, e in zip(ids, events, strict=True) if isinstance(e, takes[id(outbox)])]
        await wait_until(lambda: settled(outbox) - before >= len(ids), timeout=20)
        assert await handled(outbox, ids) == dict.fromkeys(mine, 1)

    async with deployed() as deploy:
        await deploy.start(first)
        await alone(first)
        await deploy.start(second)
        # Both run: every type either takes is handled once; nothing skipped.
        skipped = [o.subscribers[0].stats.skipped for o in (first, second)]
        ids = await publish(first, *each(Placed, Paid, Shipped))

        async def all_handled() -> bool:
            return len(await handled(first, ids)) == len(ids)

        # Hand-backs go to whichever consumer of the group asks first, a fresh coin toss
        # each round (the delay is spread): done within 2 s on a loaded machine. Without the
        # spread both versions swapped each other's messages round after round for 60 s.
        await wait_until(all_handled, timeout=20)
        assert await handled(first, ids) == dict.fromkeys(ids, 1)
        assert [o.subscribers[0].stats.skipped for o in (first, second)] == skipped
        await deploy.stop(first)
        await alone(second)
        for outbox in (first, second):
            assert outbox.subscribers[0].stats.dead_lettered == 0
        consumer = second.subscribers[0].consumer
        assert consumer is not None
        assert await consumer.count_dead_letters() == 0


async def test_a_type_only_a_newer_version_knows_waits_for_it_then_its_grace(
    harness: Harness,
) -> None:
    """A type no Event class of v1 declares: handled by v2 (a ``Message`` handler, it
    takes every type) while both run — old code dead-lettered it at once in v1 — and, with
    no process of the group taking it, handed back until the grace ends, then
    dead-lettered naming the type and the group."""
    h = harness
    if h.kind == "kafka":
        pytest.skip(
            "on Kafka a partition has one process of the group: v1 keeps what lands on its "
            "partitions until the partition moves (docs: brokers, Kafka, rolling deploys)"
        )
    stream = h.stream()
    Placed, _, _ = three_types(stream)
    v1 = await version(h, stream, Placed, consumer_unknown_type_grace_seconds=1.0)
    v2 = await version(h, stream, Message)
    async with v1.relaying():
        async with v2.relaying():
            ids = [str(uuid7()) for _ in range(PER_TYPE)]
            for m in ids:
                await h.inject(stream, m, "Refunded", {"order_id": 1}, {})

            async def all_handled() -> bool:
                return len(await handled(v1, ids)) == len(ids)

            await wait_until(all_handled, timeout=60)
            assert await handled(v1, ids) == dict.fromkeys(ids, 1)
            assert v1.subscribers[0].stats.dead_lettered == 0
        # v2 gone: nobody takes Refunded; handed back for the grace, then dead-lettered.
        late = str(uuid7())
        await h.inject(stream, late, "Refunded", {"order_id": 2}, {})
        sub = v1.subscribers[0]
        await wait_until(lambda: sub.stats.dead_lettered == 1, timeout=20)
        assert sub.stats.handed_back >= 1
        assert sub.consumer is not None
        [dead] = await sub.consumer.dead_letters()
        assert dead.message_id == late
        assert "no process of group 'deploys' has handled type 'Refunded'" in dead.error
        assert "consumer_unknown_type_grace_seconds=1" in dead.error
        assert await handled(v1, [late]) == {}
