"""Handler inspection and decoding: what a handler's signature says it takes, and the
message a delivery becomes for it (or why not)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.consume.handlers import (
    BatchUnitOfWork,
    Decoder,
    NotForHandler,
    Undeliverable,
    UnknownType,
    delivery_context,
    inspect_handler,
)
from fastapi_outbox.events import HEADER_CORRELATION_ID, HEADER_TRACEPARENT, Event, Message
from fastapi_outbox.exceptions import ConfigurationError
from fastapi_outbox.write.unit_of_work import UnitOfWork


class Placed(Event, stream="unit-consume-orders", type_name="UnitConsumePlaced"):
    order_id: int


class Shipped(Event, stream="unit-consume-orders", type_name="UnitConsumeShipped"):
    order_id: int


class Returned(Event, stream="unit-consume-orders", type_name="UnitConsumeReturned"):
    order_id: int


def delivery(type_: str, payload: Any, *, message_id: str = "m1", **more: Any) -> Delivery:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return Delivery(
        stream="unit-consume-orders",
        entry_id="1-0",
        message_id=message_id,
        type=type_,
        key=None,
        payload=raw,
        attempt=1,
        **more,
    )


# -- inspection -------------------------------------------------------------------------------


def test_an_event_handler_with_its_unit_of_work() -> None:
    async def handler(event: Placed, uow: UnitOfWork, extra: int = 0) -> None:
        pass

    sig = inspect_handler(handler, "subscriber 'h'")
    assert (sig.message_param, sig.accepts, sig.uow_params, sig.batch) == (
        "event",
        (Placed,),
        ["uow"],
        False,
    )


def test_a_union_and_a_message_handler() -> None:
    async def either(event: Placed | Shipped) -> None:
        pass

    async def anything(message: Message, a: UnitOfWork, b: UnitOfWork) -> None:
        pass

    assert inspect_handler(either, "w").accepts == (Placed, Shipped)
    sig = inspect_handler(anything, "w")
    assert sig.accepts is None
    assert sig.uow_params == ["a", "b"]


def test_a_batch_handler_takes_a_list_or_a_sequence() -> None:
    async def as_list(events: list[Placed], uow: BatchUnitOfWork) -> None:
        pass

    async def as_sequence(events: Sequence[Placed | Shipped], uow: UnitOfWork) -> None:
        pass

    assert inspect_handler(as_list, "w").batch
    assert inspect_handler(as_list, "w").uow_params == ["uow"]
    sig = inspect_handler(as_sequence, "w")
    assert (sig.batch, sig.accepts, sig.uow_params) == (True, (Placed, Shipped), ["uow"])


async def no_parameter() -> None:
    pass


async def unannotated(event) -> None:  # type: ignore[no-untyped-def]
    pass


async def not_an_event(event: int) -> None:
    pass


async def list_of_ints(events: list[int]) -> None:
    pass


async def an_extra_parameter(event: Placed, db: Any) -> None:
    pass


async def batch_uow_on_one_message(event: Placed, uow: BatchUnitOfWork) -> None:
    pass


async def unresolvable(event: NoSuchEvent) -> None:  # type: ignore[name-defined]  # noqa: F821
    pass


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (no_parameter, "the handler takes no parameter"),
        (unannotated, "annotate the first parameter 'event'"),
        (not_an_event, "the first parameter 'event' must be annotated with an Event subclass"),
        (list_of_ints, "must be annotated with an Event subclass, a union of them or Message"),
        (an_extra_parameter, r"parameters \['db'\] have no default and are not annotated"),
        (batch_uow_on_one_message, r"parameters \['uow'\] have no default"),
        (unresolvable, "cannot resolve the handler's annotations"),
    ],
)
def test_a_handler_that_cannot_take_messages_is_refused_by_name(handler: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        inspect_handler(handler, "subscriber 'billing'")
    assert str(caught.value).startswith("subscriber 'billing': ")


# -- decoding ---------------------------------------------------------------------------------


def test_an_accepted_type_is_validated_into_its_class() -> None:
    decoder = Decoder((Placed, Shipped), "app.bill")
    assert decoder.decode(delivery("UnitConsumeShipped", {"order_id": 4})) == Shipped(order_id=4)


def test_an_invalid_payload_is_undeliverable_with_the_field() -> None:
    decoder = Decoder((Placed,), "app.bill")
    with pytest.raises(Undeliverable, match="message m1 on 'unit-consume-orders' is not a valid"):
        decoder.decode(delivery("UnitConsumePlaced", {"order_id": "x"}))
    with pytest.raises(Undeliverable, match="order_id: "):
        decoder.decode(delivery("UnitConsumePlaced", {}))


def test_another_declared_type_is_not_for_the_handler() -> None:
    with pytest.raises(NotForHandler):
        Decoder((Placed,), "app.bill").decode(delivery("UnitConsumeReturned", {"order_id": 1}))


def test_an_unknown_type_is_told_naming_the_handler() -> None:
    decoder = Decoder((Placed, Shipped), "app.bill")
    with pytest.raises(UnknownType) as caught:
        decoder.decode(delivery("UnitConsumeNobody", {"order_id": 1}))
    assert str(caught.value) == (
        "unknown event type 'UnitConsumeNobody' of message m1 on stream 'unit-consume-orders': "
        "no Event subclass declares it (handler app.bill takes UnitConsumePlaced, "
        "UnitConsumeShipped)"
    )


def test_a_type_declared_after_the_first_look_is_found() -> None:
    decoder = Decoder((Placed,), "app.bill")
    with pytest.raises(UnknownType):
        decoder.decode(delivery("UnitConsumeLate", {"order_id": 1}))

    class Late(Event, stream="unit-consume-orders", type_name="UnitConsumeLate"):
        order_id: int

    with pytest.raises(NotForHandler):
        decoder.decode(delivery("UnitConsumeLate", {"order_id": 1}))


def test_a_message_handler_gets_the_parsed_payload() -> None:
    decoder = Decoder(None, "app.log")
    got = decoder.decode(delivery("Anything", {"a": 1}, headers={"h": "v"}))
    assert got == Message(
        stream="unit-consume-orders",
        type="Anything",
        payload={"a": 1},
        key=None,
        headers={"h": "v"},
    )
    assert decoder.decode(delivery("Anything", [1, 2])).payload == {"value": [1, 2]}
    assert decoder.decode(delivery("Anything", b"")).payload == {}
    with pytest.raises(Undeliverable, match="payload is not JSON"):
        decoder.decode(delivery("Anything", b"{nope"))


def test_the_context_a_delivery_gives_its_unit_of_work() -> None:
    good = delivery(
        "T",
        {},
        message_id="0190f0e4-6a0e-7cc0-8000-000000000001",
        headers={HEADER_CORRELATION_ID: "corr-1", HEADER_TRACEPARENT: "00-abc-def-01"},
    )
    assert delivery_context(good) == (
        "corr-1",
        "0190f0e4-6a0e-7cc0-8000-000000000001",
        "00-abc-def-01",
    )
    bad = delivery("T", {}, message_id="not valid", headers={HEADER_CORRELATION_ID: "a b"})
    assert delivery_context(bad) == (None, None, None)
