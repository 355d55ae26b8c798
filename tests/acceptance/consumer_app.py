"""A consumer service for the SIGKILL acceptance test, run as
``fastapi-outbox dispatch --app tests.acceptance.consumer_app:outbox``.

Environment: ``DATABASE_URL``, ``BROKER_URL``, ``CONSUMER_STREAM``; chaos: ``KILL_DIR`` (one
marker file per kill already done, so each kill happens once) and ``KILL_BEFORE_COMMIT`` /
``KILL_AFTER_COMMIT`` (comma-separated ``n`` of messages on which the process SIGKILLs
itself: inside the handler after its effect is flushed, or after the commit but before the
broker ack). Each message's effect is one row of ``effects`` (no unique constraint: a
double effect would show as two rows).

Versions and holds (``tests/acceptance/test_lifecycle.py``): ``CONSUMER_TYPES`` the types
the handler takes (``Tick``, default, or ``Tick,Tock``: a second code version that added
``Tock``; the first does not declare it); ``CONSUMER_CONCURRENCY`` / ``CONSUMER_BATCH_SIZE``
/ ``CONSUMER_BATCH`` (``0``: one transaction per message) the subscriber's options;
``HOLD_DIR``: every handler run writes ``<message id>.<pid>`` there and never returns (the
message is in a handler when the process is killed).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Event, Outbox, UnitOfWork
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.brokers.consumer import Delivery

STREAM = os.environ.get("CONSUMER_STREAM", "ticks")
KILL_DIR = Path(os.environ.get("KILL_DIR", "."))


def _numbers(name: str) -> set[int]:
    return {int(n) for n in os.environ.get(name, "").split(",") if n.strip()}


KILL_BEFORE_COMMIT = _numbers("KILL_BEFORE_COMMIT")
KILL_AFTER_COMMIT = _numbers("KILL_AFTER_COMMIT")
TYPES = set(os.environ.get("CONSUMER_TYPES", "Tick").split(","))
HOLD_DIR = os.environ.get("HOLD_DIR")
BATCH_SIZE = os.environ.get("CONSUMER_BATCH_SIZE")


class Base(DeclarativeBase):
    pass


class Effect(Base):
    __tablename__ = "effects"

    id: Mapped[int] = mapped_column(primary_key=True)
    n: Mapped[int]
    message_id: Mapped[str] = mapped_column(String(64))


class Tick(Event, stream=STREAM):
    n: int


takes: Any = Tick
if "Tock" in TYPES:

    class Tock(Event, stream=STREAM):
        n: int

    takes = Tick | Tock


def kill_once(when: str, n: int) -> None:
    marker = KILL_DIR / f"{when}-{n}"
    if marker.exists():
        return
    marker.touch()
    os.kill(os.getpid(), signal.SIGKILL)


broker = broker_from_url(os.environ.get("BROKER_URL", "memory://"))
outbox = Outbox(
    os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///./consumer.db"),
    brokers={"default": broker},
)


async def apply(tick: Any, uow: UnitOfWork) -> None:
    if HOLD_DIR:
        (Path(HOLD_DIR) / f"{uow.causation_id}.{os.getpid()}").touch()
        await asyncio.Event().wait()
    uow.session.add(Effect(n=tick.n, message_id=uow.causation_id or ""))
    if tick.n in KILL_BEFORE_COMMIT:
        await uow.session.flush()  # the effect is written, not committed
        kill_once("before", tick.n)


apply.__annotations__["tick"] = takes
outbox.subscriber(
    STREAM,
    group="effects",
    start="all",
    concurrency=int(os.environ.get("CONSUMER_CONCURRENCY", "16")),
    batch_size=int(BATCH_SIZE) if BATCH_SIZE else None,
    batch=os.environ.get("CONSUMER_BATCH", "1") == "1",
)(apply)


def _kill_between_commit_and_ack(consumer_class: type) -> None:
    """Wrap ``ack`` and ``ack_soon`` (the batch path's): SIGKILL before the ack is sent."""

    def wrap(real: Any) -> Any:
        async def ack(self: object, deliveries: Sequence[Delivery]) -> None:
            for d in deliveries:
                n = json.loads(d.payload).get("n")
                if n in KILL_AFTER_COMMIT:
                    kill_once("after", n)
            await real(self, deliveries)

        return ack

    consumer_class.ack = wrap(consumer_class.ack)
    consumer_class.ack_soon = wrap(consumer_class.ack_soon)


if KILL_AFTER_COMMIT:
    consumer = broker.consumer(outbox.subscribers[0].consumer_config())  # type: ignore[attr-defined]
    _kill_between_commit_and_ack(type(consumer))
