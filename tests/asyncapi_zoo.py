"""A "zoo" of events: every kind of schema pydantic makes (discriminated and plain unions,
recursive models, enums, optional and nullable fields, bytes, dates and times, constrained
types, tuples, sets, mappings, literals), for the AsyncAPI document's checks."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, conint, conlist

from fastapi_outbox import Event, Message, UnitOfWork


class Colour(enum.StrEnum):
    RED = "red"
    GREEN = "green"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Cat(BaseModel):
    kind: Literal["cat"] = "cat"
    lives: int = 9


class Dog(BaseModel):
    kind: Literal["dog"] = "dog"
    good: bool = True


class Node(BaseModel):
    """A tree: a recursive model."""

    name: str
    children: list[Node] = []


Sku = Annotated[str, StringConstraints(min_length=3, max_length=12, pattern=r"^[A-Z0-9-]+$")]


class Everything(Event, stream="zoo.everything", key="id"):
    """Every schema pydantic makes, in one event."""

    id: uuid.UUID
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    pets: list[Annotated[Cat | Dog, Field(discriminator="kind")]] = []
    amount: int | float | str
    colour: Colour
    priority: Priority = Priority.LOW
    tree: Node
    note: str | None = None
    required_nullable: int | None
    blob: bytes
    on: dt.date
    at: dt.datetime
    alarm: dt.time | None = None
    lasting: dt.timedelta = dt.timedelta(0)
    price: Annotated[decimal.Decimal, Field(max_digits=8, decimal_places=2)]
    count: conint(ge=0, lt=1000)  # type: ignore[valid-type]
    sku: Sku
    tags: conlist(str, min_length=1, max_length=5)  # type: ignore[valid-type]
    labels: set[str] = set()
    pair: tuple[int, str] = (0, "")
    counts: dict[str, int] = {}
    mode: Literal["a", "b"] = "a"
    ratio: Annotated[float, Field(gt=0, le=1, multiple_of=0.25)] = 0.5


class Thread(Event, stream="zoo.threads"):
    """A recursive event: a thread holds its replies."""

    text: str
    replies: list[Thread] = []


class Ping(Event, stream="zoo.everything", external=True, type_name="ping/v1"):
    """An external event: also sent to the external brokers, without internal headers."""

    at: dt.datetime


def subscribe(outbox: object) -> None:
    """The zoo's subscribers on ``outbox``: a union handler, a batch one and a raw one."""

    @outbox.subscriber("zoo.everything", group="auditors")  # type: ignore[attr-defined]
    async def audit(event: Everything | Ping, uow: UnitOfWork) -> None:
        """Audit every animal."""

    @outbox.subscriber("zoo.threads", group="archive")  # type: ignore[attr-defined]
    async def archive(events: list[Thread], uow: UnitOfWork) -> None: ...

    @outbox.subscriber("zoo.everything", group="raw")  # type: ignore[attr-defined]
    async def raw(message: Message) -> None: ...
