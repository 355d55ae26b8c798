"""What the composition root calls into ``consume/``: the ``@outbox.subscriber``
decorator (`subscribe`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi_outbox.consume import subscriber as subscribers
from fastapi_outbox.consume.context import ConsumeContext
from fastapi_outbox.consume.handlers import Handler

__all__ = ["HandlerT", "subscribe"]

#: The decorated handler, given back as it came.
HandlerT = TypeVar("HandlerT", bound=Handler)


def subscribe(
    context: ConsumeContext, stream: str, group: str, **given: Any
) -> Callable[[HandlerT], HandlerT]:
    """The decorator of ``@outbox.subscriber(stream, group=…, **given)``: registers a
    `Subscriber` of the handler (options left
    None from the settings) and gives the handler back unchanged."""

    def decorate(handler: HandlerT) -> HandlerT:
        options = subscribers.subscriber_options(context, **given)
        subscribers.register(context, handler, stream, group, options)
        return handler

    return decorate
