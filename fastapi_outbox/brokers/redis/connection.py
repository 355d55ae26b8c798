"""``RedisConnection``: the ``redis.asyncio`` client a Redis publisher and its consumers
share, and what both need to know of the server.

It owns the client (made from the URL on ``connect``, or the caller's, which it never
closes), the server's version (read once per connection), the stream key prefix and the
translation of a client failure into
:class:`~fastapi_outbox.exceptions.BrokerUnavailable` / ``BrokerTimeout``. The publisher
and the consumer each receive this object and never read each other (faststream's
``redis/configs/state.py`` is the example). redis-py reconnects a dropped connection by
itself on the next command; ``connect`` after ``aclose`` opens a new client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.redaction import redact_url

__all__ = ["SOCKET_TIMEOUT_SECONDS", "RedisConnection"]

logger = logging.getLogger("fastapi_outbox.brokers.redis")

#: Longest wait for one Redis reply (and for a connection) before it counts as an outage.
SOCKET_TIMEOUT_SECONDS = 5.0
#: How often redis-py checks an idle connection before using it.
HEALTH_CHECK_INTERVAL_SECONDS = 30


class RedisConnection:
    """The Redis client of one broker, shared by its publisher and its consumers."""

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        client: Any = None,
        socket_timeout: float = SOCKET_TIMEOUT_SECONDS,
        stream_prefix: str = "",
    ) -> None:
        self.url = url
        #: Bounds every command of the client (and the consumer's own reads).
        self.socket_timeout = socket_timeout
        self.stream_prefix = stream_prefix
        #: (major, minor) of the server, read by ``connect``; None before.
        self.server_version: tuple[int, ...] | None = None
        self._client = client
        self._own_client = client is None

    def __repr__(self) -> str:
        return f"RedisConnection({redact_url(self.url)!r})"

    @property
    def client(self) -> Any:
        """The ``redis.asyncio.Redis`` client; BrokerUnavailable before ``connect``."""
        if self._client is None:
            raise exceptions.BrokerUnavailable(f"Redis at {redact_url(self.url)} is not connected")
        return self._client

    @property
    def connected(self) -> bool:
        """Whether ``connect`` has made the client and read the server's version."""
        return self._client is not None and self.server_version is not None

    def stream_key(self, stream: str) -> str:
        """The Redis key of ``stream`` (the broker's ``stream_prefix`` prepended)."""
        return self.stream_prefix + stream

    async def connect(self) -> None:
        """Make the client (unless the caller gave one) and read the server's version;
        idempotent. BrokerUnavailable when Redis cannot be reached."""
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(
                self.url,
                socket_timeout=self.socket_timeout,
                socket_connect_timeout=self.socket_timeout,
                health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
            )
        if self.server_version is None:
            try:
                info = await self._client.info("server")
            except Exception as exc:
                raise self.unavailable(exc) from exc
            version = str(info.get("redis_version", "0"))
            self.server_version = tuple(int(p) for p in version.split(".")[:2])

    async def aclose(self) -> None:
        """Close the client this connection made (a caller's client stays open);
        idempotent. The next ``connect`` opens a new one."""
        if self._client is not None and self._own_client:
            await self._client.aclose()
            self._client = None
            self.server_version = None

    async def ping(self) -> None:
        """BrokerUnavailable unless Redis answers a PING (connecting first if needed)."""
        try:
            await self.connect()  # a ping before connect asks the server, not the object
            await self.client.ping()
        except exceptions.BrokerUnavailable:
            raise
        except Exception as exc:
            raise self.unavailable(exc) from exc

    def unavailable(self, exc: BaseException) -> exceptions.BrokerUnavailable:
        """The outage ``exc`` (a connection failure or a timeout of the client) means:
        BrokerTimeout when Redis did not answer in ``socket_timeout``, else
        BrokerUnavailable; both name the server (credentials redacted)."""
        import redis.exceptions as rexc

        if isinstance(exc, rexc.TimeoutError):
            # No answer in ``socket_timeout``: the processor pings to tell a frozen server
            # from a call that hangs on what it carries.
            return exceptions.BrokerTimeout(
                f"Redis at {redact_url(self.url)} did not answer in time: "
                f"{type(exc).__name__}: {exc}"
            )
        return exceptions.BrokerUnavailable(
            f"Redis at {redact_url(self.url)} is unreachable: {type(exc).__name__}: {exc}"
        )

    def refusing(self, code: str, exc: BaseException | str) -> exceptions.BrokerRefusing:
        """The outage a broker-wide refusal (``wire.refusal_code``) means."""
        return exceptions.BrokerRefusing(
            f"Redis at {redact_url(self.url)} refuses commands ({code}): {exc}"
        )
