"""``RabbitMQConnection``: one AMQP connection (aio-pika) and what every user of it needs —
the durable topic exchange declared, channels with publisher confirms kept in a pool,
a publish that waits for its confirm, and the outage classification of its errors.

The publisher and the consumers of a broker each hold a connection of their own (RabbitMQ
blocks a connection that publishes during a memory or disk alarm, and a consumer must
still be able to acknowledge then); both are this class, so neither imports the other.

A connection the server closed (a node restart, a network cut) is noticed at the next
call, which opens a new one: no reconnect loop runs in the background, and a call made
while the node is down raises [`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable] at
once, so the relay or the subscriber pauses with backoff and charges no attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.rabbitmq.wire import outage
from fastapi_outbox.redaction import redact, redact_url

__all__ = [
    "CONFIRM_TIMEOUT_SECONDS",
    "CONNECT_TIMEOUT_SECONDS",
    "HEARTBEAT_SECONDS",
    "RabbitMQConnection",
]

logger = logging.getLogger("fastapi_outbox.brokers.rabbitmq")

#: Longest wait for a new connection (TCP, AMQP handshake): a node that accepts and never
#: answers is an outage seen within this.
CONNECT_TIMEOUT_SECONDS = 5.0
#: Longest wait for the publisher confirms of one batch.
CONFIRM_TIMEOUT_SECONDS = 10.0
#: AMQP heartbeat (negotiated with the server: the lower of both wins; RabbitMQ offers 60):
#: a silent peer (a node killed or frozen, a network cut) is noticed within about three
#: times this many seconds even on a connection that is idle, and the next call opens a
#: new connection. No robust connection (aio-pika's ``connect_robust``) and no reconnect
#: loop: the library reconnects on the next call, so an outage is seen at once.
HEARTBEAT_SECONDS = 10
#: Confirm channels kept open for reuse (one per concurrent publish at most).
POOL_SIZE = 8


class RabbitMQConnection:
    """One AMQP connection to ``url`` and the durable topic exchange ``exchange``."""

    def __init__(
        self,
        url: str,
        *,
        exchange: str,
        connect_timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
        confirm_timeout_seconds: float = CONFIRM_TIMEOUT_SECONDS,
        heartbeat_seconds: int = HEARTBEAT_SECONDS,
        name: str = "fastapi-outbox",
    ) -> None:
        self.url = url
        self.exchange = exchange
        self.connect_timeout_seconds = connect_timeout_seconds
        self.confirm_timeout_seconds = confirm_timeout_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.name = name
        self._conn: Any = None
        self._lock = asyncio.Lock()
        self._declared = False
        #: Free confirm channels: (aio-pika channel, its aiormq channel).
        self._pool: list[tuple[Any, Any]] = []
        #: Bumped by every new connection: delivery tags of an older one are void.
        self.generation = 0

    def __repr__(self) -> str:
        return f"RabbitMQConnection({redact_url(self.url)!r}, exchange={self.exchange!r})"

    @property
    def is_open(self) -> bool:
        """Connected, as far as this client knows (aio-pika's own ``is_closed`` stays False
        when the server went away: its ``connected`` event and aiormq's state say it)."""
        conn = self._conn
        if conn is None or conn.is_closed or not conn.connected.is_set():
            return False
        transport = conn.transport
        return transport is not None and not transport.connection.is_closed

    @property
    def blocked(self) -> str | None:
        """Why RabbitMQ blocks this connection (``connection.blocked``: a memory or disk
        alarm), or None. aiormq keeps the state in an event of its own, read here: when a
        later aiormq hides it, a blocked publish still ends as a confirm timeout."""
        if not self.is_open:
            return None
        underlay = getattr(self._conn.transport, "connection", None)
        unblocked = getattr(underlay, "_Connection__connection_unblocked", None)
        if isinstance(unblocked, asyncio.Event) and not unblocked.is_set():
            return "memory or disk alarm"
        return None

    def unavailable(self, error: BaseException | None) -> Exception:
        """The outage ``error`` is (BrokerRefusing while blocked), or BrokerUnavailable
        wrapping it when `outage` does not know it."""
        blocked = self.blocked
        if error is None:
            error = exceptions.BrokerUnavailable(f"RabbitMQ at {redact_url(self.url)}")
        found = outage(error, self.url, blocked=blocked)
        if found is not None:
            return found
        return exceptions.BrokerUnavailable(
            f"RabbitMQ at {redact_url(self.url)}: {type(error).__name__}: {redact(str(error))}"
        )

    def _heartbeat(self) -> dict[str, Any]:
        """aio-pika's ``heartbeat`` keyword, unless the URL's query names one (aio-pika's
        keywords win over the query: a ``?heartbeat=`` there is the user's and stays)."""
        return {} if "heartbeat=" in self.url else {"heartbeat": self.heartbeat_seconds}

    async def connect(self) -> None:
        """Open the connection and declare the exchange (durable, topic) when not done;
        BrokerUnavailable when the server cannot be reached; ConfigurationError when an
        exchange of that name exists with another type."""
        if self._declared and self.is_open:
            return
        async with self._lock:
            if self._declared and self.is_open:
                return
            import aio_pika
            import aiormq.exceptions

            if not self.is_open:
                dead, self._conn = self._conn, None
                self._forget()
                if dead is not None:  # what it still holds goes (the server is gone)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(dead.close(), 1.0)
                try:
                    conn = await asyncio.wait_for(
                        aio_pika.connect(
                            self.url,
                            timeout=self.connect_timeout_seconds,
                            client_properties={"connection_name": self.name},
                            **self._heartbeat(),
                        ),
                        self.connect_timeout_seconds,
                    )
                except Exception as exc:
                    raise self.unavailable(exc) from exc
                self._conn = conn
                self.generation += 1
                logger.info(
                    "rabbitmq connected",
                    extra={
                        "action": "broker.connect",
                        "broker_url": redact_url(self.url),
                        "connection": self.name,
                    },
                )
            try:
                channel = await self._conn.channel(publisher_confirms=False)
                try:
                    await channel.declare_exchange(self.exchange, "topic", durable=True)
                finally:
                    with contextlib.suppress(Exception):
                        await channel.close()
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                raise exceptions.ConfigurationError(
                    f"RabbitMQ at {redact_url(self.url)}: exchange {self.exchange!r} exists "
                    f"and is not a durable topic exchange ({exc}); pass another exchange= "
                    "to RabbitMQBroker or delete it"
                ) from exc
            except Exception as exc:
                raise self.unavailable(exc) from exc
            self._declared = True

    def _forget(self) -> None:
        self._conn = None
        self._declared = False
        self._pool = []

    def channel_failed(self) -> None:
        """A channel was closed by the server: declare the exchange again before the next
        call (it may be what went missing)."""
        self._declared = False

    async def aclose(self) -> None:
        conn, pool = self._conn, self._pool
        self._forget()
        for channel, _ in pool:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), self.connect_timeout_seconds)
        if conn is not None and not conn.is_closed:
            try:
                await asyncio.wait_for(conn.close(), self.connect_timeout_seconds)
            except Exception:  # closing a dead connection must not fail shutdown
                logger.debug("rabbitmq close failed", exc_info=True)

    async def ping(self) -> None:
        """A round trip (the exchange declared again, passively): BrokerUnavailable when
        there is no answer, BrokerRefusing while the connection is blocked."""
        await self.connect()
        if self.blocked is not None:
            raise self.unavailable(None)
        try:
            async with self.confirming() as channel:
                await asyncio.wait_for(
                    channel.exchange_declare(exchange=self.exchange, passive=True),
                    self.connect_timeout_seconds,
                )
        except exceptions.BrokerUnavailable:
            raise
        except Exception as exc:
            raise self.unavailable(exc) from exc

    async def channel(self, *, prefetch: int = 0) -> Any:
        """A new aio-pika channel (no confirms) of the caller's own, with ``prefetch``
        unacknowledged deliveries at most (0: unlimited)."""
        await self.connect()
        try:
            channel = await self._conn.channel(publisher_confirms=False)
            if prefetch:
                await channel.set_qos(prefetch_count=prefetch)
        except Exception as exc:
            raise self.unavailable(exc) from exc
        return channel

    @contextlib.asynccontextmanager
    async def confirming(self) -> AsyncIterator[Any]:
        """A channel with publisher confirms and returns (the aiormq channel: its
        ``basic_publish`` costs a fraction of aio-pika's ``Exchange.publish``), taken
        from the pool and given back when the block ends cleanly on an open channel."""
        await self.connect()
        generation = self.generation
        if self._pool:
            pair = self._pool.pop()
        else:
            try:
                channel = await self._conn.channel(publisher_confirms=True, on_return_raises=True)
                pair = (channel, await channel.get_underlay_channel())
            except Exception as exc:
                raise self.unavailable(exc) from exc
        clean = False
        try:
            yield pair[1]
            clean = True
        finally:
            if (
                clean
                and generation == self.generation
                and not pair[0].is_closed
                and len(self._pool) < POOL_SIZE
            ):
                self._pool.append(pair)
            else:
                if pair[0].is_closed:
                    self.channel_failed()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pair[0].close(), 1.0)

    async def publish_confirmed(
        self,
        body: bytes,
        *,
        routing_key: str,
        properties: Any,
        exchange: str | None = None,
    ) -> None:
        """One message, mandatory, confirmed: MessageRejected when nothing routes it (or
        RabbitMQ nacks it), an outage as `unavailable` says."""
        import aiormq.exceptions

        if self.blocked is not None:
            raise self.unavailable(None)
        target = self.exchange if exchange is None else exchange
        try:
            async with self.confirming() as channel:
                await asyncio.wait_for(
                    channel.basic_publish(
                        body,
                        exchange=target,
                        routing_key=routing_key,
                        properties=properties,
                        mandatory=True,
                    ),
                    self.confirm_timeout_seconds,
                )
        except aiormq.exceptions.PublishError as exc:
            raise exceptions.MessageRejected(
                f"no queue bound for {routing_key!r} on exchange {target!r}: returned unroutable"
            ) from exc
        except aiormq.exceptions.DeliveryError as exc:
            raise exceptions.MessageRejected(f"RabbitMQ refused the message: {exc}") from exc
        except exceptions.BrokerUnavailable:
            raise
        except Exception as exc:
            raise self.unavailable(exc) from exc
