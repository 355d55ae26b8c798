"""What the Redis publisher and consumer agree on about Redis itself: the fields of a
published entry, which reply errors are broker-wide refusals (an outage of the broker,
not a fault of a message) and which failures mean Redis cannot be reached: the one
outage classifier of Redis (a single node or a Redis Cluster); and the names of the keys
that go with a stream (its de-duplication keys, its dead-letter streams), which on a Redis
Cluster must hash to the stream's slot (docs/how-to/redis-cluster.md)."""

from __future__ import annotations

import json
from typing import Any

from fastapi_outbox.brokers import cloudevents
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions
from fastapi_outbox.brokers.consumer import Delivery, parse_headers
from fastapi_outbox.events import Envelope

__all__ = [
    "PUBLISHED_FIELDS",
    "REFUSAL_CODES",
    "dead_letter_key",
    "decode_entry",
    "dedup_key",
    "entry_fields",
    "entry_values",
    "hashed_part",
    "is_unreachable",
    "refusal_code",
    "reply_entries",
    "same_slot",
    "slot_tag",
    "text",
]

#: The fields of an entry, in the order the publisher writes them.
PUBLISHED_FIELDS = (b"id", b"type", b"key", b"headers", b"payload")
_PUBLISHED = list(PUBLISHED_FIELDS)

#: Error codes with which Redis refuses *every* write for a reason of its own: out of
#: memory, a read-only replica (after a failover), a failed RDB save (``MISCONF``), a
#: dataset still loading, a busy script, a cluster without quorum or mid-resharding, a
#: slot that moved again while redis-py followed it (``MOVED`` / ``ASK`` reaching the
#: caller: a redirection storm during a failover or a resharding). They are outages of the
#: broker, not faults of a message: the relay backs off as a whole and no attempt is
#: charged.
REFUSAL_CODES = frozenset(
    {
        "OOM",
        "READONLY",
        "MISCONF",
        "LOADING",
        "BUSY",
        "CLUSTERDOWN",
        "TRYAGAIN",
        "MASTERDOWN",
        "MOVED",
        "ASK",
        "NOREPLICAS",
        "NOTREADY",
    }
)

#: The error code of a blocked command the server ended itself (``UNBLOCKED the stream key
#: no longer exists``, ``UNBLOCKED force unblock from blocking operation, instance state
#: changed``).
UNBLOCKED = "UNBLOCKED"

#: How redis-py's cluster client says that it cannot find a node to talk to (its
#: ``RedisClusterException`` has no subclass for these): every startup node unreachable,
#: slots without a node, nodes that disagree on the slot map mid-failover.
_TOPOLOGY_FAILURES = (
    "Redis Cluster cannot be connected",
    "All slots are not covered",
    "startup_nodes could not agree",
    "No targets were found",
)


def refusal_code(error: BaseException | str) -> str | None:
    """The code of a broker-wide refusal in ``error``, else None: the one place where
    Redis errors are told apart. ``error`` is a reply error from redis-py (which strips
    known codes from the text into ``status_code``) or the ``"!<error>"`` text the
    publish script returns for an XADD that Redis refused."""
    code = getattr(error, "status_code", None)
    if not code:
        text = str(error).lstrip("!").lstrip()
        code = text.split(" ", 1)[0]
    code = str(code)  # Redis error codes are upper case: "oom" in a text is not one
    return code if code in REFUSAL_CODES else None


def is_authentication_failure(error: BaseException) -> bool:
    """Whether ``error`` is Redis refusing this client's credentials or its ACL user
    (``WRONGPASS``, ``NOAUTH``, ``NOPERM``, ``AUTH`` with a user the server does not
    know): an outage only an operator cures, reported as "authentication failed"."""
    import redis.exceptions as rexc

    return isinstance(
        error,
        rexc.AuthenticationError
        | rexc.AuthenticationWrongNumberOfArgsError
        | rexc.AuthorizationError
        | rexc.NoPermissionError,
    )


