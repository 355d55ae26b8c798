from __future__ import annotations

import itertools
import uuid

import pytest

from fastapi_outbox import Event, EventDefinitionError, Message, uuid7


def test_event_without_stream_is_refused_at_definition() -> None:
    with pytest.raises(EventDefinitionError, match="stream"):

        class NoStream(Event):
            x: int


def test_event_key_must_name_a_field() -> None:
    with pytest.raises(EventDefinitionError, match="order_id"):

        class BadKey(Event, stream="orders", key="order_id"):
            id: int


def test_abstract_base_and_inherited_stream() -> None:
    class Base(Event, abstract=True):
        pass

    class OrderEvent(Base, stream="orders", key="order_id"):
        order_id: int

    class OrderShipped(OrderEvent):
        carrier: str

    message = OrderShipped(order_id=7, carrier="ups").to_message()
    assert message.stream == "orders"
    assert message.type == "OrderShipped"
    assert message.key == "7"
    assert message.payload == {"order_id": 7, "carrier": "ups"}
    assert isinstance(message, Message)


def test_uuid7_is_version_7_and_strictly_increasing() -> None:
    ids = [uuid7() for _ in range(5000)]
    assert all(i.version == 7 for i in ids)
    assert all(a < b for a, b in itertools.pairwise(ids))
    assert len({i for i in ids}) == len(ids)
    assert isinstance(ids[0], uuid.UUID)
