"""The ``Broker`` protocol every transport implements.

``publish(batch)`` sends a batch and returns one result per envelope, in order: ``None``
when the broker stored the message, or the exception that refused it (retried on its own
with backoff). When the broker as a whole cannot be reached it raises
[`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable] instead, and the relay gives
the whole batch back without burning attempts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from fastapi_outbox.events import Envelope
from fastapi_outbox.redaction import redact_url

__all__ = ["Broker", "PublishResults", "redact_url"]

PublishResults = list[BaseException | None]


@runtime_checkable
class Broker(Protocol):
    """A message broker the relay publishes to."""

    async def connect(self) -> None:
        """Open connections; idempotent. Raises BrokerUnavailable when unreachable."""

    async def aclose(self) -> None:
        """Close connections; idempotent."""

    async def ping(self) -> None:
        """Raise BrokerUnavailable when the broker cannot be reached."""

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        """Publish ``batch``; one result per envelope, in order."""

    def configure(self, *, dedup_window_seconds: float) -> None:
        """Receive outbox-wide settings before ``connect`` (de-duplication window)."""