def is_unreachable(error: BaseException) -> bool:
    """Whether ``error`` (raised by redis-py or returned in a pipeline's replies) means
    Redis cannot be reached: a connection failure or a timeout, not a reply. On a Redis
    Cluster also: a node that cannot be reached (a dead master before its replica is
    promoted), redirections that did not settle (``TTL exhausted``), a slot no node serves
    and a slot map the client cannot get (``RedisClusterException`` of the topology)."""
    import redis.exceptions as rexc

    if isinstance(error, rexc.ConnectionError | rexc.TimeoutError | OSError):
        return True
    if is_authentication_failure(error):  # an outage with its own cause
        return True
    if isinstance(error, rexc.ResponseError):  # a reply: a refusal (refusal_code) or not
        # Except a blocked read the server ended because its stream left the node (a
        # Redis Cluster slot migrated, a failover made the node a replica, the key
        # deleted): the read is made again, on the node serving the stream now.
        return str(error).startswith(UNBLOCKED)
    if isinstance(error, rexc.ClusterError | rexc.SlotNotCoveredError):
        return True
    return isinstance(error, rexc.RedisClusterException) and str(error).startswith(
        _TOPOLOGY_FAILURES
    )


def hashed_part(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes to pick its slot: the text between the
    first ``{`` and the first ``}`` after it when that is not empty (the key's hash tag),
    else the whole key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def slot_tag(stream_key: str) -> str:
    """``{<hashed part>}``: a hash tag that puts a key in the slot of ``stream_key``.
    ValueError for a stream whose whole name is hashed and holds a ``}`` (``a}b``,
    ``a{}b``): no tag can name that slot; such a stream must carry a hash tag of its own
    (``{a}b``) to be used on a Redis Cluster."""
    part = hashed_part(stream_key)
    if "}" in part:
        raise ValueError(
            f"stream {stream_key!r} cannot be used on a Redis Cluster: its name holds a '}}' "
            "outside a hash tag, so its de-duplication keys and dead-letter stream cannot "
            "share its slot; give it a hash tag of its own (e.g. '{orders}.v1')"
        )
    return "{" + part + "}"


def same_slot(a: str, b: str) -> bool:
    """Whether keys ``a`` and ``b`` hash to the same Redis Cluster slot."""
    from redis.crc import key_slot

    return bool(key_slot(a.encode()) == key_slot(b.encode()))


def dedup_key(stream_key: str, message_id: str, *, cluster: bool) -> str:
    """The key that remembers ``message_id``'s entry in ``stream_key``.

    Single node: ``outbox:dedup:{<stream key>}:<id>`` (unchanged since the first release).
    Redis Cluster: ``outbox:dedup:<slot_tag>:<id>``, in the stream's slot, so the publish
    script touches one slot; the same name as on a single node for every stream without
    ``{`` or ``}`` in its name."""
    if not cluster:
        return f"outbox:dedup:{{{stream_key}}}:{message_id}"
    return f"outbox:dedup:{slot_tag(stream_key)}:{message_id}"


def dead_letter_key(name_key: str, stream_key: str, *, cluster: bool) -> str:
    """The key of the dead-letter stream ``name_key`` (the subscriber's dead-letter name,
    prefixed) of ``stream_key``.

    Single node: ``name_key`` itself (``orders.billing.dlq``; unchanged: dead letters
    already written stay where they are). Redis Cluster: the dead letter is written and the
    entry acknowledged in one script, so both keys must share a slot: ``name_key`` when it
    already hashes like the stream (it carries the stream's hash tag), else the stream's
    tag before it: ``{orders}:orders.billing.dlq``."""
    if not cluster or hashed_part(name_key) == hashed_part(stream_key):
        return name_key
    return f"{slot_tag(stream_key)}:{name_key}"


def entry_values(e: Envelope, envelope_format: CloudEventsOptions | None = None) -> list[Any]:
    """The values of ``e``'s entry, in the order of `PUBLISHED_FIELDS`: message id,
    type, ordering key ("" for none), headers as JSON text (as stored, not re-encoded),
    payload. With CloudEvents (``envelope_format``) the headers are the CloudEvent's
    (binary: ``ce-*`` and ``content-type``; structured: ``content-type``) and the payload
    its body."""
    if envelope_format is not None and envelope_format.enabled:
        headers, body = cloudevents.encode(e, envelope_format.source, envelope_format.mode)
        return [e.message_id, e.type, e.key or "", json.dumps(headers), body]
    return [e.message_id, e.type, e.key or "", e.headers_json, e.payload]


def entry_fields(e: Envelope, envelope_format: CloudEventsOptions | None = None) -> list[Any]:
    """``e``'s entry as the ``field, value, …`` arguments of an ``XADD``."""
    values = entry_values(e, envelope_format)
    return [part for pair in zip(PUBLISHED_FIELDS, values, strict=True) for part in pair]


def text(value: Any) -> str:
    """A field name or value as text: bytes from our clients, str from a client made with
    ``decode_responses=True``."""
    return value.decode() if isinstance(value, bytes) else str(value)


def reply_entries(reply: Any) -> list[Any]:
    """The ``[entry id, [field, value, …]]`` entries of a raw ``XREADGROUP`` reply: a map
    stream → entries (RESP3) or a list of ``[stream, entries]`` pairs (RESP2)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [e for entries in reply.values() for e in entries]
    return [e for _stream, entries in reply for e in entries]


def _maybe_cloudevent(raw_headers: Any) -> bool:
    """Whether an entry's ``headers`` text may hold a CloudEvent's headers: a cheap
    substring test on the fast path, confirmed by `_cloudevent`."""
    if not raw_headers:
        return False
    raw = raw_headers if isinstance(raw_headers, bytes) else str(raw_headers).encode()
    return b"ce-specversion" in raw or b"application/cloudevents" in raw


def _cloudevent(stream: str, entry: str, named: dict[str, Any], attempt: int) -> Delivery | None:
    """The delivery of an entry that holds a CloudEvent, else None. The CloudEvent's
    headers are the ``headers`` field (JSON, as our publisher writes them) or, from a
    producer that writes one field per header, the entry's other fields; its body is
    the ``payload`` field (or ``data``)."""
    raw_headers = named.get("headers")
    if raw_headers:
        if not _maybe_cloudevent(raw_headers):
            return None
        headers: dict[str, Any] = parse_headers(raw_headers)
    else:
        headers = {
            name: text(value)
            for name, value in named.items()
            if name not in ("payload", "data", "key")
        }
    body = named.get("payload", named.get("data", b""))
    key = named.get("key")
    return cloudevents.as_delivery(
        headers,
        body if isinstance(body, bytes) else str(body).encode(),
        stream=stream,
        entry_id=entry,
        attempt=attempt,
        key=text(key) if key else None,
    )


def decode_entry(stream: str, entry_id: Any, fields: Any, attempt: int) -> Delivery:
    """The delivery of entry ``entry_id`` of ``stream``: ``fields`` as a raw reply's flat
    ``[field, value, …]`` list (the fast path when in the order the publisher writes them)
    or a mapping. An entry another writer added takes its message id and type from its
    ``headers`` (``message-id``, ``type``), else the entry id and ""."""
    if isinstance(fields, list):  # a raw reply's flat [field, value, …]
        if fields[::2] == _PUBLISHED:  # as the publish script writes them
            message_id, type_, key, raw_headers, payload = fields[1::2]
            if (
                message_id
                and type_
                and isinstance(payload, bytes)
                and not _maybe_cloudevent(raw_headers)
            ):
                return Delivery(
                    stream=stream,
                    entry_id=entry_id.decode(),
                    message_id=message_id.decode(),
                    type=type_.decode(),
                    key=key.decode() if key else None,
                    raw_headers=raw_headers,
                    payload=payload,
                    attempt=attempt,
                )
        if len(fields) % 2:
            raise ValueError(
                f"Redis entry {text(entry_id)} of stream {stream!r}: fields and values do "
                f"not pair up ({len(fields)} items)"
            )
        pairs = iter(fields)
        fields = dict(zip(pairs, pairs, strict=True))
    # Field names as text: bytes from our clients, str from a client the application
    # made with decode_responses=True.
    named = {text(k): v for k, v in fields.items()}
    get = named.get
    entry = text(entry_id)
    event = _cloudevent(stream, entry, named, attempt)
    if event is not None:
        return event
    raw_headers = get("headers")
    message_id = get("id")
    type_ = get("type")
    headers = None
    if not message_id or not type_:  # not written by our publisher: from the headers
        headers = parse_headers(raw_headers)
        message_id = message_id or headers.get("message-id") or entry
        type_ = type_ or headers.get("type") or ""
    payload = get("payload", b"")
    key = get("key")
    return Delivery(
        stream=stream,
        entry_id=entry,
        message_id=text(message_id),
        type=text(type_),
        key=text(key) if key else None,
        headers=headers,
        raw_headers=raw_headers,
        payload=payload if isinstance(payload, bytes) else str(payload).encode(),
        attempt=attempt,
    )
