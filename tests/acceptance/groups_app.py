"""The simplest app, for the acceptance test of groups declared before the first publish:
one process, one Outbox on a Redis or NATS broker, one ``@outbox.subscriber`` with default
options (``start="new"``), run as ``fastapi-outbox dispatch --app
tests.acceptance.groups_app:outbox``. Its own relay publishes what the test commits
to the outbox table; each message's effect is one row of ``effects`` (no unique
constraint: a double effect would show as two rows).

Environment: ``DATABASE_URL``, ``BROKER_URL``, ``GROUPS_STREAM``.
"""

from __future__ import annotations

import os

from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Message, Outbox, UnitOfWork
from fastapi_outbox.brokers import broker_from_url

STREAM = os.environ.get("GROUPS_STREAM", "orders")


class Base(DeclarativeBase):
    pass


class Effect(Base):
    __tablename__ = "effects"

    id: Mapped[int] = mapped_column(primary_key=True)
    n: Mapped[int]


outbox = Outbox(
    os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///./groups.db"),
    brokers={"default": broker_from_url(os.environ.get("BROKER_URL", "memory://"))},
)


@outbox.subscriber(STREAM, group="fulfilment")
async def fulfil(message: Message, uow: UnitOfWork) -> None:
    uow.session.add(Effect(n=int(message.payload["n"])))
