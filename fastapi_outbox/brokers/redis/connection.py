"""What a Redis consumer uses of the broker's connection (the publisher provides it).

``RedisStreamsBroker`` is a publisher that also makes consumers; the consumer sees only
this protocol, so the publisher and the consumer never import each other. The private
members are the broker's own today; a connection object of their own replaces them later
(issue 18, phase 2).
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi_outbox import exceptions

__all__ = ["RedisConnection"]


class RedisConnection(Protocol):
    """The Redis client a consumer shares with its broker, and the broker's options."""

    url: str
    dead_letter_maxlen: int | None
    _socket_timeout: float

    @property
    def client(self) -> Any: ...

    async def connect(self) -> None: ...

    def _unavailable(self, exc: BaseException) -> exceptions.BrokerUnavailable: ...

    def _stream_key(self, stream: str) -> str: ...
