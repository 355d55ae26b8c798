"""``NatsJetStreamConsumer``: durable pull consumers on NATS JetStream.

* ``setup``: the stream capturing the subject is found (or created, like the publish side
  does), then a durable pull consumer named after the group (made a valid name), explicit
  acks, ``ack_wait`` = ``claim_idle_seconds``, ``max_deliver`` = ``max_attempts`` + a margin
  (the subscriber dead-letters after ``max_attempts``; the margin lets a delivery that
  crashed the consumer every time still arrive once more to be dead-lettered), deliver
  policy new or all.
* ``fetch``: ``fetch(n, timeout)``; the attempt is the message's ``num_delivered``.
* ``ack`` after commit; ``retry``: ``nak(delay=…)``; ``touch``: ``in_progress()``;
  ``release`` at shutdown: ``nak()`` (redelivered at once).
* ``dead_letter``: publish to the dead-letter subject (a stream is created for it) with the
  original headers plus the error, de-duplicated by ``Nats-Msg-Id`` = group and stream
  sequence, then ack.

Messages are decoded from what the publish side sends: payload as data, ``message-id``,
``type`` and friends as headers, the ordering key in the ``key`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import consumer as consumer_mod
from fastapi_outbox.brokers.base import redact_url
from fastapi_outbox.brokers.consumer import ConsumerConfig, ConsumerLag, DeadLetter, Delivery
from fastapi_outbox.brokers.nats import KEY_HEADER, MSG_ID_HEADER, refusal_reason, stream_name_for
from fastapi_outbox.events import HEADER_MESSAGE_ID, HEADER_TYPE, uuid7

if TYPE_CHECKING:
    from fastapi_outbox.brokers.nats import NatsJetStreamBroker

logger = logging.getLogger("fastapi_outbox.brokers.nats")

#: Deliveries JetStream makes beyond ``max_attempts``: room to dead-letter a message that
#: crashed the consumer on each of its attempts.
MAX_DELIVER_MARGIN = 3
#: Dead letters read (one request each) for listing, replay and counting a shared
#: dead-letter subject.
DEAD_LETTER_SCAN = 1_000
API_TIMEOUT_SECONDS = 5.0


def _sequence_and_count(msg: Any) -> tuple[str, int]:
    """(stream sequence, delivery count) from the message's ack subject, read directly:
    ``msg.metadata`` builds a dataclass, a datetime and a sequence pair per message."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"]:
        if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<n>
            return tokens[5], int(tokens[4])
        if len(tokens) >= 11:  # with <domain>.<account hash> after ACK
            return tokens[7], int(tokens[6])
    meta = msg.metadata  # raises NotJSMessageError for anything else
    return str(meta.sequence.stream), int(meta.num_delivered)


class _NatsDelivery(Delivery):
    """A JetStream delivery: its headers (all but ``Nats-*`` and the ordering key) taken
    from the message's own when first asked for."""

    __slots__ = ()

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = {
                k: v
                for k, v in (self.handle.headers or {}).items()
                if k != KEY_HEADER and not k.lower().startswith("nats-")
            }
        return self._headers


