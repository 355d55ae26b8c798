"""Subscriber option checks: each refusal names the handler and the option; defaults come
from the settings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fastapi_outbox import Event, Outbox
from fastapi_outbox.brokers.memory import MemoryBroker
from fastapi_outbox.consume.options import (
    DEAD_LETTER_TEMPLATE,
    check_batch_handler,
    check_options,
    subscriber_options,
)
from fastapi_outbox.exceptions import ConfigurationError
from fastapi_outbox.settings import OutboxSettings


async def bill(event: Any) -> None:
    pass


VALID: dict[str, Any] = {
    "stream": "orders",
    "group": "billing",
    "concurrency": 4,
    "max_attempts": 5,
    "batch_size": 10,
    "start": "new",
    "claim_idle_seconds": 30.0,
    "retry_max_delay_seconds": 10.0,
}


def test_valid_options_pass() -> None:
    check_options(bill, **VALID)
    check_options(bill, **{**VALID, "start": "all", "group": "a-b_C9"})


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("stream", "", "invalid stream ''"),
        ("stream", "or ders", "invalid stream 'or ders'"),
        ("stream", 7, "invalid stream 7"),
        ("group", "bill ing", "group 'bill ing' must be 1-200 letters"),
        ("group", "x" * 201, "must be 1-200 letters, digits"),
        ("concurrency", 0, "concurrency must be >= 1"),
        ("max_attempts", 0, "max_attempts must be >= 1"),
        ("batch_size", 1.5, "batch_size must be >= 1"),
        ("start", "latest", "start must be 'new' .* not 'latest'"),
        ("retry_max_delay_seconds", 30.0, r"retry_max_delay_seconds \(30\) must be below"),
    ],
)
def test_each_refusal_names_the_handler_and_the_option(
    option: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        check_options(bill, **{**VALID, option: value})
    assert str(caught.value).startswith("subscriber 'bill': ")


def test_a_sync_handler_is_refused() -> None:
    def sync(event: Any) -> None:
        pass

    with pytest.raises(
        ConfigurationError,
        match=re.escape("subscriber 'test_a_sync_handler_is_refused.<locals>.sync': the handler"),
    ):
        check_options(sync, **VALID)


def test_a_batch_handler_refuses_ordered_and_batch_false() -> None:
    check_batch_handler(bill, batch_handler=True, ordered=False, batch=True)
    check_batch_handler(bill, batch_handler=False, ordered=True, batch=False)
    for ordered, batch in ((True, True), (False, False)):
        with pytest.raises(ConfigurationError, match="subscriber 'bill': a batch handler"):
            check_batch_handler(bill, batch_handler=True, ordered=ordered, batch=batch)


def test_options_left_none_take_the_settings() -> None:
    settings = OutboxSettings(consumer_concurrency=3, consumer_max_attempts=7)
    given = subscriber_options(
        settings, concurrency=None, max_attempts=2, dead_letter=None, ordered=False, broker=None
    )
    assert given == {
        "concurrency": 3,
        "max_attempts": 2,
        "dead_letter": DEAD_LETTER_TEMPLATE,
        "ordered": False,
        "broker": None,
    }


class _Paid(Event, stream="billing", type_name="mistakes.Paid"):
    invoice: str


class _Placed(Event, stream="orders", type_name="mistakes.Placed"):
    order: str


def test_a_handler_typed_with_another_streams_event_is_refused_at_declaration(
    tmp_path: Path,
) -> None:
    # Subscribed to "orders" with a "billing" event: its messages never come on "orders",
    # and every "orders" message would be skipped as another type of the stream.
    outbox = Outbox(f"sqlite+aiosqlite:///{tmp_path}/s.db", brokers={"m": MemoryBroker()})

    async def on_paid(event: _Placed | _Paid) -> None:
        pass

    with pytest.raises(ConfigurationError) as caught:
        outbox.subscriber("orders", group="shipping")(on_paid)
    message = str(caught.value)
    assert "on_paid" in message and "_Paid" in message
    assert "'orders'" in message and "'billing'" in message
    assert "@outbox.subscriber('billing'" in message
    assert outbox.subscribers == []

    async def on_placed(event: _Placed) -> None:
        pass

    outbox.subscriber("orders", group="shipping")(on_placed)  # its own stream: accepted
    assert len(outbox.subscribers) == 1


def test_a_dead_letter_stream_may_be_typed_with_its_streams_events(tmp_path: Path) -> None:
    outbox = Outbox(f"sqlite+aiosqlite:///{tmp_path}/s.db", brokers={"m": MemoryBroker()})

    async def inspect_dead(event: _Placed) -> None:
        pass

    outbox.subscriber("orders.billing.dlq", group="inspect")(inspect_dead)
    assert len(outbox.subscribers) == 1
