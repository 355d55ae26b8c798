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
import inspect
import itertools
import json
import logging
import re
from collections.abc import Sequence
from typing import Any, Self

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import PublishResults, redact_url
from fastapi_outbox.brokers.nats.wire import (
    KEY_HEADER,
    MSG_ID_HEADER,
    refusal_reason,
    stream_name_for,
)
from fastapi_outbox.events import Envelope
from fastapi_outbox.log import safe_error
from fastapi_outbox.redaction import split_url_list

logger = logging.getLogger("fastapi_outbox.brokers.nats")

#: Without an Outbox to configure it: lease + longest backoff + dedup_outage_seconds + margin
#: of the default settings (30 + 300 + 4 h + 60 s).
DEDUP_WINDOW_SECONDS = 14_790.0
#: Limits of the streams the broker creates (an unbounded stream grows until the disk is
#: full): messages older than this are removed...
STREAM_MAX_AGE_SECONDS = 7 * 24 * 3600.0
#: ...and the oldest go once the stream holds this many bytes (JetStream's "discard old").
STREAM_MAX_BYTES = 1024**3
ACK_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 2.0
#: The JetStream account-info request: the broker's ping (a round trip through JetStream).
JS_API_INFO = "$JS.API.INFO"
#: Bytes reserved for the protocol line and headers when checking max_payload.
_HEADER_OVERHEAD = 64
#: Status header of a "no responders" reply.
NO_RESPONDERS_STATUS = "503"


def _wire_size(payload: bytes, headers: dict[str, str]) -> int:
    """Bytes of a message with ``headers`` as NATS sends them (``Name: value\\r\\n``)."""
    return len(payload) + sum(len(f"{k}: {v}\r\n".encode()) for k, v in headers.items())


#: What NATS refuses in a subject (CR/LF would inject protocol commands).
_SUBJECT_INVALID = re.compile(r"[ \t\r\n]")
#: Header names NATS accepts (RFC 7230 tokens), and the CR/LF a value must not carry: the
#: rules nats-py applies to the headers of ``publish``.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
#: Header names already checked against ``_HEADER_NAME`` (bounded: names are few).
_checked_names: set[str] = set()
_CHECKED_NAMES_MAX = 1024


