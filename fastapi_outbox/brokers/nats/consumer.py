"""``NatsJetStreamConsumer``: durable pull consumers on NATS JetStream.

* ``setup``: the stream capturing the subject is found (or created, like the publish side
  does), and the dead-letter stream (without age or size limits). The durable pull
  consumer is named from the group and the subject (`durable_name`: the group, ``_``
  and a hash of the filter subject), so two subscriptions of one group never share one:
  explicit acks, ``ack_wait`` = ``claim_idle_seconds``, ``max_deliver`` = -1 (unlimited:
  the subscriber counts the attempts and dead-letters after ``max_attempts``, so a message
  whose dead-lettering failed stays pending instead of expiring), deliver policy new or
  all. An existing durable whose filter subject, ``ack_wait`` or ``max_deliver`` differ is
  updated in place; a server that refuses the update refuses the start, naming the
  setting. A durable of an earlier release (named after the group alone) with the same
  filter hands over its position: the new durable starts after its ack floor.
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
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import consumer as consumer_mod
from fastapi_outbox.brokers.consumer import ConsumerConfig, ConsumerLag, DeadLetter, Delivery
from fastapi_outbox.brokers.nats.connection import NatsConnection
from fastapi_outbox.brokers.nats.wire import (
    KEY_HEADER,
    MSG_ID_HEADER,
    decode_message,
    is_unreachable,
    refusal_reason,
    stream_name_for,
)
from fastapi_outbox.events import HEADER_MESSAGE_ID, HEADER_TYPE, uuid7

logger = logging.getLogger("fastapi_outbox.brokers.nats")

#: Dead letters read (one request each) for listing, replay and counting a shared
#: dead-letter subject.
DEAD_LETTER_SCAN = 1_000
API_TIMEOUT_SECONDS = 5.0


def durable_name(group: str, subject: str) -> str:
    """The durable of (``group``, filter ``subject``): the group made a valid name, ``_``
    and 12 hex digits of the subject's SHA-256 — stable, at most 213 characters, never
    shared by two subjects of one group."""
    digest = hashlib.sha256(subject.encode()).hexdigest()[:12]
    return f"{stream_name_for(group)[:200]}_{digest}"


class NatsJetStreamConsumer:
    """One group's durable pull consumer of one subject, on the broker's
    ``NatsConnection``."""

    def __init__(self, connection: NatsConnection, config: ConsumerConfig) -> None:
        self.connection = connection
        self.config = config
        self.durable = durable_name(config.group, config.stream)
        #: The durable of releases before the subject was part of the name.
        self.legacy_durable = stream_name_for(config.group)
        self.stream_name: str | None = None
        self._sub: Any = None
        self._dead_stream: str | None = None
        #: (position it stands at, subscription) of ``read_after``'s ephemeral consumer.
        self._reading: tuple[str, Any] | None = None

    @contextlib.asynccontextmanager
    async def _calls(self) -> AsyncIterator[Any]:
        """The JetStream context; NATS failures become BrokerUnavailable / BrokerRefusing."""
        import nats.js.errors

        await self.connection.connect()
        self.connection.ensure_connected()
        try:
            yield self.connection.jetstream
        except Exception as exc:
            if is_unreachable(exc):
                raise self.connection.unavailable(exc) from exc
            if isinstance(exc, nats.js.errors.APIError):
                reason = refusal_reason(exc, stream_known=True)
                if reason is not None:
                    raise self.connection.refusing(reason, "requests") from exc
            raise

    def _wanted(self) -> dict[str, Any]:
        """The settings of the durable this subscriber declares (compared at start)."""
        return {
            "filter_subject": self.config.stream,
            "ack_wait": float(self.config.claim_idle_seconds),
            "max_deliver": -1,
        }

    async def setup(self) -> None:
        await self.connection.connect()
        await self.connection.ensure_stream(self.config.stream)
        await self.connection.ensure_stream(self.config.dead_letter, dead_letter=True)
        async with self._calls() as js:
            self.stream_name = await js.find_stream_name_by_subject(self.config.stream)
            await self.ensure_durable(js, self.stream_name)
            self._sub = await js.pull_subscribe_bind(durable=self.durable, stream=self.stream_name)

    async def ensure_durable(self, js: Any, stream: str) -> None:
        """Create the durable, or bring an existing one to the declared settings."""
        import nats.js.errors

        try:
            info = await js.consumer_info(stream, self.durable)
        except nats.js.errors.NotFoundError:
            await self._create_durable(js, stream)
        else:
            await self._update_durable(js, stream, info)

    async def _update_durable(self, js: Any, stream: str, info: Any) -> None:
        """Bring the existing durable (``info``) to the declared settings; a refused
        update is a ConfigurationError naming the group, the durable and the settings."""
        import nats.js.errors

        wanted = self._wanted()
        current = {name: getattr(info.config, name) for name in wanted}
        current["ack_wait"] = float(current["ack_wait"] or 0)
        if current["max_deliver"] in (None, 0):
            current["max_deliver"] = -1
        changed = {n: (current[n], v) for n, v in wanted.items() if current[n] != v}
        if not changed:
            return
        try:
            await js.add_consumer(stream, config=info.config.evolve(**wanted))
        except nats.js.errors.APIError as exc:
            if refusal_reason(exc, stream_known=True) is not None:
                raise
            settings = ", ".join(f"{n} {old!r} -> {new!r}" for n, (old, new) in changed.items())
            raise exceptions.ConfigurationError(
                f"subscriber of stream {self.config.stream!r}, group {self.config.group!r}: "
                f"NATS refuses to update the existing durable consumer {self.durable!r} "
                f"of JetStream stream {stream!r} ({settings}): {exc}; delete it "
                f"(nats consumer rm {stream} {self.durable}) or restore the old settings"
            ) from exc
        logger.info(
            "jetstream durable updated",
            extra={
                "action": "consumer.durable_updated",
                "stream": stream,
                "durable": self.durable,
                "changed": {n: f"{old!r} -> {new!r}" for n, (old, new) in changed.items()},
            },
        )

    async def _create_durable(self, js: Any, stream: str) -> None:
        """Create the durable: where ``start`` says, or after the ack floor of an earlier
        release's durable of this group (``_legacy_position``)."""
        import nats.js.api as api

        start: dict[str, Any] = {
            "deliver_policy": (
                api.DeliverPolicy.ALL if self.config.start == "all" else api.DeliverPolicy.NEW
            )
        }
        handed_over = await self._legacy_position(js, stream)
        if handed_over is not None:
            start = handed_over
        config = api.ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            max_ack_pending=-1,
            **self._wanted(),
            **start,
        )
        await js.add_consumer(stream, config=config)
        logger.info(
            "jetstream durable created",
            extra={
                "action": "consumer.durable_created",
                "stream": stream,
                "durable": self.durable,
                "subject": self.config.stream,
                "start": {k: str(v) for k, v in start.items()},
                "handed_over_from": self.legacy_durable if handed_over is not None else None,
            },
        )

    async def _legacy_position(self, js: Any, stream: str) -> dict[str, Any] | None:
        """Where the new durable starts when an earlier release's durable of this group
        (named after the group alone) has the same filter subject: after its ack floor
        (what it acknowledged in a row is not delivered again; later acks are redelivered
        and skipped by the inbox). None when there is no such durable."""
        import nats.js.api as api
        import nats.js.errors

        try:
            old = await js.consumer_info(stream, self.legacy_durable)
        except nats.js.errors.NotFoundError:
            return None
        if old.config.filter_subject != self.config.stream:
            return None  # another subject's (or a consumer not of this library)
        floor = old.ack_floor.stream_seq if old.ack_floor is not None else 0
        if floor:
            position: dict[str, Any] = {
                "deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE,
                "opt_start_seq": floor + 1,
            }
        elif old.config.deliver_policy == api.DeliverPolicy.NEW and old.created is not None:
            # Nothing acknowledged yet: from when the old durable began.
            position = {
                "deliver_policy": api.DeliverPolicy.BY_START_TIME,
                "opt_start_time": old.created,
            }
        else:
            position = {
                "deliver_policy": old.config.deliver_policy or api.DeliverPolicy.ALL,
                "opt_start_seq": old.config.opt_start_seq,
                "opt_start_time": old.config.opt_start_time,
            }
        logger.warning(
            "jetstream durable of an earlier release found: the new durable takes over from "
            "its ack floor; delete the old one once no process of the earlier release runs",
            extra={
                "action": "consumer.durable_handover",
                "stream": stream,
                "old_durable": self.legacy_durable,
                "durable": self.durable,
                "ack_floor": floor,
            },
        )
        return position

    def _delivery(self, msg: Any) -> Delivery:
        return decode_message(self.config.stream, msg)

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

    # -- reading from a position (ordered subscribers: fastapi_outbox.consume.partitioned) --

    #: The position before the stream's first entry.
    origin_position = "0"

    @staticmethod
    def position_key(entry_id: str) -> int:
        """Stream order of stream sequences."""
        return int(entry_id)

    async def tail_position(self) -> str:
        """The stream's last sequence ("0": empty): where a group that starts with new
        messages begins."""
        await self.connection.connect()
        await self.connection.ensure_stream(self.config.stream)
        async with self._calls() as js:
            name = await js.find_stream_name_by_subject(self.config.stream)
            info = await js.stream_info(name)
        return str(info.state.last_seq or 0)

    async def read_after(self, position: str, count: int, timeout: float) -> list[Delivery]:
        """Up to ``count`` messages of the subject after stream sequence ``position``, in
        stream order, waiting up to ``timeout`` for the first: an ephemeral pull consumer
        without acks (``AckPolicy.NONE``, deleted after ``claim_idle_seconds`` unused),
        made again when asked for another position than the one it stands at. Attempt 1:
        the caller counts its own tries."""
        import nats.errors
        import nats.js.api as api

        async with self._calls() as js:
            if self._reading is None or self._reading[0] != position:
                await self._stop_reading()
                if self.stream_name is None:
                    self.stream_name = await js.find_stream_name_by_subject(self.config.stream)
                config = api.ConsumerConfig(
                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=int(position) + 1,
                    ack_policy=api.AckPolicy.NONE,
                    inactive_threshold=max(5.0, float(self.config.claim_idle_seconds)),
                    mem_storage=True,
                )
                sub = await js.pull_subscribe(
                    self.config.stream, stream=self.stream_name, config=config
                )
                self._reading = (position, sub)
            sub = self._reading[1]
            try:
                msgs = await sub.fetch(count, timeout=timeout)
            except (nats.errors.TimeoutError, TimeoutError):
                return []
        out = [self._delivery(m) for m in msgs]
        if out:
            self._reading = (out[-1].entry_id, sub)
        return out

    async def _stop_reading(self) -> None:
        reading, self._reading = self._reading, None
        if reading is not None:
            with contextlib.suppress(Exception):
                await reading[1].unsubscribe()

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
        raw = self.connection.command_buffer
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

    async def defer(self, delivery: Delivery, delay: float) -> None:
        # JetStream counts the delivery; the subscriber counts attempts itself.
        await self._each([delivery], "nak", delay=delay)

    async def touch(self, deliveries: Sequence[Delivery]) -> None:
        await self._each(deliveries, "in_progress")

    async def release(self, deliveries: Sequence[Delivery]) -> None:
        await self._each(deliveries, "nak")

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        await self.connection.ensure_stream(self.config.dead_letter, dead_letter=True)
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

        if self.config.ordered:
            # An ordered subscriber reads the stream by position, not through the group
            # (fastapi_outbox.consume.partitioned): the group's figures are not its own.
            return ConsumerLag(lag=None, pending=None)

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
            if not info.state.messages:  # created with the group, empty (seq 0 is no message)
                return out
            first, last = max(1, info.state.first_seq), info.state.last_seq
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
        await self._stop_reading()
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
