"""What the composition root calls into ``consume/``: the ``@outbox.subscriber``
decorator (:func:`subscribe`) and ``outbox.unit_of_work()``, which joins the running
handler's transaction when called inside a subscriber's handler (:func:`unit_of_work`).
The outbox is seen as an :class:`OutboxSide`: a
:class:`~fastapi_outbox.consume.context.ConsumeContext` that is also a
:class:`~fastapi_outbox.write.context.WriteContext`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_outbox.consume import subscriber as subscribers
from fastapi_outbox.consume.context import ConsumeContext
from fastapi_outbox.consume.handlers import Handler
from fastapi_outbox.consume.processing import handler_transaction
from fastapi_outbox.write.context import WriteContext
from fastapi_outbox.write.unit_of_work import UnitOfWork, transaction

__all__ = ["OutboxSide", "subscribe", "unit_of_work"]


class OutboxSide(ConsumeContext, WriteContext, Protocol):
    """An outbox as both a subscriber and a unit of work see it."""


def subscribe(
    context: ConsumeContext, stream: str, group: str, **given: Any
) -> Callable[[Handler], Handler]:
    """The decorator of ``@outbox.subscriber(stream, group=…, **given)``: registers a
    :class:`~fastapi_outbox.consume.subscriber.Subscriber` of the handler (options left
    None from the settings) and gives the handler back unchanged."""

    def decorate(handler: Handler) -> Handler:
        options = subscribers.subscriber_options(context, **given)
        subscribers.register(context, handler, stream, group, options)
        return handler

    return decorate


@contextlib.asynccontextmanager
async def unit_of_work(
    context: OutboxSide,
    session: AsyncSession | None,
    *,
    correlation_id: str | None,
    causation_id: str | None,
    traceparent: str | None,
) -> AsyncIterator[UnitOfWork]:
    """The body of ``outbox.unit_of_work()``
    (:func:`fastapi_outbox.write.unit_of_work.transaction`); inside a subscriber's handler,
    without ``session``, it joins the handler's session (a savepoint of the handler's
    transaction, the handler's correlation and causation ids and traceparent unless
    given)."""
    if session is None:
        joined = handler_transaction(context)
        if joined is not None:
            session, handler_uow = joined
            correlation_id = correlation_id or handler_uow.correlation_id
            causation_id = causation_id or handler_uow.causation_id
            traceparent = traceparent or handler_uow.traceparent
    async with transaction(
        context,
        session,
        correlation_id=correlation_id,
        causation_id=causation_id,
        traceparent=traceparent,
    ) as uow:
        yield uow