class NatsJetStreamConsumer:
    def __init__(self, broker: NatsJetStreamBroker, config: ConsumerConfig) -> None:
        self.broker = broker
        self.config = config
        self.durable = stream_name_for(config.group)
        self.stream_name: str | None = None
        self._sub: Any = None
        self._dead_stream: str | None = None

    @contextlib.asynccontextmanager
    async def _calls(self) -> AsyncIterator[Any]:
        """The JetStream context; NATS failures become BrokerUnavailable / BrokerRefusing."""
        import nats.errors
        import nats.js.errors

        await self.broker.connect()
        if not self.broker._nc.is_connected:
            raise self.broker._unavailable("connection lost, reconnecting")
        try:
            yield self.broker._js
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.NoRespondersError,
            nats.errors.ConnectionReconnectingError,
        ) as exc:
            raise self.broker._unavailable(exc) from exc
        except nats.js.errors.APIError as exc:
            reason = refusal_reason(exc, stream_known=True)
            if reason is None:
                raise
            raise exceptions.BrokerRefusing(
                f"NATS at {redact_url(self.broker.url)} refuses requests: {reason}"
            ) from exc

    async def setup(self) -> None:
        import nats.js.api as api

        await self.broker.connect()
        await self.broker.ensure_stream(self.config.stream)
        async with self._calls() as js:
            self.stream_name = await js.find_stream_name_by_subject(self.config.stream)
            config = api.ConsumerConfig(
                durable_name=self.durable,
                ack_policy=api.AckPolicy.EXPLICIT,
                ack_wait=self.config.claim_idle_seconds,
                max_deliver=self.config.max_attempts + MAX_DELIVER_MARGIN,
                deliver_policy=(
                    api.DeliverPolicy.ALL if self.config.start == "all" else api.DeliverPolicy.NEW
                ),
                filter_subject=self.config.stream,
                max_ack_pending=-1,
            )
            self._sub = await js.pull_subscribe(
                self.config.stream, durable=self.durable, stream=self.stream_name, config=config
            )

    def _delivery(self, msg: Any) -> Delivery:
        raw = msg.headers or {}
        seq, delivered = _sequence_and_count(msg)
        return _NatsDelivery(
            stream=self.config.stream,
            entry_id=seq,
            message_id=raw.get(HEADER_MESSAGE_ID) or raw.get(MSG_ID_HEADER) or seq,
            type=raw.get(HEADER_TYPE, ""),
            key=raw.get(KEY_HEADER),
            payload=msg.data,
            attempt=delivered,
            handle=msg,
        )

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        import nats.errors

        if self._sub is None:
            await self.setup()
        async with self._calls():
            try:
                msgs = await self._sub.fetch(max_messages, timeout=timeout)
            except (nats.errors.TimeoutError, TimeoutError):  # nothing arrived in time
                return []
        return [self._delivery(m) for m in msgs]

    async def _each(self, deliveries: Sequence[Delivery], method: str, **kwargs: Any) -> None:
        if not deliveries:
            return
        # One after the other, not a task each: a JetStream ack / nak / in-progress is a
        # publish into the client's write buffer, an await that does not wait on the
        # server. Every delivery gets its call even when one fails; the first error is
        # raised after.
        error: BaseException | None = None
        async with self._calls():
            for d in deliveries:
                try:
                    await getattr(d.handle, method)(**kwargs)
                except Exception as exc:
                    error = error or exc
            # The client's flusher task, woken by the first of them, writes the buffer to
            # the socket when this task yields: yield once so the calls leave now (as they
            # did when gathered), not whenever this task next waits.
            await asyncio.sleep(0)
            if error is not None:
                raise error

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        raw = self.broker._raw
        if raw is None or not deliveries:
            await self._each(deliveries, "ack")
            return
        # An ack is an empty publish to the message's reply subject: the batch's ``PUB``
        # commands go into nats-py's command buffer as they are (as the publish side
        # writes its ``HPUB`` commands), one flush for all, without ``Msg.ack``'s
        # ``Client.publish`` per message.
        send, flush = raw
        async with self._calls():
            for d in deliveries:
                await send(b"PUB %b 0\r\n\r\n" % d.handle.reply.encode())
            await flush()
            await asyncio.sleep(0)  # the flusher writes them before this returns

    async def ack_soon(self, deliveries: Sequence[Delivery]) -> None:
        await self.ack(deliveries)

    async def retry(self, delivery: Delivery, delay: float) -> None:
        await self._each([delivery], "nak", delay=delay)

    async def touch(self, deliveries: Sequence[Delivery]) -> None:
        await self._each(deliveries, "in_progress")

    async def release(self, deliveries: Sequence[Delivery]) -> None:
        await self._each(deliveries, "nak")

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        await self.broker.ensure_stream(self.config.dead_letter)
        headers = {
            **delivery.headers,
            HEADER_MESSAGE_ID: delivery.message_id,
            consumer_mod.DEAD_LETTER_ERROR: " ".join(consumer_mod.truncate_error(error).split()),
            consumer_mod.DEAD_LETTER_GROUP: self.config.group,
            consumer_mod.DEAD_LETTER_ATTEMPTS: str(delivery.attempt),
            consumer_mod.DEAD_LETTER_STREAM: self.config.stream,
            consumer_mod.DEAD_LETTERED_AT: dt.datetime.now(dt.UTC).isoformat(),
            MSG_ID_HEADER: f"dlq:{self.config.group}:{delivery.entry_id}",
        }
        if delivery.key is not None:
            headers[KEY_HEADER] = delivery.key
        async with self._calls() as js:
            await js.publish(self.config.dead_letter, delivery.payload, headers=headers)
            await delivery.handle.ack()

    async def lag(self) -> ConsumerLag:
        import nats.js.errors

        async with self._calls() as js:
            if self.stream_name is None:
                try:
                    self.stream_name = await js.find_stream_name_by_subject(self.config.stream)
                except nats.js.errors.NotFoundError:
                    return ConsumerLag(lag=None, pending=None)
            try:
                info = await js.consumer_info(self.stream_name, self.durable)
            except nats.js.errors.NotFoundError:
                return ConsumerLag(lag=None, pending=None)
        return ConsumerLag(lag=int(info.num_pending or 0), pending=int(info.num_ack_pending or 0))

    async def _dead_messages(self, limit: int) -> list[tuple[str, Any]]:
        """(sequence, raw message) of this group's dead letters, oldest first."""
        import nats.js.errors

        out: list[tuple[str, Any]] = []
        async with self._calls() as js:
            try:
                name = await js.find_stream_name_by_subject(self.config.dead_letter)
                info = await js.stream_info(name)
                self._dead_stream = name
            except nats.js.errors.NotFoundError:
                return out
            first, last = info.state.first_seq, info.state.last_seq
            for seq in range(first, last + 1):
                if len(out) >= limit or seq - first >= DEAD_LETTER_SCAN:
                    break
                try:
                    raw = await js.get_msg(name, seq)
                except nats.js.errors.NotFoundError:
                    continue
                headers = raw.headers or {}
                if headers.get(consumer_mod.DEAD_LETTER_GROUP) == self.config.group:
                    out.append((str(seq), raw))
        return out

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        out = []
        for seq, raw in await self._dead_messages(limit):
            h = raw.headers or {}
            out.append(
                DeadLetter.from_headers(
                    seq, h.get(HEADER_MESSAGE_ID, ""), h.get(HEADER_TYPE, ""), h, self.config
                )
            )
        return out

    async def count_dead_letters(self) -> int:
        import nats.js.errors

        if not self.config.dead_letter_shared:  # the group's own stream: its size
            async with self._calls() as js:
                try:
                    name = await js.find_stream_name_by_subject(self.config.dead_letter)
                    info = await js.stream_info(name)
                except nats.js.errors.NotFoundError:
                    return 0
            return int(info.state.messages)
        return len(await self._dead_messages(DEAD_LETTER_SCAN))

    async def replay_dead_letters(self, entry_ids: Sequence[str] | None = None) -> int:
        wanted = None if entry_ids is None else set(entry_ids)
        replayed = 0
        for seq, raw in await self._dead_messages(DEAD_LETTER_SCAN):
            if wanted is not None and seq not in wanted:
                continue
            h = dict(raw.headers or {})
            target = h.get(consumer_mod.DEAD_LETTER_STREAM, self.config.stream)
            headers = {
                k: v
                for k, v in h.items()
                if not k.startswith("dead-letter") and not k.lower().startswith("nats-")
            }
            # A new de-duplication id: the original one is still in the duplicate window.
            headers[MSG_ID_HEADER] = f"replay:{uuid7()}"
            async with self._calls() as js:
                await js.publish(target, raw.data or b"", headers=headers)
                await js.delete_msg(self._dead_stream, int(seq))
            replayed += 1
        return replayed

    async def aclose(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
