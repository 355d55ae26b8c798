"""``RedisStreamsBroker``: the composition of one ``RedisConnection``, the publisher on it
and the consumers of ``@outbox.subscriber`` on it. The publisher and the consumer each
receive the connection and never import each other."""

from __future__ import annotations

import json
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.cloudevents import (
    DEFAULT_SOURCE,
    CloudEventsMode,
    CloudEventsOptions,
    EnvelopeFormat,
)
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.redis.connection import SOCKET_TIMEOUT_SECONDS, RedisConnection
from fastapi_outbox.brokers.redis.consumer import RedisStreamsConsumer
from fastapi_outbox.brokers.redis.publisher import (
    IDMP_PRODUCERS,
    DedupMode,
    RedisStreamsPublisher,
)
from fastapi_outbox.brokers.redis.wire import PUBLISHED_FIELDS, entry_values
from fastapi_outbox.brokers.wire_description import Bindings, WireDescription
from fastapi_outbox.events import Envelope

__all__ = ["RedisStreamsBroker", "RedisStreamsWire"]


class RedisStreamsBroker(RedisStreamsPublisher):
    """Publishes to Redis Streams (``redis.asyncio``), pipelined and de-duplicated, and
    consumes them with consumer groups
    ([`consumer`][fastapi_outbox.brokers.RedisStreamsBroker.consumer]), on one connection
    (`connection`): a single Redis or a Redis Cluster."""

    def __init__(
        self,
        url: Any = "redis://localhost:6379/0",
        *,
        client: Any = None,
        maxlen: int | None = None,
        dedup: DedupMode = "auto",
        dedup_window_seconds: float | None = None,
        stream_prefix: str = "",
        idmp_producers: int = IDMP_PRODUCERS,
        socket_timeout: float = SOCKET_TIMEOUT_SECONDS,
        dead_letter_maxlen: int | None = None,
        envelope: EnvelopeFormat = "native",
        cloudevents_mode: CloudEventsMode = "binary",
        cloudevents_source: str = DEFAULT_SOURCE,
        wait_replicas: int = 0,
        wait_timeout_seconds: float = 1.0,
    ) -> None:
        """``url``: ``redis://`` / ``rediss://`` / ``unix://``, a Redis Cluster's
        ``redis+cluster://host:port[,host:port…]`` (``rediss+cluster://`` with TLS) or a list
        of its startup nodes (``["redis://h1:7000", "h2:7001"]``), or a ready
        ``redis.asyncio`` client (``Redis`` or ``RedisCluster``, as ``client=`` too; never
        closed by the broker). ``maxlen`` trims the streams published to; the consumers'
        dead-letter streams are never trimmed unless ``dead_letter_maxlen`` is set
        (``MAXLEN ~``).
        ``envelope="cloudevents"`` publishes CloudEvents (``cloudevents_mode`` binary or
        structured) from ``cloudevents_source``; consumers read either envelope.
        ``wait_replicas``: a publish succeeds once that many replicas of each master
        written to took the writes (``WAIT``, up to ``wait_timeout_seconds``; fewer: the
        broker is unavailable and the batch comes back), so a failover loses no message
        the outbox marked published (docs/how-to/redis-cluster.md)."""
        if dead_letter_maxlen is not None and dead_letter_maxlen < 1:
            raise exceptions.ConfigurationError(
                f"RedisStreamsBroker: dead_letter_maxlen must be >= 1, got {dead_letter_maxlen}"
            )
        connection = RedisConnection(
            url, client=client, socket_timeout=socket_timeout, stream_prefix=stream_prefix
        )
        super().__init__(
            connection,
            maxlen=maxlen,
            dedup=dedup,
            dedup_window_seconds=dedup_window_seconds,
            idmp_producers=idmp_producers,
            envelope_format=CloudEventsOptions(envelope, cloudevents_mode, cloudevents_source),
            wait_replicas=wait_replicas,
            wait_timeout_seconds=wait_timeout_seconds,
        )
        self.dead_letter_maxlen = dead_letter_maxlen

    def consumer(self, config: ConsumerConfig) -> RedisStreamsConsumer:
        """The consumer side of ``@outbox.subscriber`` (``consumer.py``), on this broker's
        connection."""
        return RedisStreamsConsumer(
            self.connection, config, dead_letter_maxlen=self.dead_letter_maxlen
        )

    def asyncapi_wire(self) -> RedisStreamsWire:
        """This broker's wire in the AsyncAPI document (``outbox.asyncapi()``)."""
        return RedisStreamsWire(self.connection.stream_prefix, self.envelope_format)


class RedisStreamsWire(WireDescription):
    """A Redis Streams entry: the fields ``id``, ``type``, ``key``, ``headers`` (the headers
    as one JSON object) and ``payload``; a consumer group reads it with ``XREADGROUP``. The
    AsyncAPI Redis bindings define no fields yet: the stream key and the group travel as
    ``x-`` extensions."""

    protocol = "redis"
    binding_version = "0.1.0"

    def __init__(self, stream_prefix: str, envelope_format: CloudEventsOptions) -> None:
        super().__init__(envelope_format)
        self.stream_prefix = stream_prefix

    def encode(self, envelope: Envelope) -> tuple[dict[str, str], bytes]:
        values = dict(
            zip(PUBLISHED_FIELDS, entry_values(envelope, self.envelope_format), strict=True)
        )
        headers = json.loads(values[b"headers"])
        return headers, values[b"payload"]

    def layout(self) -> str:
        fields = ", ".join(f.decode() for f in PUBLISHED_FIELDS)
        return (
            f"A Redis Streams entry (XADD) of the fields {fields}: the headers below travel "
            "as one JSON object in the field headers, the payload in the field payload."
        )

    def channel_bindings(self, stream: str) -> Bindings:
        return {"x-stream-key": self.stream_prefix + stream}

    def send_bindings(self, stream: str) -> Bindings:
        return {"x-command": "XADD"}

    def receive_bindings(self, stream: str, group: str) -> Bindings:
        return {
            "x-consumer-group": group,
            "x-commands": ["XREADGROUP", "XACK", "XAUTOCLAIM"],
        }

    def message_bindings(self, envelope: Envelope) -> Bindings:
        return {"x-fields": [f.decode() for f in PUBLISHED_FIELDS]}
