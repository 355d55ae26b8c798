"""The consumer side of a broker: the ``Consumer`` protocol every transport implements.

A subscriber (`fastapi_outbox.consume.subscriber`) drives one consumer per (stream, group):

* ``setup()`` creates the group / durable consumer (and the dead-letter stream where the
  broker needs one) when missing, or brings an existing one to the declared settings
  (ConfigurationError naming the setting when the broker refuses); ``Outbox`` calls it for
  every subscriber before its relays publish and in ``create_tables``, so a group
  exists before the first message meant for it, whatever ``start`` says;
* ``fetch(n, timeout)`` returns up to n `Delivery` objects — new messages, stale ones
  of dead consumers reclaimed after ``claim_idle_seconds``, and this consumer's own retries
  that are due — each with its delivery count (attempt) from the broker;
* ``ack``, after the handler's transaction committed; ``ack_soon`` (optional: a consumer
  without it gets ``ack``), the same for a fetch loop that fetches again at once, so the
  transport may carry the ack with that fetch (Redis: one pipeline with the next read);
* ``retry(delivery, delay)``: deliver it again after ``delay`` (NATS ``nak(delay)``);
* ``touch``: keep deliveries this consumer still works on from being reclaimed;
* ``release``: give deliveries back at shutdown (redelivered at once where the broker can);
* ``defer(delivery, delay)`` (optional: a consumer without it gets ``retry``): hand a
  delivery of a type this process does not take back to the group after ``delay``, for any
  consumer of it, uncharged where the broker can reset its count (Redis, memory); the
  subscriber counts a redelivered message's attempts itself
  (`fastapi_outbox.storage.group_members`);
* ``dead_letter(delivery, error)``: move it to the dead-letter stream with the error and
  the original headers, and acknowledge it, so it never blocks the others;
* ``lag()``, ``dead_letters()`` and ``replay_dead_letters()`` for health and the CLI.

Messages are decoded from the format the publish side writes (each broker's ``wire``
module: ``redis/wire.py``, ``nats/wire.py``): message id, type, key, JSON headers and the
JSON payload. A consumer receives its broker's connection object (``<name>/connection.py``),
which it shares with the publisher; it never sees the publisher. Failures of the broker
itself raise [`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable]: the subscriber
pauses, and no handler attempt is charged.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic_core import from_json

__all__ = [
    "DEAD_LETTER_ERROR",
    "DEAD_LETTER_GROUP",
    "Consumer",
    "ConsumerConfig",
    "ConsumerLag",
    "DeadLetter",
    "Delivery",
    "dead_letter_name",
    "parse_headers",
]

#: Headers added to a dead letter (besides the original ones).
DEAD_LETTER_ERROR = "dead-letter-error"
DEAD_LETTER_GROUP = "dead-letter-group"
DEAD_LETTER_ATTEMPTS = "dead-letter-attempts"
DEAD_LETTER_STREAM = "dead-letter-stream"
DEAD_LETTERED_AT = "dead-lettered-at"
#: Longest error text kept in a dead letter.
ERROR_MAX_CHARS = 2000


def dead_letter_name(template: str, stream: str, group: str) -> str:
    """The dead-letter stream of (``stream``, ``group``): ``template`` with ``{stream}`` and
    ``{group}`` filled in (default ``{stream}.{group}.dlq``)."""
    return template.format(stream=stream, group=group)


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """What a subscriber asks of its consumer."""

    stream: str
    group: str
    #: One name per process (Redis consumer name; the NATS durable is named from the group
    #: and the subject: ``nats_consumer.durable_name``).
    consumer_name: str
    dead_letter: str
    claim_idle_seconds: float
    max_attempts: int
    #: Where a group that does not exist yet starts: "new" (messages added from now on) or
    #: "all" (from the beginning of the stream). An existing group keeps its position.
    start: str = "new"
    #: Other groups' dead letters share the dead-letter stream (its name template has no
    #: ``{group}``): counting then means reading the entries.
    dead_letter_shared: bool = False
    #: ``ordered=True``: one consumer of the group at a time where the broker needs that
    #: for stream order (RabbitMQ: a single-active-consumer queue).
    ordered: bool = False
    #: Deliveries the broker may push ahead of ``fetch`` (the subscriber's in-flight
    #: limit); 0: the transport's default. Brokers that are pulled from ignore it.
    prefetch: int = 0


def parse_headers(raw: bytes | str | None) -> dict[str, str]:
    """A JSON object of headers (the Redis ``headers`` field); {} when absent or invalid."""
    if not raw:
        return {}
    try:  # pydantic-core's parser: one native call, ~4x faster than json.loads here
        decoded = from_json(raw)
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


class Delivery:
    """One delivery of a message to this consumer.

    ``headers`` may be given parsed, or as the JSON text they came in (``raw_headers``),
    parsed on first use: a batch handler that never reads them costs no parse and keeps
    no dict per message."""

    __slots__ = (
        "_headers",
        "attempt",
        "entry_id",
        "fetched_at",
        "handle",
        "key",
        "message_id",
        "payload",
        "raw_headers",
        "stream",
        "type",
    )

    def __init__(
        self,
        *,
        stream: str,
        entry_id: str,
        message_id: str,
        type: str,
        key: str | None,
        payload: bytes,
        attempt: int,
        headers: dict[str, str] | None = None,
        raw_headers: bytes | None = None,
        handle: Any = None,
    ) -> None:
        self.stream = stream
        #: The broker's handle of this entry: Redis entry id, NATS stream sequence.
        self.entry_id = entry_id
        self.message_id = message_id
        self.type = type
        self.key = key
        self.payload = payload
        #: Delivery count from the broker (1 on the first delivery).
        self.attempt = attempt
        self._headers = headers
        self.raw_headers = raw_headers
        #: Broker object needed to ack it (the NATS ``Msg``).
        self.handle = handle
        #: When the subscriber fetched it (``time.monotonic()``).
        self.fetched_at = 0.0

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = parse_headers(self.raw_headers)
        return self._headers

    def has_header(self, name: str) -> bool:
        """Whether header ``name`` is present; headers still in their JSON text are only
        parsed when the name occurs in it (the payload stages' cheap check)."""
        raw = self.raw_headers
        if self._headers is None and raw is not None and name.encode() not in raw:
            return False
        return name in self.headers

    def restored(self, payload: bytes, headers: dict[str, str]) -> Delivery:
        """A copy with the payload and headers the payload stages restored (the handler's
        view); the original stays the one acknowledged and dead-lettered."""
        copy = Delivery(
            stream=self.stream,
            entry_id=self.entry_id,
            message_id=self.message_id,
            type=self.type,
            key=self.key,
            payload=payload,
            attempt=self.attempt,
            headers=headers,
            handle=self.handle,
        )
        copy.fetched_at = self.fetched_at
        return copy

    def json(self) -> Any:
        return json.loads(self.payload)

    def __repr__(self) -> str:
        return (
            f"Delivery(stream={self.stream!r}, entry_id={self.entry_id!r}, "
            f"message_id={self.message_id!r}, type={self.type!r}, attempt={self.attempt})"
        )


@dataclasses.dataclass(slots=True)
class ConsumerLag:
    """How far a group is behind (None: the broker cannot say)."""

    #: Messages in the stream the group has not been given yet.
    lag: int | None
    #: Delivered and not acknowledged yet.
    pending: int | None
    #: Entries removed from the stream (Redis ``MAXLEN`` trimming) before the group read
    #: them: lost to it. At least this many; 0: none seen; None: the broker cannot say.
    trimmed: int | None = None
    #: Lag per partition number (Kafka), None where the broker has no partitions.
    partitions: dict[int, int] | None = None


@dataclasses.dataclass(slots=True)
class DeadLetter:
    """One entry of a dead-letter stream."""

    entry_id: str
    message_id: str
    type: str
    stream: str
    group: str
    error: str
    attempts: int | None
    dead_lettered_at: dt.datetime | None

    @classmethod
    def from_headers(
        cls,
        entry_id: str,
        message_id: str,
        type: str,
        headers: Mapping[str, str],
        config: ConsumerConfig,
    ) -> DeadLetter:
        """A dead letter from the headers the consumer wrote when it moved the message."""
        at = headers.get(DEAD_LETTERED_AT)
        return cls(
            entry_id=entry_id,
            message_id=message_id,
            type=type,
            stream=headers.get(DEAD_LETTER_STREAM, config.stream),
            group=config.group,
            error=headers.get(DEAD_LETTER_ERROR, ""),
            attempts=int(headers.get(DEAD_LETTER_ATTEMPTS, "0") or 0),
            dead_lettered_at=dt.datetime.fromisoformat(at) if at else None,
        )


@runtime_checkable
class Consumer(Protocol):
    """One consumer group's reader of one stream."""

    config: ConsumerConfig

    async def setup(self) -> None:
        """Create the group / durable consumer when missing, or bring an existing one to
        the declared settings (idempotent)."""

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Up to ``max_messages`` deliveries, waiting at most ``timeout`` s for the first."""

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge: the group is done with them."""

    async def ack_soon(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge by the next ``fetch`` (which the caller's fetch loop is about to
        make) where the transport can carry both in one round trip, else at once; what is
        still waiting goes at ``aclose``. For callers that fetch again right away: a crash
        before the ack went out means a redelivery, which the inbox skips."""

    async def retry(self, delivery: Delivery, delay: float) -> None:
        """Deliver ``delivery`` again (with its count raised) after ``delay`` seconds."""

    async def touch(self, deliveries: Sequence[Delivery]) -> None:
        """Still working on them: do not hand them to another consumer yet."""

    async def release(self, deliveries: Sequence[Delivery]) -> None:
        """Shutdown: give back deliveries not handled (redelivered without waiting where
        the broker allows it, as the same attempt where it can reset its delivery count:
        Redis, the memory broker; a JetStream ``nak`` counts one delivery more)."""

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        """Move to the dead-letter stream with ``error`` and the original headers; ack."""

    async def lag(self) -> ConsumerLag: ...

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        """Dead letters of this group, oldest first."""

    async def count_dead_letters(self) -> int: ...

    async def replay_dead_letters(self, entry_ids: Sequence[str] | None = None) -> int:
        """Put dead letters (all, or those of ``entry_ids``) back on the stream and remove
        them from the dead-letter stream; returns how many. Other groups skip them (their
        inbox has the message id); this group handles them again."""

    async def aclose(self) -> None: ...


def truncate_error(error: str) -> str:
    return error if len(error) <= ERROR_MAX_CHARS else error[: ERROR_MAX_CHARS - 3] + "..."
