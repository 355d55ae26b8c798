"""``MemoryBroker``'s publisher: stores what it receives in its ``MemoryConnection``.

``.messages`` holds what it received (de-duplicated by envelope id, like the real brokers)
and tests stage failures: ``available = False`` behaves like a broker that cannot be
reached, ``reject`` refuses chosen messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Self

import anyio

from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions, to_envelope
from fastapi_outbox.brokers.memory.connection import MemoryConnection
from fastapi_outbox.events import Envelope


class MemoryPublisher:
    """Records published envelopes; ``await broker.wait_for(n)`` waits for n of them."""

    def __init__(
        self,
        connection: MemoryConnection,
        *,
        reject: Callable[[Envelope], BaseException | None] | None = None,
        envelope_format: CloudEventsOptions | None = None,
    ) -> None:
        self.connection = connection
        #: The envelope on the wire: native, or CloudEvents (binary or structured).
        self.envelope_format = envelope_format or CloudEventsOptions()
        self.publish_calls = 0
        self.reject = reject

    @property
    def messages(self) -> list[Envelope]:
        return self.connection.messages

    @property
    def duplicates(self) -> int:
        return self.connection.duplicates

    @property
    def available(self) -> bool:
        return self.connection.available

    @available.setter
    def available(self, value: bool) -> None:
        self.connection.available = value

    def configure(self, *, dedup_window_seconds: float) -> None:
        pass

    async def connect(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def ping(self) -> None:
        await self.connection.ping()

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        self.publish_calls += 1
        await self.connection.ping()
        results: PublishResults = []
        accepted: list[Envelope] = []
        for envelope in batch:
            error = self.reject(envelope) if self.reject is not None else None
            results.append(error)
            if error is None:
                accepted.append(to_envelope(envelope, self.envelope_format))
        self.connection.store(accepted)
        return results

    def on_stream(self, stream: str) -> list[Envelope]:
        return self.connection.on_stream(stream)

    async def wait_for(self, count: int, *, timeout: float = 10.0) -> list[Envelope]:
        """Return the messages once at least ``count`` arrived; TimeoutError after ``timeout``."""
        with anyio.fail_after(timeout):
            while len(self.messages) < count:
                await self.connection.wait_changed()
        return list(self.messages)

    def clear(self) -> None:
        self.connection.clear()

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
