"""``NatsJetStreamBroker``: publish to JetStream with ``Nats-Msg-Id`` de-duplication.

The subject is the event's stream. Every message carries ``Nats-Msg-Id`` = the outbox row
id, so JetStream drops a republish that falls inside the stream's duplicate window, the
envelope's headers (``message-id``, ``type``, ...) and, when it has one, the ordering key
in a ``key`` header; the payload is the message data. A batch goes out as one run of
``HPUB`` commands, each with a reply subject of the broker's own, written to nats-py's
command buffer and flushed once (nats-py's ``publish`` per message where the client lacks
that buffer); the JetStream acks come back to one wildcard subscription, which records each
message's outcome in its batch, and the batch waits once for all of them. No per-message
future, semaphore slot or ack object: JetStream's ``publish_async`` costs about twice the
client CPU per message.

When no JetStream stream captures a subject, the broker creates one (``create_streams``,
on by default) whose duplicate window covers the outbox's de-duplication window (lease +
longest backoff + margin); an existing stream with a shorter window is reported in the
log. A publish that no stream acknowledges is a failure, never a silent drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any, Self

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions, to_envelope
from fastapi_outbox.brokers.nats.connection import NatsConnection
from fastapi_outbox.brokers.nats.wire import (
    ack_error,
    exceeds_max_payload,
    hpub_command,
    invalid_subject,
    is_unreachable,
    publish_headers,
    refusal_reason,
    wire_size,
)
from fastapi_outbox.events import Envelope
from fastapi_outbox.redaction import redact_url

logger = logging.getLogger("fastapi_outbox.brokers.nats")


class _Batch:
    """Acks of one ``publish`` call: the error of each message (None: acknowledged), how
    many are still awaited, and a future done once none is."""

    __slots__ = ("done", "errors", "waiting")

    def __init__(self, size: int, loop: asyncio.AbstractEventLoop) -> None:
        self.errors: list[BaseException | None] = [None] * size
        self.waiting = 0
        self.done: asyncio.Future[None] = loop.create_future()


class NatsJetStreamPublisher:
    """Publishes to NATS JetStream (``nats-py``), de-duplicated by ``Nats-Msg-Id``."""

    def __init__(
        self, connection: NatsConnection, *, envelope_format: CloudEventsOptions | None = None
    ) -> None:
        """``envelope_format`` with CloudEvents sends each message as a CloudEvent (binary:
        ``ce-*`` headers and the payload; structured: one JSON document)."""
        self.connection = connection
        self.envelope_format = envelope_format or CloudEventsOptions()
        self._lock = asyncio.Lock()
        # Acks: the reply subjects of the messages in flight, each with its batch and index.
        self._ack_sub: Any = None
        #: The client ``_ack_sub`` was made on: a new client gets a subscription again.
        self._ack_client: Any = None
        self._ack_prefix = ""
        self._ack_numbers = itertools.count()
        self._awaiting: dict[str, tuple[_Batch, int]] = {}

    def __repr__(self) -> str:
        return f"NatsJetStreamBroker({redact_url(self.url)!r})"

    @property
    def url(self) -> str:
        return self.connection.url

    @property
    def create_streams(self) -> bool:
        """Whether a subject no stream captures gets a stream of its own."""
        return self.connection.create_streams

    @create_streams.setter
    def create_streams(self, value: bool) -> None:
        self.connection.create_streams = value

    @property
    def ack_timeout_seconds(self) -> float:
        return self.connection.ack_timeout_seconds

    @property
    def dedup_window_seconds(self) -> float:
        return self.connection.dedup_window_seconds

    @property
    def acks_awaited(self) -> int:
        """Published messages whose JetStream ack has not come yet (0 between calls)."""
        return len(self._awaiting)

    @property
    def ack_subscription(self) -> Any:
        """The subscription the acks of every publish come to (None before connect)."""
        return self._ack_sub

    @property
    def ack_subject_prefix(self) -> str:
        """The prefix of the reply subjects of this broker's publishes."""
        return self._ack_prefix

    def configure(self, *, dedup_window_seconds: float) -> None:
        self.connection.configure(dedup_window_seconds=dedup_window_seconds)

    async def connect(self) -> None:
        connection = self.connection
        await connection.connect()
        if self._ack_sub is not None and self._ack_client is connection.client:
            return
        async with self._lock:
            nc = connection.client
            if self._ack_sub is not None and self._ack_client is nc:
                return
            # One wildcard subscription receives the acks of every publish.
            self._awaiting = {}
            prefix = nc.new_inbox() + "."
            try:
                self._ack_sub = await nc.subscribe(prefix + "*", cb=self._on_ack)
            except Exception as exc:
                raise connection.unavailable(exc) from exc
            self._ack_prefix, self._ack_client = prefix, nc

    async def _on_ack(self, msg: Any) -> None:
        """A reply to one published message: record its outcome in its batch."""
        entry = self._awaiting.pop(msg.subject, None)
        if entry is None:
            return  # the batch gave up on it (timeout, cancelled) or a stray reply
        batch, index = entry
        error = ack_error(msg)
        if error is not None:
            batch.errors[index] = error
        batch.waiting -= 1
        if batch.waiting <= 0 and not batch.done.done():
            batch.done.set_result(None)

    async def aclose(self) -> None:
        sub, self._ack_sub, self._ack_client = self._ack_sub, None, None
        self._awaiting = {}
        if sub is not None and not self.connection.owns_client:
            # A client of the caller's stays open: leave no subscription behind on it.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.connection.aclose()

    async def ping(self) -> None:
        await self.connection.ping()

    async def ensure_stream(self, subject: str, *, dead_letter: bool = False) -> None:
        """Make sure a JetStream stream captures ``subject`` (``NatsConnection``)."""
        await self.connection.ensure_stream(subject, dead_letter=dead_letter)

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        if not batch:
            return []
        await self.connect()
        if self.envelope_format.enabled:
            batch = [to_envelope(e, self.envelope_format) for e in batch]
        connection = self.connection
        connection.ensure_connected()
        results: PublishResults = [None] * len(batch)
        await self._check_subjects(batch, results)
        # Subjects a stream captured when this call began: for them "no responders" means
        # the stream went away mid-call (an outage), whatever a concurrent call of another
        # worker did to the connection's known streams meanwhile.
        captured = {e.stream for e in batch if connection.stream_known(e.stream)}
        acks = _Batch(len(batch), asyncio.get_running_loop())
        sent: dict[int, str] = {}  # index -> reply subject
        try:
            await self._send(batch, results, acks, sent)
            if sent:
                await self._settle(batch, results, acks, sent, captured)
            return results
        finally:
            # However this ends — an ack timeout, a refusal, or the caller's own timeout
            # cancelling this task — no reply subject of this call stays registered: a late
            # ack finds nothing and is dropped.
            for reply in sent.values():
                self._awaiting.pop(reply, None)

    async def _check_subjects(self, batch: Sequence[Envelope], results: PublishResults) -> None:
        """Fail the messages of a subject NATS refuses, or that no stream captures and none
        can be created for; make sure a stream captures every other subject."""
        for subject in {e.stream for e in batch}:
            error: exceptions.MessageRejected | None = None
            if invalid_subject(subject):
                error = exceptions.MessageRejected(f"invalid NATS subject {subject!r}")
            else:
                try:
                    await self.connection.ensure_stream(subject)
                except exceptions.MessageRejected as exc:
                    error = exc
            if error is not None:
                for i, e in enumerate(batch):
                    if e.stream == subject:
                        results[i] = error

    async def _send(
        self,
        batch: Sequence[Envelope],
        results: PublishResults,
        acks: _Batch,
        sent: dict[int, str],
    ) -> None:
        """Write every message not failed yet, each with a reply subject of its own
        registered in ``_awaiting`` (and in ``sent``) before it goes out; one flush."""
        connection = self.connection
        nc = connection.client
        limit = nc.max_payload
        nc_publish = nc.publish
        raw = connection.command_buffer
        if raw is not None and (nc.is_closed or nc.is_draining_pubs):
            raise connection.unavailable("connection closed or draining")
        awaiting = self._awaiting
        prefix = self._ack_prefix
        numbers = self._ack_numbers
        for i, e in enumerate(batch):
            if results[i] is not None:
                continue
            headers = publish_headers(e)
            if exceeds_max_payload(e, headers, limit):
                results[i] = exceptions.MessageRejected(
                    f"message {e.id} ({wire_size(e.payload, headers)} bytes) exceeds "
                    f"the NATS server's max_payload of {limit} bytes"
                )
                continue
            reply = f"{prefix}{next(numbers)}"
            # Registered before the publish: a publish that flushes may let acks in.
            awaiting[reply] = (acks, i)
            acks.waiting += 1
            sent[i] = reply
            try:
                if raw is None:
                    await nc_publish(e.stream, e.payload, reply=reply, headers=headers)
                else:
                    await raw[0](hpub_command(e.stream, reply, headers, e.payload))
            except Exception as exc:
                if is_unreachable(exc, request=False):
                    raise connection.unavailable(exc) from exc
                del sent[i]
                if awaiting.pop(reply, None) is not None:
                    acks.waiting -= 1
                if refusal_reason(exc, stream_known=True) is not None:
                    raise connection.refusing(exc) from exc
                results[i] = exceptions.MessageRejected(f"NATS refused message {e.id}: {exc}")
        if sent and raw is not None:
            await raw[1]()  # wake nats-py's flusher: the batch goes out at once

    async def _settle(
        self,
        batch: Sequence[Envelope],
        results: PublishResults,
        acks: _Batch,
        sent: dict[int, str],
        captured: set[str],
    ) -> None:
        """Wait for the acks of ``sent`` (up to ``ack_timeout_seconds``) and record each
        message's outcome: BrokerTimeout when none came, BrokerRefusing when JetStream
        refuses every message, else a MessageRejected per message refused or unanswered."""
        connection = self.connection
        timeout = connection.ack_timeout_seconds
        if acks.waiting > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(acks.done, timeout)
        missing = [i for i, reply in sent.items() if reply in self._awaiting]
        if len(missing) == len(sent):
            # No ack at all: a frozen server, or a batch JetStream never answers
            # (the relay pings to tell which).
            raise exceptions.BrokerTimeout(
                f"NATS at {redact_url(self.url)}: no ack for {len(sent)} messages in {timeout}s"
            )
        for i in missing:
            results[i] = exceptions.MessageRejected(
                f"no JetStream ack for message {batch[i].id} within {timeout}s"
            )
        for i in sent:
            error = acks.errors[i]
            if error is None:
                continue
            subject = batch[i].stream
            reason = refusal_reason(error, stream_known=subject in captured)
            # The stream may have been deleted: look it up (or create it) again next time.
            connection.forget_stream(subject)
            if reason is not None:
                raise connection.refusing(reason)
            results[i] = exceptions.MessageRejected(
                f"JetStream refused message {batch[i].id} on subject {subject!r}: "
                f"{type(error).__name__}: {error or 'no stream captures it'}"
            )

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
