"""What a memory consumer uses of its broker (the publisher provides it): the list of
messages it holds and the event that says it changed.

``MemoryBroker`` is a publisher that also makes consumers; the consumer sees only this
protocol, so the publisher and the consumer never import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import anyio

from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.events import Envelope

__all__ = ["MemoryConnection"]


class MemoryConnection(Protocol):
    """The in-process store of a ``MemoryBroker``, as its consumers read and write it."""

    messages: list[Envelope]
    _consumer_groups: dict[tuple[str, str], Any]
    _changed: anyio.Event

    async def ping(self) -> None: ...

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults: ...

    def on_stream(self, stream: str) -> list[Envelope]: ...

    def _changed_now(self) -> None: ...
