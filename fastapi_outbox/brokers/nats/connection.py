"""What a JetStream consumer uses of the broker's connection (the publisher provides it).

``NatsJetStreamBroker`` is a publisher that also makes consumers; the consumer sees only
this protocol, so the publisher and the consumer never import each other. The private
members are the broker's own today; a connection object of their own replaces them later
(issue 18, phase 2).
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi_outbox import exceptions

__all__ = ["NatsConnection"]


class NatsConnection(Protocol):
    """The NATS client and JetStream context a consumer shares with its broker."""

    url: str
    _nc: Any
    _js: Any
    _raw: tuple[Any, Any] | None

    async def connect(self) -> None: ...

    async def ensure_stream(self, subject: str, *, dead_letter: bool = False) -> None: ...

    def _unavailable(self, exc: BaseException | str) -> exceptions.BrokerUnavailable: ...
