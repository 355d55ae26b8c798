"""Errors raised by fastapi-outbox.

Every error explains itself: the class docstring is the default message, and the
errors raised by the library name the setting, broker, table or message id involved.

::

    OutboxError
    ├── ConfigurationError          bad settings, table name, broker URL
    ├── EventDefinitionError        an Event subclass declared wrongly (e.g. no stream)
    ├── PublishError                uow.publish() refused the event, nothing was written
    │   ├── UnknownBroker           no broker of that name is configured
    │   ├── SerializationError      the payload or headers are not JSON-serialisable
    │   ├── UnstorableText          a string (payload, header, key, stream, type) holds NUL
    │   │                           or an unpaired surrogate: no database can commit it
    │   └── PayloadTooLarge         the encoded payload exceeds max_payload_bytes
    ├── UnitOfWorkError             the unit of work was used wrongly (closed, nested, no outbox)
    │   └── CommitOutcomeUnknown    the connection died during COMMIT: committed or not, only
    │                               the database knows
    ├── HandlerEscaped              a handler raised a BaseException (a cancellation not the
    │                               subscriber's, a BaseException subclass): a failure
    ├── BrokerError                 raised by brokers
    │   ├── BrokerUnavailable       the broker cannot be reached: back off as a whole
    │   │   └── BrokerRefusing      it answers but refuses every message for a reason of its
    │   │                           own (out of memory, read-only replica, loading, JetStream
    │   │                           without resources or leader): an outage, not the message
    │   └── AuthenticationFailed    it refuses this process's credentials (a wrong or rotated
    │                               password, a user without access): retried slowly, reported
    │                               as "authentication failed", never as "unreachable"
    │   └── BrokerTimeout           a publish got no answer in time; the relay pings the
    │                               broker to tell an outage from a message that hangs
    │   └── MessageRejected         the broker refused one message: retry that message only
    ├── PayloadUnreadable           a delivered payload cannot be restored (tampered with,
    │   │                           sealed for another message): dead-lettered, not retried
    │   └── UnknownEncryptionKey    its encryption key id is not among this process's keys
    ├── MessageNotFound             an admin command named a message id that does not exist
    ├── OperationError              an operator's request is malformed (a filter, a limit)
    │   └── StaleDeadLetters        a replay of dead letters older than the inbox retention,
    │                               not forced: other groups would handle them again
    └── TooLate                     a cancel came after a relay claimed the message
"""

from __future__ import annotations

from fastapi_outbox.redaction import redact

__all__ = [
    "AuthenticationFailed",
    "BrokerError",
    "BrokerRefusing",
    "BrokerTimeout",
    "BrokerUnavailable",
    "CommitOutcomeUnknown",
    "ConfigurationError",
    "EventDefinitionError",
    "HandlerEscaped",
    "MessageNotFound",
    "MessageRejected",
    "OperationError",
    "OutboxError",
    "PayloadTooLarge",
    "PayloadUnreadable",
    "PublishError",
    "SerializationError",
    "StaleDeadLetters",
    "TooLate",
    "UnitOfWorkError",
    "UnknownBroker",
    "UnknownEncryptionKey",
    "UnknownTenant",
    "UnstorableText",
]


