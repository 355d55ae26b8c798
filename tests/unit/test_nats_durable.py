"""NATS durable names and the refusal of an existing durable's settings (the update itself
is tested on the real server in tests/integration/consume/test_consumer_groups.py)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import NatsJetStreamBroker
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.nats.consumer import durable_name


def test_durable_names_are_stable_valid_bounded_and_one_per_subject() -> None:
    a = durable_name("billing", "orders.eu")
    assert a == durable_name("billing", "orders.eu")
    assert a != durable_name("billing", "orders.us")
    assert a.startswith("billing_")
    long = durable_name("g" * 200, "x." * 500)
    assert len(long) <= 213
    for name in (a, long, durable_name("a-b_c", "orders.*.>")):
        assert re.fullmatch(r"[A-Za-z0-9_-]+", name)


@dataclasses.dataclass
class _Config:
    filter_subject: str
    ack_wait: float
    max_deliver: int

    def evolve(self, **changes: Any) -> _Config:
        return dataclasses.replace(self, **changes)


class _RefusingJetStream:
    async def consumer_info(self, stream: str, durable: str) -> Any:
        return type("Info", (), {"config": _Config("orders", 30.0, 5)})()

    async def add_consumer(self, stream: str, config: Any) -> Any:
        import nats.js.errors

        raise nats.js.errors.BadRequestError(code=400, err_code=10012, description="refused")


async def test_a_refused_update_refuses_the_start_naming_group_durable_and_settings() -> None:
    config = ConsumerConfig("orders", "billing", "c1", "orders.billing.dlq", 60.0, 8)
    consumer = NatsJetStreamBroker("nats://127.0.0.1:1").consumer(config)
    with pytest.raises(exceptions.ConfigurationError) as caught:
        await consumer.ensure_durable(_RefusingJetStream(), "orders")
    text = str(caught.value)
    assert "group 'billing'" in text and consumer.durable in text
    assert "max_deliver 5 -> -1" in text and "ack_wait 30.0 -> 60.0" in text
    assert "filter_subject" not in text  # unchanged settings are not named
