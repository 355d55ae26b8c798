"""Text no database can commit (NUL, unpaired surrogates) is refused at ``publish()``, with
an :class:`UnstorableText` naming the field, and nothing is queued."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Integer
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import AggregateRoot, Event, Message, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.exceptions import PublishError, UnstorableText

NUL, SURROGATE = "\x00", "\ud800"


class OrderPlaced(Event, stream="orders", key="ref"):
    ref: str
    items: list[dict[str, Any]]


class Base(DeclarativeBase):
    pass


class Order(Base, AggregateRoot):
    """Raises events outside any session: they wait on the instance."""

    __tablename__ = "unstorable_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)


@pytest.fixture
def uow() -> UnitOfWork:
    outbox = Outbox(
        "sqlite+aiosqlite://", brokers={"default": MemoryBroker()}, settings=OutboxSettings()
    )
    return UnitOfWork(outbox._producer, outbox.session_factory())


def message(payload: dict[str, Any], **kw: Any) -> Message:
    return Message(kw.pop("stream", "orders"), kw.pop("type", "OrderPlaced"), payload, **kw)


def items(bad: str) -> list[dict[str, Any]]:
    return [{"name": "a"}, {"name": "b"}, {"name": f"c{bad}d"}]


CASES: dict[str, tuple[Any, dict[str, Any], str]] = {}
for label, bad in (("NUL", NUL), ("surrogate", SURROGATE)):
    CASES |= {
        f"{label} in a nested Message value": (
            message({"items": items(bad)}),
            {},
            "payload.items[2].name",
        ),
        f"{label} in a nested Event value": (
            OrderPlaced(ref="r1", items=items(bad)),
            {},
            "payload.items[2].name",
        ),
        f"{label} in a payload key": (
            message({"items": [{f"na{bad}me": 1}]}),
            {},
            "of payload.items[0]",
        ),
        f"{label} in an Event payload key": (
            OrderPlaced(ref="r1", items=[{"ok": 1}, {f"k{bad}": 2}]),
            {},
            "of payload.items[1]",
        ),
        f"{label} under a key that is no identifier": (
            message({"x-y": {"z": f"{bad}"}}),
            {},
            "payload['x-y'].z",
        ),
        f"{label} in a header value": (
            message({"n": 1}),
            {"headers": {"x-tenant": f"acme{bad}"}},
            "headers['x-tenant']",
        ),
        f"{label} in a Message header value": (
            message({"n": 1}, headers={"x-tenant": f"acme{bad}"}),
            {},
            "headers['x-tenant']",
        ),
        f"{label} in a header name": (
            message({"n": 1}),
            {"headers": {f"x-{bad}": "v"}},
            "the name of header",
        ),
        f"{label} in the key keyword": (message({"n": 1}), {"key": f"k{bad}"}, "key"),
        f"{label} in an Event's key field": (
            OrderPlaced(ref=f"r{bad}", items=[]),
            {},
            "payload.ref",  # the key field is part of the payload: named there
        ),
        f"{label} in the stream": (message({"n": 1}, stream=f"orders{bad}"), {}, "stream"),
        f"{label} in the type": (message({"n": 1}, type=f"Placed{bad}"), {}, "type"),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_unstorable_text_is_refused_at_publish_naming_the_field(uow: UnitOfWork, case: str) -> None:
    event, kwargs, field = CASES[case]
    uow.publish(message({"n": 0}))
    with pytest.raises(UnstorableText) as info:
        uow.publish(event, **kwargs)
    assert isinstance(info.value, PublishError)
    assert field in info.value.field, info.value.field
    assert info.value.field in str(info.value)
    assert ("NUL" if "NUL" in case else "unpaired surrogate") in str(info.value)
    assert uow.pending == 1  # the good one only: the refused event queued nothing


@pytest.mark.parametrize(
    "text",
    [
        "a\\u0000b",  # a backslash, then `u0000`: escaped in JSON, nothing to refuse
        "emoji \U0001f600 and Zoë",  # astral characters (surrogate *pairs* in JSON)
        "control \x01\x1f characters",
    ],
)
def test_storable_look_alikes_pass(uow: UnitOfWork, text: str) -> None:
    uow.publish(message({text: text, "list": [text]}, key=text, headers={"x-t": text}))
    uow.publish(OrderPlaced(ref=text, items=[{text: text}]))
    assert uow.pending == 2


@pytest.mark.parametrize("bad", [NUL, SURROGATE])
def test_an_aggregate_refuses_the_event_when_it_is_raised(bad: str) -> None:
    order = Order()
    with pytest.raises(UnstorableText) as info:
        order.raise_event(OrderPlaced(ref="r", items=items(bad)))
    assert info.value.field == "payload.items[2].name"
    assert order.pending_events == ()
