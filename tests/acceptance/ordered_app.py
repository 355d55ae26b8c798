"""An ordered consumer for the replicas acceptance test, run as
``fastapi-outbox dispatch --app tests.acceptance.ordered_app:outbox`` (three at once).

Environment: ``DATABASE_URL``, ``BROKER_URL``, ``CONSUMER_STREAM``, ``CONSUMER_GROUP``;
``CONSUMER_MODE``: ``ordered`` (default), ``ordered-message`` (ordered, ``batch=False``: a
transaction per message), or for ``benchmarks/ordered_consume.py``'s references an
unordered subscriber, ``batch`` (a transaction per fetched batch, the default) or
``message`` (``batch=False``).
Each message is one ``Step(key, step)``; the handler records it as a row of ``steps``
(``id`` serial: the order the handlers' transactions wrote them in) in the handler's
transaction, so a step handled twice or out of order shows in the table.
"""

from __future__ import annotations

import os

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Event, Outbox, UnitOfWork
from fastapi_outbox.brokers import broker_from_url

STREAM = os.environ.get("CONSUMER_STREAM", "steps")
GROUP = os.environ.get("CONSUMER_GROUP", "ordered")
MODE = os.environ.get("CONSUMER_MODE", "ordered")


class Base(DeclarativeBase):
    pass


class StepRow(Base):
    __tablename__ = "steps"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(64))
    step: Mapped[int]
    member: Mapped[str] = mapped_column(String(64))


class Step(Event, stream=STREAM):
    key: str
    step: int


broker = broker_from_url(os.environ.get("BROKER_URL", "memory://"))
outbox = Outbox(
    os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///./ordered.db"),
    brokers={"default": broker},
)


@outbox.subscriber(
    STREAM,
    group=GROUP,
    start="all",
    ordered=MODE.startswith("ordered"),
    batch=not MODE.endswith("message"),
)
async def record(step: Step, uow: UnitOfWork) -> None:
    uow.session.add(StepRow(key=step.key, step=step.step, member=str(os.getpid())))
