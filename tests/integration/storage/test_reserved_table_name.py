"""An SQL-reserved table name (``order``) works in every mode: plain and ordered dispatch,
health counts, retention and the CLI's listing, on SQLite and PostgreSQL."""

from __future__ import annotations

import anyio
import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.ops.health import compute_health
from tests.conftest import run_cli, wait_until


@pytest.mark.parametrize("ordered", [False, True], ids=["plain", "ordered"])
async def test_reserved_table_name_dispatches(db_url: str, ordered: bool) -> None:
    broker = MemoryBroker()
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            table_name="order",
            ordered=ordered,
            poll_interval_seconds=0.05,
            published_retention_seconds=0,
            cleanup_interval_seconds=0.05,
            health_cache_seconds=0,
        ),
    )
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            for n in range(6):
                async with outbox.unit_of_work() as uow:
                    uow.publish(Message(stream="s", type="T", payload={"n": n}, key=f"k{n % 2}"))
            await wait_until(lambda: len(broker.messages) == 6)
            health = await compute_health(outbox)
            assert health.relays[0].failed == 0

            # retention (0 s) then removes the published rows
            async def purged() -> bool:
                return await outbox.store.messages.count() == 0

            await wait_until(purged, timeout=10)
        by_key: dict[str, list[int]] = {}
        for m in broker.messages:
            by_key.setdefault(m.key or "", []).append(int(m.payload.decode().split(":")[1][:-1]))
        assert by_key == {"k0": [0, 2, 4], "k1": [1, 3, 5]}
        if not ordered:  # the CLI reads the same table
            result = await anyio.to_thread.run_sync(
                lambda: run_cli("list", "--url", db_url, "--table", "order")
            )
            assert result.returncode == 0, result.stderr
    finally:
        await outbox.aclose()
