"""``MemoryConnection``: the in-process "server" a ``MemoryBroker``'s publisher and
consumers share — the message log (de-duplicated by envelope id, like the real brokers),
the consumer groups' state, whether it is reachable, and the event that wakes a waiting
reader when the log changes.

The publisher and the consumer each receive this object and never read each other. The
groups' state lives here, so a subscriber restarted in the same process carries on where
it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.events import Envelope

__all__ = ["MemoryConnection"]


class MemoryConnection:
    """The message log of one ``MemoryBroker``, as its publisher and consumers see it."""

    def __init__(self) -> None:
        #: Every envelope stored, in order (the index is the entry id).
        self.messages: list[Envelope] = []
        #: Envelopes stored again with an id already in the log (not added).
        self.duplicates = 0
        #: False: behaves like a broker that cannot be reached.
        self.available = True
        #: Consumer groups: (stream, group) → the consumer's state of that group.
        self.groups: dict[tuple[str, str], Any] = {}
        self._seen: set[str] = set()
        self._changed = anyio.Event()

    async def ping(self) -> None:
        """BrokerUnavailable while ``available`` is False."""
        if not self.available:
            raise exceptions.BrokerUnavailable("memory broker is marked unavailable")

    def store(self, envelopes: Sequence[Envelope]) -> None:
        """Append ``envelopes`` to the log (an id already there counts a duplicate and
        adds nothing) and wake the readers."""
        for envelope in envelopes:
            if envelope.id in self._seen:
                self.duplicates += 1
            else:
                self._seen.add(envelope.id)
                self.messages.append(envelope)
        self.changed()

    def on_stream(self, stream: str) -> list[Envelope]:
        """The envelopes of ``stream``, in order."""
        return [m for m in self.messages if m.stream == stream]

    def changed(self) -> None:
        """Wake everything waiting in `wait_changed`."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_changed(self) -> None:
        """Wait until the log changes (or a consumer gives deliveries back)."""
        await self._changed.wait()

    def clear(self) -> None:
        """Forget every message (the consumer groups keep their state)."""
        self.messages.clear()
        self._seen.clear()
        self.duplicates = 0
