"""``NatsConnection``: the NATS client and JetStream context a NATS publisher and its
consumers share, and the streams both need to exist.

It owns the client (made from the URL on ``connect``, bounded and reconnecting, or the
caller's, which it never closes), the JetStream context, nats-py's command buffer (used by
the publisher's ``HPUB`` batches and the consumer's acks), the JetStream streams found or
created (``ensure_stream``, with the limits and replicas of the broker's options; a warning
when a cluster gets single-replica streams) and the translation
of a client failure into [`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable] /
``BrokerRefusing``. The publisher and the consumer each receive this object and never
read each other (faststream's ``redis/configs/state.py`` is the example).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.nats.wire import (
    is_authentication_failure,
    is_unreachable,
    refusal_reason,
    stream_name_for,
)
from fastapi_outbox.log import safe_error
from fastapi_outbox.redaction import redact_url, split_url_list

__all__ = [
    "ACK_TIMEOUT_SECONDS",
    "CONNECT_TIMEOUT_SECONDS",
    "DEDUP_WINDOW_SECONDS",
    "JS_API_INFO",
    "MAX_OUTSTANDING_PINGS",
    "PING_INTERVAL_SECONDS",
    "RECONNECT_WAIT_SECONDS",
    "STREAM_MAX_AGE_SECONDS",
    "STREAM_MAX_BYTES",
    "NatsConnection",
]

logger = logging.getLogger("fastapi_outbox.brokers.nats")

#: Without an Outbox to configure it: lease + longest backoff + dedup_outage_seconds + margin
#: of the default settings (30 + 300 + 4 h + 60 s).
DEDUP_WINDOW_SECONDS = 14_790.0
#: Limits of the streams the broker creates (an unbounded stream grows until the disk is
#: full): messages older than this are removed...
STREAM_MAX_AGE_SECONDS = 7 * 24 * 3600.0
#: ...and the oldest go once the stream holds this many bytes (JetStream's "discard old").
STREAM_MAX_BYTES = 1024**3
#: Longest wait for a JetStream API answer (a publish's ack, a stream lookup, a fetch's
#: request): the JetStream context's timeout.
ACK_TIMEOUT_SECONDS = 10.0
#: Longest wait for a server's INFO on connect and on every reconnect attempt: a frozen
#: node accepts the TCP connection (its kernel does) and never answers, so this bounds the
#: time spent on it before the next node is tried.
CONNECT_TIMEOUT_SECONDS = 2.0
#: The client PINGs the server this often (nats-py's default is 2 minutes)...
PING_INTERVAL_SECONDS = 2.0
#: ...and leaves it (reconnects to another node) when this many PINGs are unanswered: a
#: server that stops answering (frozen, a network cut without a reset) is left within
#: ``PING_INTERVAL_SECONDS * (MAX_OUTSTANDING_PINGS + 1)`` = 6 s, on a connection the
#: library uses or not.
MAX_OUTSTANDING_PINGS = 2
#: The JetStream account-info request: the broker's ping (a round trip through JetStream).
JS_API_INFO = "$JS.API.INFO"
#: Seconds between reconnect attempts of an established connection.
RECONNECT_WAIT_SECONDS = 0.5


def _close_failed_attempt(nc: Any) -> None:
    """Close the socket of a reconnect attempt that failed. nats-py reuses its transport
    object for the next attempt and overwrites the socket without closing it: a frozen
    node (the TCP connection accepted by its kernel, no INFO within ``connect_timeout``)
    left one open socket per attempt, reported unclosed when collected."""
    transport = getattr(nc, "_transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


class NatsConnection:
    """The NATS client of one broker, shared by its publisher and its consumers."""

    def __init__(
        self,
        url: str = "nats://localhost:4222",
        *,
        client: Any = None,
        create_streams: bool = True,
        dedup_window_seconds: float | None = None,
        ack_timeout_seconds: float = ACK_TIMEOUT_SECONDS,
        connect_timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
        ping_interval_seconds: float = PING_INTERVAL_SECONDS,
        max_outstanding_pings: int = MAX_OUTSTANDING_PINGS,
        stream_config: dict[str, Any] | None = None,
        stream_max_age_seconds: float | None = STREAM_MAX_AGE_SECONDS,
        stream_max_bytes: int | None = STREAM_MAX_BYTES,
        dead_letter_max_age_seconds: float | None = None,
        dead_letter_max_bytes: int | None = None,
        replicas: int = 1,
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 5:
            raise exceptions.ConfigurationError(
                f"NatsJetStreamBroker replicas must be an integer from 1 to 5, not {replicas!r}"
            )
        for timing, seconds in (
            ("ack_timeout_seconds", ack_timeout_seconds),
            ("connect_timeout_seconds", connect_timeout_seconds),
            ("ping_interval_seconds", ping_interval_seconds),
        ):
            if seconds <= 0:
                raise exceptions.ConfigurationError(
                    f"NatsJetStreamBroker {timing} must be > 0, not {seconds!r}"
                )
        pings = max_outstanding_pings
        if isinstance(pings, bool) or not isinstance(pings, int) or pings < 1:
            raise exceptions.ConfigurationError(
                f"NatsJetStreamBroker max_outstanding_pings must be an integer >= 1, "
                f"not {max_outstanding_pings!r}"
            )
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
        self.create_streams = create_streams
        self.ack_timeout_seconds = ack_timeout_seconds
        self.connect_timeout_seconds = connect_timeout_seconds
        self.ping_interval_seconds = ping_interval_seconds
        self.max_outstanding_pings = max_outstanding_pings
        self.stream_config = dict(stream_config or {})
        self.stream_max_age_seconds = stream_max_age_seconds
        self.stream_max_bytes = stream_max_bytes
        self.dead_letter_max_age_seconds = dead_letter_max_age_seconds
        self.dead_letter_max_bytes = dead_letter_max_bytes
        self.replicas = replicas
        self._window = dedup_window_seconds
        self._window_explicit = dedup_window_seconds is not None
        self._nc = client
        self._own_client = client is None
        self._js: Any = None
        self._lock = asyncio.Lock()
        #: Subjects a stream was found (or created) for.
        self._known_subjects: set[str] = set()
        #: nats-py's command buffer and its flush (``_send_command`` / ``_flush_pending``).
        self._buffer: tuple[Any, Any] | None = None
        self._buffer_allowed = True
        #: What the server said when it last refused our login (None: it did not, or the
        #: client connected, or the server could not be reached, since).
        self.refused_login: str | None = None

    def __repr__(self) -> str:
        return f"NatsConnection({redact_url(self.url)!r})"

    # -- options -------------------------------------------------------------------------

    @property
    def dedup_window_seconds(self) -> float:
        """The duplicate window streams need: ``stream_config["duplicate_window"]``, else
        the broker's or the outbox's window."""
        configured = self.stream_config.get("duplicate_window")
        if configured is not None:
            return float(configured)
        return self._window if self._window is not None else DEDUP_WINDOW_SECONDS

    def configure(self, *, dedup_window_seconds: float) -> None:
        """The outbox's de-duplication window, unless the broker was given one."""
        if not self._window_explicit:
            self._window = dedup_window_seconds

    def new_stream_config(self, *, dead_letter: bool = False) -> dict[str, Any]:
        """The ``StreamConfig`` fields of a stream this broker creates (``num_replicas``:
        the broker's ``replicas``, unless ``stream_config`` names it)."""
        config: dict[str, Any] = {
            "duplicate_window": self.dedup_window_seconds,
            "num_replicas": self.replicas,
        }
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

    # -- the client ----------------------------------------------------------------------

    @property
    def server_cluster(self) -> str | None:
        """The name of the cluster the connected server reports (its ``INFO``), None when
        it is a single server or before ``connect``."""
        info = getattr(self._nc, "_server_info", None) if self._nc is not None else None
        if not isinstance(info, dict):
            return None
        cluster = info.get("cluster")
        return cluster if isinstance(cluster, str) and cluster else None

    @property
    def owns_client(self) -> bool:
        """Whether this connection made its client (and closes it)."""
        return self._own_client

    @property
    def client(self) -> Any:
        """The ``nats.aio.client.Client``; BrokerUnavailable before ``connect``."""
        if self._nc is None or self._js is None:
            raise self.unavailable("not connected")
        return self._nc

    @property
    def jetstream(self) -> Any:
        """The JetStream context; BrokerUnavailable before ``connect``."""
        if self._js is None:
            raise self.unavailable("not connected")
        return self._js

    @property
    def command_buffer(self) -> tuple[Any, Any] | None:
        """nats-py's ``(send command, flush)``: commands written there whole and flushed
        once, without the per-message work of ``publish``. None when the client lacks them
        (or after ``use_client_publish``): callers use the client's own methods."""
        return self._buffer if self._buffer_allowed else None

    def use_client_publish(self) -> None:
        """Never write to nats-py's command buffer: publish and ack through the client's
        own methods (what a client without that buffer gets)."""
        self._buffer_allowed = False

    async def connect(self) -> None:
        """Connect (unless connected) and make the JetStream context; idempotent.
        BrokerUnavailable when NATS cannot be reached within ``connect_timeout_seconds``."""
        if self._js is not None:
            return
        async with self._lock:
            if self._js is not None:
                return
            if self._nc is None:
                self._nc = await self._open_client()
                self.refused_login = None
            self._js = self._nc.jetstream(timeout=self.ack_timeout_seconds)
            send = getattr(self._nc, "_send_command", None)
            flush = getattr(self._nc, "_flush_pending", None)
            self._buffer = (
                (send, flush)
                if inspect.iscoroutinefunction(send) and inspect.iscoroutinefunction(flush)
                else None
            )
            logger.info(
                "nats broker connected",
                extra={"action": "broker.connect", "broker_url": redact_url(self.url)},
            )

    async def _open_client(self) -> Any:
        import nats.aio.client

        async def on_error(exc: Exception) -> None:
            # nats-py retries a refused login until the connect times out: what the server
            # said is only seen here, and decides what the timeout means.
            if is_authentication_failure(exc):
                self.refused_login = f"{type(exc).__name__}: {exc}"
            elif isinstance(exc, ConnectionRefusedError):
                # The server is gone: no longer a refused login. Not any OSError: a server
                # that refused the login closes the connection, and the next attempt may
                # meet that close (a reset) before the refusal — still a refused login.
                self.refused_login = None
            logger.debug(
                "nats client error",
                extra={"action": "broker.error", "error": safe_error(exc)},
            )
            # CONNECTING while an attempt waits for the server's INFO, RECONNECTING between.
            if nc.is_connecting or nc.is_reconnecting:
                _close_failed_attempt(nc)

        # Every liveness setting is the library's, never nats-py's default (a 2-minute ping
        # interval left a frozen node's clients stalled): see the constants above.
        # max_reconnect_attempts=-1 keeps an established connection coming back, but
        # nats-py applies it to the first connect too, which then retries forever: a
        # relay starting while NATS is down would hang instead of reporting the broker
        # unavailable. The first connect is bounded here.
        nc: Any = nats.aio.client.Client()
        timeout = self.connect_timeout_seconds
        try:
            await asyncio.wait_for(
                nc.connect(
                    # A comma-separated list: nats-py takes a list of servers.
                    servers if len(servers := split_url_list(self.url)) > 1 else self.url,
                    connect_timeout=timeout,
                    ping_interval=self.ping_interval_seconds,
                    max_outstanding_pings=self.max_outstanding_pings,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=RECONNECT_WAIT_SECONDS,
                    error_cb=on_error,
                ),
                timeout=timeout,
            )
        except Exception as exc:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout=timeout)
            if isinstance(exc, TimeoutError):
                raise self.unavailable(f"no connection within {timeout:g}s") from exc
            raise self.unavailable(exc) from exc
        return nc

    def ensure_connected(self) -> None:
        """BrokerUnavailable while the client is reconnecting (after ``connect``)."""
        if not self.client.is_connected:
            raise self.unavailable("connection lost, reconnecting")

    async def aclose(self) -> None:
        """Close the client this connection made (a caller's client stays open);
        idempotent. The next ``connect`` connects again."""
        nc, self._js = self._nc, None
        if not self._own_client:
            return
        self._nc = None
        if nc is not None and not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), timeout=self.connect_timeout_seconds)
            except Exception:  # closing a dead connection must not fail shutdown
                logger.debug("nats close failed", exc_info=True)

    async def ping(self) -> None:
        """BrokerUnavailable unless JetStream answers an account-info request."""
        await self.connect()
        self.ensure_connected()
        try:
            # A JetStream round trip, not a core PING: the relay pings after a publish
            # timed out to tell an outage from a message that hangs, and JetStream may stop
            # answering while the server still answers PINGs. And nats-py's ``flush`` left
            # a cancelled PONG future behind when cut short, which kills its read loop when
            # the late PONG comes; a request's reply slot is dropped when it is given up.
            await self._nc.request(JS_API_INFO, b"", timeout=self.connect_timeout_seconds)
        except Exception as exc:
            raise self.unavailable(exc) from exc

    def unavailable(self, exc: BaseException | str) -> exceptions.BrokerUnavailable:
        """The outage ``exc`` (a client failure, or a description) means, naming the
        server (credentials redacted): AuthenticationFailed when the server refused the
        credentials (in ``exc`` or, since a connect times out on it, the last login)."""
        detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        refused = self.refused_login
        if refused is None and is_authentication_failure(exc):
            refused = detail
        if refused is not None and (self._nc is None or not self._nc.is_connected):
            return exceptions.AuthenticationFailed(
                f"NATS at {redact_url(self.url)}: authentication failed ({refused}): check "
                "the user and password (or token) of the URL"
            )
        return exceptions.BrokerUnavailable(
            f"NATS at {redact_url(self.url)} is unreachable: {detail}"
        )

    def refusing(self, reason: object, what: str = "messages") -> exceptions.BrokerRefusing:
        """The outage a broker-wide refusal (``wire.refusal_reason``) means."""
        return exceptions.BrokerRefusing(f"NATS at {redact_url(self.url)} refuses {what}: {reason}")

    # -- streams -------------------------------------------------------------------------

    def stream_known(self, subject: str) -> bool:
        """Whether a stream was found (or created) for ``subject``."""
        return subject in self._known_subjects

    def forget_stream(self, subject: str) -> None:
        """Look the stream of ``subject`` up again next time (it may have gone)."""
        self._known_subjects.discard(subject)

    async def ensure_stream(self, subject: str, *, dead_letter: bool = False) -> None:
        """Make sure a JetStream stream captures ``subject`` (create one if allowed;
        ``dead_letter``: a dead-letter stream, without the limits of the others).

        Any of its JetStream API calls timing out or finding no responder means the
        server cannot be reached: BrokerUnavailable, so no message is charged for it."""
        if subject in self._known_subjects:
            return
        import nats.js.errors

        try:
            await self._ensure_stream(subject, dead_letter=dead_letter)
        except Exception as exc:
            if is_unreachable(exc):
                raise self.unavailable(exc) from exc
            if isinstance(exc, nats.js.errors.APIError):
                reason = refusal_reason(exc, stream_known=True)
                if reason is not None:
                    raise self.refusing(reason) from exc
            raise

    async def _ensure_stream(self, subject: str, *, dead_letter: bool = False) -> None:
        import nats.js.errors

        js = self.jetstream
        try:
            name = await js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            name = None
        if name is None:
            if not self.create_streams:
                return  # the publish fails with "no stream", naming the subject
            await self._create_stream(js, subject, dead_letter=dead_letter)
        else:
            info = await js.stream_info(name)
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
            wanted = int(self.new_stream_config(dead_letter=dead_letter)["num_replicas"])
            found = int(info.config.num_replicas or 1)
            if found < wanted:
                logger.warning(
                    "jetstream stream has fewer replicas than the broker asks for",
                    extra={
                        "action": "broker.replicas_short",
                        "stream": name,
                        "replicas": found,
                        "needed_replicas": wanted,
                    },
                )
        self._known_subjects.add(subject)

    async def _create_stream(self, js: Any, subject: str, *, dead_letter: bool) -> None:
        import nats.js.errors

        name = stream_name_for(subject)
        config = self.new_stream_config(dead_letter=dead_letter)
        replicas = int(config["num_replicas"])
        if replicas == 1 and self.server_cluster is not None:
            logger.warning(
                "jetstream stream created with one replica on a cluster",
                extra={
                    "action": "broker.single_replica",
                    "stream": name,
                    "cluster": self.server_cluster,
                },
            )
        try:
            await js.add_stream(name=name, subjects=[subject], **config)
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
                "replicas": replicas,
            },
        )