def _header_block(headers: dict[str, str]) -> bytes:
    """``headers`` as the header block of an ``HPUB`` (``NATS/1.0``, ``Name: value`` lines,
    an empty line), with nats-py's rules: names trimmed, empty ones skipped, others checked
    to be tokens; values trimmed and CR/LF replaced by spaces. ValueError names a bad
    header name."""
    lines = ["NATS/1.0\r\n"]
    for name, value in headers.items():
        if name not in _checked_names:
            name = name.strip()
            if not name:
                continue
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"invalid NATS header name {name!r}")
            if len(_checked_names) < _CHECKED_NAMES_MAX:
                _checked_names.add(name)
        lines.append(f"{name}: {value.strip().translate(_VALUE_NEWLINES)}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode()


def _too_large(e: Envelope, headers: dict[str, str], limit: int) -> bool:
    """Whether ``e`` exceeds the server's ``max_payload``. Cheap for the usual message:
    the stored headers' JSON text bounds their wire form (``"k":"v",`` is longer than
    ``k: v\\r\\n``; x4 covers any UTF-8 encoding), so the exact size is computed only
    near the limit."""
    bound = len(e.payload) + _HEADER_OVERHEAD + 4 * (len(e.headers_json) + len(e.id) + 64)
    if e.key is not None:
        bound += 4 * len(e.key)
    if bound <= limit:
        return False
    return _wire_size(e.payload, headers) + _HEADER_OVERHEAD > limit


def _ack_error(msg: Any) -> BaseException | None:
    """The error a JetStream publish reply carries, or None for an ack.

    A 503 status (no responders: no stream captures the subject) is a
    ``NoStreamResponseError``; a JSON ``{"error": ...}`` the matching ``APIError`` (503:
    ``ServiceUnavailableError`` and so on, as nats-py builds it); an ack is JSON with a
    ``stream`` and a ``seq``. Anything else (a reply from something that is not
    JetStream) is an error too, never a silent success."""
    import nats.js.errors

    data = msg.data
    # The usual ack, without a JSON decode: ``{"stream":"orders","seq":42}``.
    if data[:10] == b'{"stream":' and b'"error"' not in data:
        return None
    headers = msg.headers
    if headers and headers.get("Status") == NO_RESPONDERS_STATUS and not data:
        return nats.js.errors.NoStreamResponseError()
    try:
        reply = json.loads(data)
    except ValueError:
        reply = None
    if isinstance(reply, dict):
        error = reply.get("error")
        if isinstance(error, dict):
            try:
                nats.js.errors.APIError.from_error(error)  # raises the matching class
            except nats.js.errors.APIError as exc:
                return exc
            except Exception:  # a malformed error object
                pass
            return nats.js.errors.APIError(description=str(error)[:200])
        if "stream" in reply and "seq" in reply:
            return None
    status = headers.get("Status") if headers else None
    return nats.js.errors.APIError(
        code=int(status) if status and status.isdigit() else None,
        description=f"unexpected reply to a JetStream publish: {bytes(data[:100])!r}",
    )


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
        self,
        url: str = "nats://localhost:4222",
        *,
        client: Any = None,
        create_streams: bool = True,
        dedup_window_seconds: float | None = None,
        ack_timeout_seconds: float = ACK_TIMEOUT_SECONDS,
        connect_timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
        stream_config: dict[str, Any] | None = None,
        stream_max_age_seconds: float | None = STREAM_MAX_AGE_SECONDS,
        stream_max_bytes: int | None = STREAM_MAX_BYTES,
        dead_letter_max_age_seconds: float | None = None,
        dead_letter_max_bytes: int | None = None,
    ) -> None:
        """``stream_max_age_seconds`` / ``stream_max_bytes``: limits of the streams this
        broker creates (``None``: unlimited); ``stream_config``: any other
        ``StreamConfig`` field, which wins over both. The dead-letter streams the
        consumers create have no age or size limit (a dead letter waits for an operator)
        unless ``dead_letter_max_age_seconds`` / ``dead_letter_max_bytes`` set one."""
        for option, value in (
            ("stream_max_age_seconds", stream_max_age_seconds),
            ("stream_max_bytes", stream_max_bytes),
            ("dead_letter_max_age_seconds", dead_letter_max_age_seconds),
            ("dead_letter_max_bytes", dead_letter_max_bytes),
        ):
            if value is not None and value <= 0:
                raise exceptions.ConfigurationError(
                    f"NatsJetStreamBroker {option} must be > 0 or None, not {value!r}"
                )
        self.url = url
        self.stream_max_age_seconds = stream_max_age_seconds
        self.stream_max_bytes = stream_max_bytes
        self.dead_letter_max_age_seconds = dead_letter_max_age_seconds
        self.dead_letter_max_bytes = dead_letter_max_bytes
        self.create_streams = create_streams
        self.ack_timeout_seconds = ack_timeout_seconds
        self.stream_config = dict(stream_config or {})
        self._connect_timeout = connect_timeout_seconds
        self._window = dedup_window_seconds
        self._window_explicit = dedup_window_seconds is not None
        self._nc = client
        self._own_client = client is None
        self._js: Any = None
        self._known_subjects: set[str] = set()
        self._lock = asyncio.Lock()
        # Acks: the reply subjects of the messages in flight, each with its batch and index.
        self._ack_sub: Any = None
        self._ack_prefix = ""
        self._ack_numbers = itertools.count()
        self._awaiting: dict[str, tuple[_Batch, int]] = {}
        #: nats-py's command buffer and its flush (``_send_command`` / ``_flush_pending``):
        #: a batch's ``HPUB`` commands are written there whole and flushed once, without the
        #: per-message work of ``publish``. None: that client lacks them, ``publish`` is used.
        self._raw: tuple[Any, Any] | None = None

    def __repr__(self) -> str:
        return f"NatsJetStreamBroker({redact_url(self.url)!r})"

    @property
    def dedup_window_seconds(self) -> float:
        configured = self.stream_config.get("duplicate_window")
        if configured is not None:
            return float(configured)
        return self._window if self._window is not None else DEDUP_WINDOW_SECONDS

    def _new_stream_config(self, *, dead_letter: bool = False) -> dict[str, Any]:
        config: dict[str, Any] = {"duplicate_window": self.dedup_window_seconds}
        if dead_letter:
            # Kept until replayed or removed, unless limits were asked for: the other
            # fields of ``stream_config`` (storage, replicas) apply, not its limits.
            limits = ("max_age", "max_bytes", "max_msgs", "max_msgs_per_subject")
            config.update((k, v) for k, v in self.stream_config.items() if k not in limits)
            if self.dead_letter_max_age_seconds is not None:
                config["max_age"] = self.dead_letter_max_age_seconds
                # JetStream refuses a duplicate window longer than the stream's max age.
                config["duplicate_window"] = min(config["duplicate_window"], config["max_age"])
            if self.dead_letter_max_bytes is not None:
                config["max_bytes"] = self.dead_letter_max_bytes
            return config
        if self.stream_max_age_seconds is not None:
            config["max_age"] = self.stream_max_age_seconds
            # JetStream refuses a duplicate window longer than the stream's max age.
            config["duplicate_window"] = min(self.dedup_window_seconds, config["max_age"])
        if self.stream_max_bytes is not None:
            config["max_bytes"] = self.stream_max_bytes
        return {**config, **self.stream_config}

    def configure(self, *, dedup_window_seconds: float) -> None:
        if not self._window_explicit:
            self._window = dedup_window_seconds

    def _unavailable(self, exc: BaseException | str) -> exceptions.BrokerUnavailable:
        detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        return exceptions.BrokerUnavailable(
            f"NATS at {redact_url(self.url)} is unreachable: {detail}"
        )

    async def connect(self) -> None:
        if self._js is not None:
            return
        async with self._lock:
            if self._js is not None:
                return
            import nats.aio.client

            if self._nc is None:

                async def on_error(exc: Exception) -> None:
                    logger.debug(
                        "nats client error",
                        extra={"action": "broker.error", "error": safe_error(exc)},
                    )

                # max_reconnect_attempts=-1 keeps an established connection coming back,
                # but nats-py applies it to the first connect too, which then retries
                # forever: a dispatcher starting while NATS is down would hang instead of
                # reporting the broker unavailable. The first connect is bounded here.
                nc: Any = nats.aio.client.Client()
                try:
                    await asyncio.wait_for(
                        nc.connect(
                            # A comma-separated list: nats-py takes a list of servers.
                            servers if len(servers := split_url_list(self.url)) > 1 else self.url,
                            connect_timeout=self._connect_timeout,
                            allow_reconnect=True,
                            max_reconnect_attempts=-1,
                            reconnect_time_wait=0.5,
                            error_cb=on_error,
                        ),
                        timeout=self._connect_timeout,
                    )
                except Exception as exc:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(nc.close(), timeout=self._connect_timeout)
                    if isinstance(exc, TimeoutError):
                        detail = f"no connection within {self._connect_timeout:g}s"
                        raise self._unavailable(detail) from exc
                    raise self._unavailable(exc) from exc
                self._nc = nc
            self._js = self._nc.jetstream(timeout=self.ack_timeout_seconds)
            # One wildcard subscription receives the acks of every publish.
            self._awaiting = {}
            self._ack_prefix = self._nc.new_inbox() + "."
            try:
                self._ack_sub = await self._nc.subscribe(self._ack_prefix + "*", cb=self._on_ack)
            except Exception as exc:
                self._js = None
                raise self._unavailable(exc) from exc
            send = getattr(self._nc, "_send_command", None)
            flush = getattr(self._nc, "_flush_pending", None)
            self._raw = (
                (send, flush)
                if inspect.iscoroutinefunction(send) and inspect.iscoroutinefunction(flush)
                else None
            )
            logger.info(
                "nats broker connected",
                extra={"action": "broker.connect", "broker_url": redact_url(self.url)},
            )

    async def _on_ack(self, msg: Any) -> None:
        """A reply to one published message: record its outcome in its batch."""
        entry = self._awaiting.pop(msg.subject, None)
        if entry is None:
            return  # the batch gave up on it (timeout, cancelled) or a stray reply
        batch, index = entry
        error = _ack_error(msg)
        if error is not None:
            batch.errors[index] = error
        batch.waiting -= 1
        if batch.waiting <= 0 and not batch.done.done():
            batch.done.set_result(None)

    async def aclose(self) -> None:
        sub, self._ack_sub = self._ack_sub, None
        self._awaiting = {}
        if sub is not None and not self._own_client:
            # A client of the caller's stays open: leave no subscription behind on it.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        nc, self._nc, self._js = self._nc, None if self._own_client else self._nc, None
        if nc is not None and self._own_client and not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), timeout=self._connect_timeout)
            except Exception:  # closing a dead connection must not fail shutdown
                logger.debug("nats close failed", exc_info=True)

    async def ping(self) -> None:
        await self.connect()
        if not self._nc.is_connected:
            raise self._unavailable("not connected")
        try:
            # A JetStream round trip, not a core PING: the processor pings after a publish
            # timed out to tell an outage from a message that hangs, and JetStream may stop
            # answering while the server still answers PINGs. And nats-py's ``flush`` left
            # a cancelled PONG future behind when cut short, which kills its read loop when
            # the late PONG comes; a request's reply slot is dropped when it is given up.
            await self._nc.request(JS_API_INFO, b"", timeout=self._connect_timeout)
        except Exception as exc:
            raise self._unavailable(exc) from exc

    async def ensure_stream(self, subject: str, *, dead_letter: bool = False) -> None:
        """Make sure a JetStream stream captures ``subject`` (create one if allowed;
        ``dead_letter``: a dead-letter stream, without the limits of the others).

        Any of its JetStream API calls timing out or finding no responder means the
        server cannot be reached: BrokerUnavailable, so no message is charged for it."""
        if subject in self._known_subjects:
            return
        import nats.errors
        import nats.js.errors

        try:
            await self._ensure_stream(subject, dead_letter=dead_letter)
        except (
            nats.errors.TimeoutError,
            nats.errors.ConnectionClosedError,
            nats.errors.NoRespondersError,
        ) as exc:
            raise self._unavailable(exc) from exc
        except nats.js.errors.APIError as exc:
            reason = refusal_reason(exc, stream_known=True)
            if reason is None:
                raise
            raise exceptions.BrokerRefusing(
                f"NATS at {redact_url(self.url)} refuses messages: {reason}"
            ) from exc

    async def _ensure_stream(self, subject: str, *, dead_letter: bool = False) -> None:
        import nats.js.errors

        try:
            name = await self._js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            name = None
        if name is None:
            if not self.create_streams:
                return  # the publish fails with "no stream", naming the subject
            name = stream_name_for(subject)
            config = self._new_stream_config(dead_letter=dead_letter)
            try:
                await self._js.add_stream(name=name, subjects=[subject], **config)
            except nats.js.errors.BadRequestError as exc:
                raise exceptions.MessageRejected(
                    f"cannot create JetStream stream {name!r} for subject {subject!r}: {exc}"
                ) from exc
            logger.info(
                "created jetstream stream",
                extra={
                    "action": "broker.stream_created",
                    "stream": name,
                    "subject": subject,
                    "dead_letter": dead_letter,
                    "duplicate_window_seconds": config["duplicate_window"],
                    "max_age_seconds": config.get("max_age"),
                    "max_bytes": config.get("max_bytes"),
                },
            )
        else:
            info = await self._js.stream_info(name)
            window = info.config.duplicate_window or 0
            if window < self.dedup_window_seconds:
                logger.warning(
                    "jetstream duplicate window shorter than the outbox needs",
                    extra={
                        "action": "broker.dedup_window_short",
                        "stream": name,
                        "duplicate_window_seconds": window,
                        "needed_seconds": self.dedup_window_seconds,
                    },
                )
        self._known_subjects.add(subject)

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        if not batch:
            return []
        await self.connect()
        if not self._nc.is_connected:
            raise self._unavailable("connection lost, reconnecting")
        import nats.errors

        results: PublishResults = [None] * len(batch)
        for subject in {e.stream for e in batch}:
            if not subject or _SUBJECT_INVALID.search(subject):
                bad = exceptions.MessageRejected(f"invalid NATS subject {subject!r}")
                for i, e in enumerate(batch):
                    if e.stream == subject:
                        results[i] = bad
                continue
            try:
                await self.ensure_stream(subject)
            except exceptions.MessageRejected as exc:
                for i, e in enumerate(batch):
                    if e.stream == subject:
                        results[i] = exc
        # Subjects a stream captured when this call began: for them "no responders" means
        # the stream went away mid-call (an outage), whatever a concurrent call of another
        # worker did to ``_known_subjects`` meanwhile.
        captured = {e.stream for e in batch if e.stream in self._known_subjects}
        limit = self._nc.max_payload
        nc_publish = self._nc.publish
        raw = self._raw
        if raw is not None and (self._nc.is_closed or self._nc.is_draining_pubs):
            raise self._unavailable("connection closed or draining")
        awaiting = self._awaiting
        prefix = self._ack_prefix
        numbers = self._ack_numbers
        acks = _Batch(len(batch), asyncio.get_running_loop())
        sent: dict[int, str] = {}  # index -> reply subject
        try:
            for i, e in enumerate(batch):
                if results[i] is not None:
                    continue
                headers = e.headers_dict()
                if e.key is not None:
                    headers[KEY_HEADER] = e.key  # the ordering key, like Redis's ``key`` field
                # Last, so that no user header can replace the de-duplication id.
                headers[MSG_ID_HEADER] = e.id
                if _too_large(e, headers, limit):
                    results[i] = exceptions.MessageRejected(
                        f"message {e.id} ({_wire_size(e.payload, headers)} bytes) exceeds "
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
                        block = _header_block(headers)
                        await raw[0](
                            b"HPUB %b %b %d %d\r\n%b%b\r\n"
                            % (
                                e.stream.encode(),
                                reply.encode(),
                                len(block),
                                len(block) + len(e.payload),
                                block,
                                e.payload,
                            )
                        )
                except (
                    nats.errors.ConnectionClosedError,
                    nats.errors.OutboundBufferLimitError,
                ) as exc:
                    raise self._unavailable(exc) from exc
                except Exception as exc:
                    del sent[i]
                    if awaiting.pop(reply, None) is not None:
                        acks.waiting -= 1
                    if refusal_reason(exc, stream_known=True) is not None:
                        raise exceptions.BrokerRefusing(
                            f"NATS at {redact_url(self.url)} refuses messages: {exc}"
                        ) from exc
                    results[i] = exceptions.MessageRejected(f"NATS refused message {e.id}: {exc}")
            if sent:
                if raw is not None:
                    await raw[1]()  # wake nats-py's flusher: the batch goes out at once
                if acks.waiting > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(acks.done, self.ack_timeout_seconds)
                missing = [i for i, reply in sent.items() if reply in awaiting]
                if len(missing) == len(sent):
                    # No ack at all: a frozen server, or a batch JetStream never answers
                    # (the processor pings to tell which).
                    raise exceptions.BrokerTimeout(
                        f"NATS at {redact_url(self.url)}: no ack for {len(sent)} messages "
                        f"in {self.ack_timeout_seconds}s"
                    )
                for i in missing:
                    results[i] = exceptions.MessageRejected(
                        f"no JetStream ack for message {batch[i].id} "
                        f"within {self.ack_timeout_seconds}s"
                    )
                for i in sent:
                    error = acks.errors[i]
                    if error is None:
                        continue
                    reason = refusal_reason(error, stream_known=batch[i].stream in captured)
                    if reason is not None:
                        # The stream is found (or created) again before the next try.
                        self._known_subjects.discard(batch[i].stream)
                        raise exceptions.BrokerRefusing(
                            f"NATS at {redact_url(self.url)} refuses messages: {reason}"
                        )
                    results[i] = exceptions.MessageRejected(
                        f"JetStream refused message {batch[i].id} on subject "
                        f"{batch[i].stream!r}: {type(error).__name__}: "
                        f"{error or 'no stream captures it'}"
                    )
                    # The stream may have been deleted: look it up again next time.
                    self._known_subjects.discard(batch[i].stream)
            return results
        finally:
            # However this ends — an ack timeout, a refusal, or the caller's own timeout
            # cancelling this task — no reply subject of this call stays registered: a late
            # ack finds nothing and is dropped.
            for reply in sent.values():
                awaiting.pop(reply, None)

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
