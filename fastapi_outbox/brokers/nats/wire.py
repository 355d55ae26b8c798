"""What the NATS publisher and consumer agree on about JetStream: the header names, the
stream naming and which errors are broker-wide refusals (an outage of the broker, not a
fault of a message)."""

from __future__ import annotations

import re

__all__ = ["KEY_HEADER", "MSG_ID_HEADER", "REFUSAL_ERR_CODES", "refusal_reason", "stream_name_for"]

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

    A 503 or one of :data:`REFUSAL_ERR_CODES` is one. So is "no responders" for a subject
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


def stream_name_for(subject: str) -> str:
    """A valid JetStream stream name for ``subject`` (``orders.eu`` → ``orders_eu``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", subject)
