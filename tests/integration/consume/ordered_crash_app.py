"""An ordered consumer whose handler kills its process on one message, for
``test_ordered_crash_loop.py``: ``fastapi-outbox dispatch --app
tests.integration.consume.ordered_crash_app:outbox``.

Environment: ``DATABASE_URL``, ``BROKER_URL``, ``CONSUMER_STREAM``, ``CONSUMER_GROUP``,
``POISON`` (the ``n`` of the message whose handler calls ``os._exit(1)``, every time),
``CONSUMER_BATCH`` (``0``: ``batch=False``).
Each other message ``Step(key, n)`` becomes a row of ``crash_steps`` (``id`` serial: the
order the handlers' transactions wrote them in) in the handler's transaction.
"""

from __future__ import annotations

import os

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Event, Outbox, UnitOfWork
from fastapi_outbox.brokers import broker_from_url

STREAM = os.environ.get("CONSUMER_STREAM", "crash_steps")
GROUP = os.environ.get("CONSUMER_GROUP", "ordered")
POISON = int(os.environ.get("POISON", "-1"))
BATCH = os.environ.get("CONSUMER_BATCH", "1") != "0"


class Base(DeclarativeBase):
    pass


class StepRow(Base):
    __tablename__ = "crash_steps"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(64))
    n: Mapped[int]


class Step(Event, stream=STREAM):
    key: str
    n: int


outbox = Outbox(
    os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///./ordered_crash.db"),
    brokers={"default": broker_from_url(os.environ.get("BROKER_URL", "memory://"))},
)


@outbox.subscriber(STREAM, group=GROUP, start="all", ordered=True, batch=BATCH)
async def record(step: Step, uow: UnitOfWork) -> None:
    if step.n == POISON:
        os._exit(1)  # the process dies inside the handler (an OOM kill, a segfault)
    uow.session.add(StepRow(key=step.key, n=step.n))
