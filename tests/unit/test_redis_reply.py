"""The Redis wire format (``brokers/redis/wire.py``): raw ``XREADGROUP`` replies
(redis-py's dict per entry skipped) in
both reply shapes (RESP3 map, RESP2 list), entries in the publish script's field order,
and anything else — other field orders, entries not written by our publisher, a client
that decodes responses — through the general path."""

from __future__ import annotations

from typing import Any

import pytest

from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.brokers.redis.wire import (
    PUBLISHED_FIELDS,
    decode_entry,
    entry_fields,
    entry_values,
    reply_entries,
)
from fastapi_outbox.events import Envelope

FIELDS = [b"id", b"m-1", b"type", b"Tick", b"key", b"k", b"headers", b'{"a":"b"}']
FIELDS += [b"payload", b'{"n":1}']


def decode(entry_id: Any, fields: Any, attempt: int) -> Delivery:
    return decode_entry("s", entry_id, fields, attempt)


def test_both_reply_shapes() -> None:
    entries = [[b"1-0", FIELDS], [b"2-0", FIELDS]]
    assert reply_entries({b"s": entries}) == entries  # RESP3: a map stream -> entries
    assert reply_entries([[b"s", entries]]) == entries  # RESP2: [stream, entries] pairs
    assert reply_entries(None) == [] and reply_entries({}) == []


def test_published_order_and_the_general_path_agree() -> None:
    fast = decode(b"1-0", list(FIELDS), 2)
    pairs = list(zip(FIELDS[::2], FIELDS[1::2], strict=True))
    shuffled = [x for pair in reversed(pairs) for x in pair]  # another field order
    slow = decode(b"1-0", shuffled, 2)
    text = decode("1-0", [f.decode() for f in FIELDS], 2)  # decode_responses=True
    for d in (fast, slow, text):
        assert (d.entry_id, d.message_id, d.type, d.key, d.attempt) == (
            "1-0",
            "m-1",
            "Tick",
            "k",
            2,
        )
        assert d.headers == {"a": "b"}
        assert d.payload == b'{"n":1}'


def test_entry_without_id_field_takes_the_headers() -> None:
    fields = [b"type", b"", b"headers", b'{"message-id":"h-1","type":"T"}', b"payload", b"{}"]
    d = decode(b"3-0", fields, 1)
    assert (d.message_id, d.type, d.key) == ("h-1", "T", None)


def test_mapping_fields_and_missing_optional_fields() -> None:
    d = decode(b"4-0", {b"id": b"m-4", b"type": b"T", b"payload": b"[]"}, 3)
    assert (d.entry_id, d.message_id, d.type, d.key, d.attempt) == ("4-0", "m-4", "T", None, 3)
    assert d.headers == {} and d.payload == b"[]"


def test_str_payload_becomes_bytes() -> None:
    d = decode("5-0", {"id": "m-5", "type": "T", "payload": '{"n":2}'}, 1)
    assert d.payload == b'{"n":2}'


def test_bad_headers_read_as_none() -> None:
    d = decode(
        b"6-0", [b"id", b"m", b"type", b"T", b"key", b"", b"headers", b"{not", b"payload", b"{}"], 1
    )
    assert d.headers == {} and d.key is None


def test_unpaired_fields_name_the_entry() -> None:
    with pytest.raises(ValueError, match=r"7-0 of stream 's'.*3 items"):
        decode(b"7-0", [b"id", b"m", b"type"], 1)


def test_published_fields_are_the_publish_scripts_order() -> None:
    assert PUBLISHED_FIELDS == (b"id", b"type", b"key", b"headers", b"payload")


def test_what_the_publisher_writes_decodes_back() -> None:
    e = Envelope("row-1", "s", "OrderPlaced", "k-1", b'{"n":3}', {"message-id": "m-9", "x": "y"})
    values = entry_values(e)
    fields = [x for pair in zip(PUBLISHED_FIELDS, values, strict=True) for x in pair]
    assert [f.encode() if isinstance(f, str) else f for f in entry_fields(e)] == [
        f.encode() if isinstance(f, str) else f for f in fields
    ]
    # As Redis hands the entry back: every field and value as bytes.
    raw = [f if isinstance(f, bytes) else f.encode() for f in fields]
    d = decode(b"9-0", raw, 1)
    assert (d.message_id, d.type, d.key) == (e.message_id, "OrderPlaced", "k-1")
    assert d.headers == {"message-id": "m-9", "x": "y"} and d.payload == b'{"n":3}'


def test_no_key_is_written_empty_and_read_as_none() -> None:
    e = Envelope("row-2", "s", "T", None, b"{}", {})
    raw = [v if isinstance(v, bytes) else v.encode() for v in entry_fields(e)]
    assert decode(b"10-0", raw, 1).key is None
