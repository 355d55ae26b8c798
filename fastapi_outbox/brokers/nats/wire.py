"""What the NATS publisher and consumer agree on about JetStream: the header names and
how a message is written (``HPUB`` header block, size limit) and read back (sequence,
delivery count, headers), the stream naming, what a publish reply means, and which errors
are broker-wide refusals (an outage of the broker, not a fault of a message): the one
outage classifier of NATS."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi_outbox.brokers import cloudevents
from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.events import HEADER_MESSAGE_ID, HEADER_TYPE, Envelope

__all__ = [
    "KEY_HEADER",
    "MSG_ID_HEADER",
    "NO_RESPONDERS_STATUS",
    "REFUSAL_ERR_CODES",
    "ack_error",
    "decode_message",
    "exceeds_max_payload",
    "header_block",
    "hpub_command",
    "invalid_subject",
    "is_unreachable",
    "publish_headers",
    "refusal_reason",
    "sequence_and_count",
    "stream_name_for",
    "wire_size",
]

MSG_ID_HEADER = "Nats-Msg-Id"
#: Header carrying the envelope's ordering key (Redis Streams carry it as a field).
KEY_HEADER = "key"


#: JetStream error codes (``err_code``) that refuse every message for a reason of the
#: server's own: insufficient resources, cluster not available, JetStream not enabled or
#: temporarily unavailable, stream offline. Outages, not faults of a message.
REFUSAL_ERR_CODES = frozenset({10008, 10023, 10039, 10076, 10118})
_REFUSAL_PHRASES = ("insufficient resources", "offline", "no leader", "not available")


def refusal_reason(error: BaseException, *, stream_known: bool) -> str | None:
    """Why ``error`` (a JetStream publish or API failure) is a broker-wide refusal, else
    None: the one place where JetStream errors are told apart.

    A 503 or one of `REFUSAL_ERR_CODES` is one. So is "no responders" for a subject
    a stream was known to capture (``stream_known``): the stream or its leader is not
    there right now. For a subject no stream was ever found for, "no responders" means no
    stream captures it: a failure of that message (never a silent drop)."""
    import nats.errors
    import nats.js.errors

    if isinstance(error, type):  # nats-py sets some exceptions as classes
        error = error()
    if isinstance(error, nats.js.errors.NoStreamResponseError | nats.errors.NoRespondersError):
        return "no responders for a captured subject" if stream_known else None
    if isinstance(error, nats.js.errors.APIError):
        if error.code == 503 or error.err_code in REFUSAL_ERR_CODES:
            return f"JetStream {error.code}/{error.err_code}: {error.description}"
        text = (error.description or "").lower()
        if any(phrase in text for phrase in _REFUSAL_PHRASES):
            return f"JetStream {error.code}/{error.err_code}: {error.description}"
    return None


#: How nats-server refuses credentials (its ``-ERR`` protocol line has no code).
_AUTHENTICATION_PHRASES = (
    "authorization violation",
    "authentication expired",
    "authentication revoked",
    "user authentication",
)


def is_authentication_failure(error: BaseException | str) -> bool:
    """Whether ``error`` (what nats-py raises or passes its error callback) is the server
    refusing this client's credentials ("Authorization Violation": a wrong user, password,
    token or nkey): an outage only an operator cures, reported as "authentication failed"."""
    import nats.errors

    if isinstance(error, nats.errors.AuthorizationError):
        return True
    text = str(error).lower()
    return any(phrase in text for phrase in _AUTHENTICATION_PHRASES)


def is_unreachable(error: BaseException, *, request: bool = True) -> bool:
    """Whether ``error`` means NATS cannot be reached (an outage: no message is charged),
    the one place where that is told.

    ``request``: ``error`` came from a JetStream API request (stream lookup and creation,
    the consumer's calls): a closed or reconnecting connection, a timeout, or no responders
    (JetStream is not answering). Otherwise from writing a published message: a closed
    connection or the client's outbound buffer full ("no responders" to a publish is
    `refusal_reason`'s to tell)."""
    import nats.errors

    if request:
        return isinstance(
            error,
            nats.errors.ConnectionClosedError
            | nats.errors.ConnectionReconnectingError
            | nats.errors.NoRespondersError
            | nats.errors.TimeoutError,
        )
    return isinstance(
        error, nats.errors.ConnectionClosedError | nats.errors.OutboundBufferLimitError
    )


def stream_name_for(subject: str) -> str:
    """A valid JetStream stream name for ``subject`` (``orders.eu`` → ``orders_eu``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", subject)


#: Bytes reserved for the protocol line and headers when checking max_payload.
_HEADER_OVERHEAD = 64
#: Status header of a "no responders" reply.
NO_RESPONDERS_STATUS = "503"


def wire_size(payload: bytes, headers: dict[str, str]) -> int:
    """Bytes of a message with ``headers`` as NATS sends them (``Name: value\\r\\n``)."""
    return len(payload) + sum(len(f"{k}: {v}\r\n".encode()) for k, v in headers.items())


#: What NATS refuses in a subject (CR/LF would inject protocol commands).
_SUBJECT_INVALID = re.compile(r"[ \t\r\n]")


def invalid_subject(subject: str) -> bool:
    """Whether NATS refuses ``subject``: empty, or with whitespace (CR/LF would inject
    protocol commands)."""
    return not subject or _SUBJECT_INVALID.search(subject) is not None


def publish_headers(e: Envelope) -> dict[str, str]:
    """The NATS headers of ``e``: its own, the ordering key in ``key`` (Redis carries it
    as a field) and, last so that no user header can replace it, ``Nats-Msg-Id`` = the
    envelope id (JetStream's de-duplication)."""
    headers = e.headers_dict()
    if e.key is not None:
        headers[KEY_HEADER] = e.key
    headers[MSG_ID_HEADER] = e.id
    return headers


#: Header names NATS accepts (RFC 7230 tokens), and the CR/LF a value must not carry: the
#: rules nats-py applies to the headers of ``publish``.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
#: Header names already checked against ``_HEADER_NAME`` (bounded: names are few).
_checked_names: set[str] = set()
_CHECKED_NAMES_MAX = 1024


def header_block(headers: dict[str, str]) -> bytes:
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


def hpub_command(subject: str, reply: str, headers: dict[str, str], payload: bytes) -> bytes:
    """The ``HPUB`` protocol command publishing ``payload`` with ``headers`` (see
    `header_block`) on ``subject``, its JetStream ack asked on ``reply``."""
    block = header_block(headers)
    return b"HPUB %b %b %d %d\r\n%b%b\r\n" % (
        subject.encode(),
        reply.encode(),
        len(block),
        len(block) + len(payload),
        block,
        payload,
    )


def exceeds_max_payload(e: Envelope, headers: dict[str, str], limit: int) -> bool:
    """Whether ``e`` exceeds the server's ``max_payload``. Cheap for the usual message:
    the stored headers' JSON text bounds their wire form (``"k":"v",`` is longer than
    ``k: v\\r\\n``; x4 covers any UTF-8 encoding), so the exact size is computed only
    near the limit."""
    bound = len(e.payload) + _HEADER_OVERHEAD + 4 * (len(e.headers_json) + len(e.id) + 64)
    if e.key is not None:
        bound += 4 * len(e.key)
    if bound <= limit:
        return False
    return wire_size(e.payload, headers) + _HEADER_OVERHEAD > limit


def ack_error(msg: Any) -> BaseException | None:
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


def sequence_and_count(msg: Any) -> tuple[str, int]:
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

    def has_header(self, name: str) -> bool:
        """``name in self.headers`` without building that dict: the payload stages ask for
        their markers on every delivery, and most deliveries carry none."""
        if self._headers is not None:
            return name in self._headers
        raw = self.handle.headers
        return (
            bool(raw)
            and name in raw
            and name != KEY_HEADER
            and not name.lower().startswith("nats-")
        )


def decode_message(stream: str, msg: Any) -> Delivery:
    """The delivery of JetStream message ``msg`` (a ``nats.aio.msg.Msg`` of a pull
    consumer) of ``stream``: the entry id is its stream sequence, the attempt its delivery
    count, the message id the ``message-id`` header (else ``Nats-Msg-Id``, else the
    sequence), the ordering key the ``key`` header; the other headers are read when first
    asked for. A CloudEvent (``ce-*`` headers, or an ``application/cloudevents+json``
    body) is read as one, from any producer."""
    raw = msg.headers or {}
    seq, delivered = sequence_and_count(msg)
    if "ce-specversion" in raw or "content-type" in raw or "Content-Type" in raw:
        event = cloudevents.as_delivery(
            raw,
            msg.data,
            stream=stream,
            entry_id=seq,
            attempt=delivered,
            key=raw.get(KEY_HEADER),
            handle=msg,
        )
        if event is not None:  # a CloudEvent, in binary or structured mode
            return event
    return _NatsDelivery(
        stream=stream,
        entry_id=seq,
        message_id=raw.get(HEADER_MESSAGE_ID) or raw.get(MSG_ID_HEADER) or seq,
        type=raw.get(HEADER_TYPE, ""),
        key=raw.get(KEY_HEADER),
        payload=msg.data,
        attempt=delivered,
        handle=msg,
    )
