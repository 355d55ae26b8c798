"""Subscriber options: the defaults the settings give and the checks of what a decorator asks.

``@outbox.subscriber(stream, group=…, …)`` options left None take the ``consumer_*``
settings (`subscriber_options`); `check_options` refuses, before anything runs,
what cannot work, with a [`ConfigurationError`][fastapi_outbox.ConfigurationError] naming the
handler and the option. Pure: no I/O, unit-tested on its own.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.settings import OutboxSettings

__all__ = [
    "DEAD_LETTER_TEMPLATE",
    "check_batch_handler",
    "check_options",
    "check_streams",
    "describe",
    "subscriber_options",
]

#: Default dead-letter stream / subject of a (stream, group).
DEAD_LETTER_TEMPLATE = "{stream}.{group}.dlq"
#: A consumer group's name: what every broker accepts as a group / durable name.
_GROUP = re.compile(r"^[A-Za-z0-9_\-]{1,200}$")


def subscriber_options(settings: OutboxSettings, **given: Any) -> dict[str, Any]:
    """Decorator options with the settings' defaults filled in."""
    s = settings
    defaults = {
        "concurrency": s.consumer_concurrency,
        "max_attempts": s.consumer_max_attempts,
        "batch_size": s.consumer_batch_size,
        "claim_idle_seconds": s.consumer_claim_idle_seconds,
        "retry_base_delay_seconds": s.consumer_retry_base_delay_seconds,
        "retry_max_delay_seconds": s.consumer_retry_max_delay_seconds,
        "dead_letter": DEAD_LETTER_TEMPLATE,
    }
    return {
        k: (defaults[k] if given.get(k) is None and k in defaults else v) for k, v in given.items()
    }


def describe(handler: Any) -> str:
    """How errors name a subscriber: ``subscriber 'module_qualname'``."""
    return f"subscriber {getattr(handler, '__qualname__', handler)!r}"


def check_options(
    handler: Any,
    *,
    stream: Any,
    group: Any,
    concurrency: Any,
    max_attempts: Any,
    batch_size: Any,
    start: Any,
    claim_idle_seconds: float,
    retry_max_delay_seconds: float,
) -> None:
    """Refuse a subscriber that cannot work, naming the handler and the option."""
    where = describe(handler)
    if not inspect.iscoroutinefunction(handler):
        raise exceptions.ConfigurationError(f"{where}: the handler must be an async def")
    if not isinstance(stream, str) or not stream.strip() or any(c.isspace() for c in stream):
        raise exceptions.ConfigurationError(f"{where}: invalid stream {stream!r}")
    if not isinstance(group, str) or not _GROUP.match(group):
        raise exceptions.ConfigurationError(
            f"{where}: group {group!r} must be 1-200 letters, digits, '_' or '-'"
        )
    for name, value, low in (
        ("concurrency", concurrency, 1),
        ("max_attempts", max_attempts, 1),
        ("batch_size", batch_size, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise exceptions.ConfigurationError(f"{where}: {name} must be >= {low}")
    if start not in ("new", "all"):
        raise exceptions.ConfigurationError(
            f"{where}: start must be 'new' (messages added from now on) or 'all' "
            f"(from the beginning of the stream), not {start!r}"
        )
    if retry_max_delay_seconds >= claim_idle_seconds:
        raise exceptions.ConfigurationError(
            f"{where}: retry_max_delay_seconds ({retry_max_delay_seconds:g}) must be below "
            f"claim_idle_seconds ({claim_idle_seconds:g})"
        )


def check_batch_handler(handler: Any, *, batch_handler: bool, ordered: bool, batch: bool) -> None:
    """A batch handler takes whole batches in one transaction: not with ``ordered=True``
    (one message per key at a time) nor ``batch=False`` (one transaction per message)."""
    if batch_handler and (ordered or not batch):
        raise exceptions.ConfigurationError(
            f"{describe(handler)}: a batch handler (first parameter a list) takes whole "
            "batches in one transaction: not with ordered=True or batch=False"
        )


def check_streams(handler: Any, *, stream: str, accepts: tuple[type[Any], ...] | None) -> None:
    """Refuse a handler typed with an ``Event`` of another stream: its messages never come
    on this subscriber's stream, and the stream's own types would be skipped as "not for
    this handler" — a subscriber that silently does nothing."""
    for cls in accepts or ():
        declared = getattr(cls, "__outbox_stream__", None)
        # A dead-letter stream of the event's stream (``orders.billing.dlq``) carries it too,
        # and so does the stream of a subclass (``class EuOrder(Order, stream="orders-eu")``).
        dead_letters = stream.startswith(f"{declared}.") and stream.endswith(".dlq")
        if declared is None or dead_letters or stream in _streams_of(cls):
            continue
        raise exceptions.ConfigurationError(
            f"{describe(handler)} subscribes to stream {stream!r} but its first parameter "
            f"takes {cls.__qualname__} (type {cls.__outbox_type__!r}), an event of stream "
            f"{declared!r}: subscribe to {declared!r} "
            f"(@outbox.subscriber({declared!r}, ...)), or annotate the handler with "
            f"events of {stream!r} (or Message)"
        )


def _streams_of(cls: type[Any]) -> set[str]:
    """The streams ``cls`` and its subclasses declared so far."""
    streams: set[str] = set()
    todo = [cls]
    while todo:
        current = todo.pop()
        todo.extend(current.__subclasses__())
        declared = getattr(current, "__outbox_stream__", None)
        if declared is not None:
            streams.add(declared)
    return streams
