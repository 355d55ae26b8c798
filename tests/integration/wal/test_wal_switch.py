"""Switching a running service between capture="table" and capture="wal" (README:
"Switching modes") loses and duplicates nothing.

Processes are played by Outbox instances on one database and one table: producers (API
only) and relays of each mode, sharing one de-duplicating MemoryBroker (one id, one
message), while producers keep committing."""

from __future__ import annotations

import anyio
import anyio.abc

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import slot_empty, wait_until

FAST = {"poll_interval_seconds": 0.05, "max_poll_interval_seconds": 0.2}


def make(url: str, broker: MemoryBroker, capture: str, *, dispatch: bool) -> Outbox:
    return Outbox(
        url,
        brokers={"default": broker},
        settings=OutboxSettings(capture=capture, run_relays=dispatch, **FAST),
    )


class Producers:
    """A task committing one message every few ms through whichever producer outbox is
    current: a rolling deploy swaps it while commits go on."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.ids: list[tuple[str, str]] = []  # (message id, capture)
        self.stop = anyio.Event()
        self.done = anyio.Event()

    async def run(self) -> None:
        n = 0
        try:
            while not self.stop.is_set():
                outbox = self.outbox
                async with outbox.unit_of_work() as uow:
                    message_id = uow.publish(Message("switch", "Tick", {"n": n}))
                self.ids.append((str(message_id), outbox.settings.capture))
                n += 1
                with anyio.move_on_after(0.005):
                    await self.stop.wait()
        finally:
            self.done.set()

    async def commits(self, count: int) -> None:
        target = len(self.ids) + count
        await wait_until(lambda: len(self.ids) >= target, timeout=10)


class Running:
    """A relay process: ``await start(tg)``, ``await stop()``."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self._stop = anyio.Event()
        self._started = anyio.Event()
        self._done = anyio.Event()

    async def _run(self) -> None:
        try:
            async with self.outbox.relaying():
                self._started.set()
                await self._stop.wait()
        finally:
            self._done.set()

    async def start(self, tg: anyio.abc.TaskGroup) -> Running:
        tg.start_soon(self._run)
        await self._started.wait()
        return self

    async def stop(self) -> None:
        self._stop.set()
        await self._done.wait()


async def test_switching_table_to_wal_and_back_loses_nothing(wal_pg_url: str) -> None:
    broker = MemoryBroker()
    table_producer = make(wal_pg_url, broker, "table", dispatch=False)
    wal_producer = make(wal_pg_url, broker, "wal", dispatch=False)
    table_dispatcher = make(wal_pg_url, broker, "table", dispatch=True)
    wal_dispatcher = make(wal_pg_url, broker, "wal", dispatch=True)
    table_dispatcher_again = make(wal_pg_url, broker, "table", dispatch=True)
    everything = [table_producer, wal_producer, table_dispatcher, wal_dispatcher]
    everything.append(table_dispatcher_again)
    slot = wal_dispatcher.wal_slot
    assert slot is not None
    await table_producer.create_tables()
    producers = Producers(table_producer)
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(producers.run)
                table_mode = await Running(table_dispatcher).start(tg)
                await producers.commits(20)
                # table -> wal. 1: `db create` with capture='wal' (the slot, the publication).
                await wal_dispatcher.create_tables()
                # 2: relays restart with capture='wal' (they serve the table as well).
                wal_mode = await Running(wal_dispatcher).start(tg)
                await producers.commits(10)
                await table_mode.stop()
                # 3: producers roll over to capture='wal'.
                producers.outbox = wal_producer
                await producers.commits(40)
                # wal -> table. 1: producers roll back to capture='table'.
                producers.outbox = table_producer
                await producers.commits(20)
                # 2: wait until the slot holds nothing any more: the relay confirmed past
                # the last commit of a wal producer.
                await wait_until(lambda: slot_empty(slot), timeout=15)
                # 3: relays restart with capture='table'.
                table_mode = await Running(table_dispatcher_again).start(tg)
                await wal_mode.stop()
                # 4: `db drop-slot` (it holds nothing: refused otherwise).
                await slot.drop()
                await producers.commits(20)
                producers.stop.set()
                await producers.done.wait()  # its last commit included
                await wait_until(
                    lambda: {m.id for m in broker.messages} >= {i for i, _ in producers.ids},
                    timeout=15,
                )
                await table_mode.stop()
        captures = [c for _, c in producers.ids]
        assert captures.count("wal") >= 35 and captures.count("table") >= 55
        assert sorted(m.id for m in broker.messages) == sorted(i for i, _ in producers.ids)
        assert broker.duplicates == 0
    finally:
        for outbox in everything:
            await outbox.aclose()