class OutboxError(Exception):
    """An error in fastapi-outbox. Its message goes through
    `fastapi_outbox.redaction.redact`: an error quoting a driver's text or a URL
    never carries a credential, wherever it is shown."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(redact(message) if message else (type(self).__doc__ or "").strip())


class ConfigurationError(OutboxError, ValueError):
    """The outbox is configured wrongly."""


class EventDefinitionError(OutboxError, TypeError):
    """An Event subclass is declared wrongly."""


class PublishError(OutboxError, ValueError):
    """The event cannot be published; nothing was written."""


class UnknownBroker(PublishError):
    """No broker of that name is configured."""


class UnknownTenant(OutboxError):
    """A multi-tenant outbox was asked for a tenant it does not serve (or for none):
    refused before anything is written."""


class SerializationError(PublishError):
    """The event payload or headers cannot be serialised to JSON."""


class UnstorableText(PublishError):
    """A string of the event holds a character that cannot be committed: NUL (U+0000),
    which PostgreSQL refuses in text and JSON, or an unpaired surrogate (U+D800-U+DFFF),
    which is not Unicode text. Raised by ``publish()``, so the caller's transaction is
    intact; ``field`` names the string (``payload.items[2].name``, ``headers['x-tenant']``,
    ``key``, ``stream``, ``type``)."""

    def __init__(self, message: str | None = None, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class PayloadTooLarge(PublishError):
    """The encoded event payload is larger than max_payload_bytes."""


class UnitOfWorkError(OutboxError, RuntimeError):
    """The unit of work was used outside its transaction."""


class CommitOutcomeUnknown(UnitOfWorkError):
    """The connection was lost while COMMIT was on its way: the database may have committed
    the transaction or not, and no answer came back to tell. Nothing is retried for you:
    look the business rows up (by a key of your own) before doing the work again, or make
    the work idempotent; the outbox's events are exactly what the database holds (committed
    with the rows, or not at all)."""


class HandlerEscaped(OutboxError):
    """A subscriber's handler raised a ``BaseException`` that is not an ``Exception``: an
    ``asyncio.CancelledError`` that is not the subscriber's own stop (a task the handler
    awaited was cancelled), ``GeneratorExit`` or a ``BaseException`` subclass of its own.
    It is a failure of that message like any other (retried, then dead-lettered), never a
    stop of the worker or of the process; ``KeyboardInterrupt`` and ``SystemExit`` still
    stop the process."""


class BrokerError(OutboxError):
    """The broker failed."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached; the relay backs off without burning attempts."""


class BrokerRefusing(BrokerUnavailable):
    """The broker answers but refuses every message for a reason of its own (out of memory,
    read-only replica, still loading, JetStream without resources or leader): the relay
    backs off as a whole, attempts refunded, and resumes by itself."""


class AuthenticationFailed(BrokerUnavailable):
    """The broker refused this process's credentials (Redis ``WRONGPASS`` / ``NOAUTH``,
    NATS "Authorization Violation", RabbitMQ ``ACCESS_REFUSED``): fix the user and password
    in the broker URL. Nothing is charged to a message; the relays and subscribers keep
    trying at their slowest pace, since a rotated secret may come back, and report
    "authentication failed" meanwhile. The CLI exits with code 4."""


class BrokerTimeout(BrokerUnavailable):
    """The broker did not answer a publish in time (a socket read timeout, no ack). The
    relay then pings the broker: no answer is an outage (attempts refunded, the
    relay pauses); an answer means the batch hangs, not the broker, and its messages
    are tried one by one so that the one that hangs is charged on its own."""


class MessageRejected(BrokerError):
    """The broker refused this message; it is retried on its own with backoff."""


class PayloadUnreadable(OutboxError):
    """A delivered payload cannot be restored to the plain event (its ciphertext fails
    authentication, or it was sealed for another message): the message is dead-lettered,
    not retried, since no retry can read it."""


class UnknownEncryptionKey(PayloadUnreadable):
    """A message is encrypted under a key id this process does not hold (add the key to
    ``encryption_keys`` of every consumer before any producer encrypts with it)."""


class MessageNotFound(OutboxError, LookupError):
    """No outbox message has that id."""


class OperationError(OutboxError, ValueError):
    """An operator's request (CLI or dashboard) is malformed."""


class TooLate(OutboxError, RuntimeError):
    """The message was claimed (or published) before it could be cancelled."""


class StaleDeadLetters(OperationError):
    """Dead letters older than ``inbox_retention_seconds``: the other groups' inbox rows of
    these messages may have been deleted, so putting them back on the stream would have
    those groups handle them a second time. Replayed only when forced."""
