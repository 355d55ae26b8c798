"""The part that moves committed rows to brokers has one name, relay, wherever it shows."""

from __future__ import annotations

from typing import Any, cast

from fastapi_outbox import OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.relay.table import TableRelay


def test_a_table_relay_prints_itself_as_a_table_relay() -> None:
    relay = TableRelay(
        store=cast(Any, None),
        broker_name="default",
        broker=MemoryBroker(),
        settings=OutboxSettings(),
        instance="test",
    )
    assert repr(relay) == "TableRelay(broker='default')"
