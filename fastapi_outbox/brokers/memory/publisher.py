"""``MemoryBroker``: an in-process broker for tests and the embedded default.

It records what it receives in ``.messages`` (de-duplicated by envelope id, like the real
brokers) and lets tests stage failures: ``available = False`` behaves like a broker that
cannot be reached, ``reject`` refuses chosen messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.events import Envelope


class MemoryPublisher:
    """Records published envelopes; ``await broker.wait_for(n)`` waits for n of them."""

    def __init__(
        self,
        *,
        reject: Callable[[Envelope], BaseException | None] | None = None,
    ) -> None:
        self.messages: list[Envelope] = []
        self.duplicates = 0
        self.publish_calls = 0
        self.available = True
        self.reject = reject
        self._seen: set[str] = set()
        #: Consumer groups of ``consumer()``: (stream, group) → state (memory_consumer.py).
        self._consumer_groups: dict[tuple[str, str], Any] = {}
        self._changed = anyio.Event()

    def configure(self, *, dedup_window_seconds: float) -> None:
        pass

    async def connect(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def ping(self) -> None:
        if not self.available:
            raise exceptions.BrokerUnavailable("memory broker is marked unavailable")

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        self.publish_calls += 1
        await self.ping()
        results: PublishResults = []
        for envelope in batch:
            error = self.reject(envelope) if self.reject is not None else None
            if error is not None:
                results.append(error)
                continue
            if envelope.id in self._seen:
                self.duplicates += 1
            else:
                self._seen.add(envelope.id)
                self.messages.append(envelope)
            results.append(None)
        self._changed_now()
        return results

    def on_stream(self, stream: str) -> list[Envelope]:
        return [m for m in self.messages if m.stream == stream]

    async def wait_for(self, count: int, *, timeout: float = 10.0) -> list[Envelope]:
        """Return the messages once at least ``count`` arrived; TimeoutError after ``timeout``."""
        with anyio.fail_after(timeout):
            while len(self.messages) < count:
                await self._changed.wait()
        return list(self.messages)

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def clear(self) -> None:
        self.messages.clear()
        self._seen.clear()
        self.duplicates = 0

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
