"""The Redis consumer reads raw ``XREADGROUP`` replies (redis-py's dict per entry skipped):
both reply shapes (RESP3 map, RESP2 list), entries in the publish script's field order,
and anything else — other field orders, entries not written by our publisher, a client
that decodes responses — through the general path."""

from __future__ import annotations

from typing import Any

from fastapi_outbox.brokers import RedisStreamsBroker
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.redis.consumer import _entries

FIELDS = [b"id", b"m-1", b"type", b"Tick", b"key", b"k", b"headers", b'{"a":"b"}']
FIELDS += [b"payload", b'{"n":1}']


def consumer() -> Any:
    config = ConsumerConfig(
        stream="s",
        group="g",
        consumer_name="me",
        dead_letter="s.dlq",
        claim_idle_seconds=30,
        max_attempts=3,
    )
    return RedisStreamsBroker("redis://127.0.0.1:6379/0").consumer(config)


def test_both_reply_shapes() -> None:
    entries = [[b"1-0", FIELDS], [b"2-0", FIELDS]]
    assert _entries({b"s": entries}) == entries  # RESP3: a map stream -> entries
    assert _entries([[b"s", entries]]) == entries  # RESP2: [stream, entries] pairs
    assert _entries(None) == [] and _entries({}) == []


def test_published_order_and_the_general_path_agree() -> None:
    c = consumer()
    fast = c._delivery(b"1-0", list(FIELDS), 2)
    pairs = list(zip(FIELDS[::2], FIELDS[1::2], strict=True))
    shuffled = [x for pair in reversed(pairs) for x in pair]  # another field order
    slow = c._delivery(b"1-0", shuffled, 2)
    text = c._delivery("1-0", [f.decode() for f in FIELDS], 2)  # decode_responses=True
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
    d = consumer()._delivery(b"3-0", fields, 1)
    assert (d.message_id, d.type, d.key) == ("h-1", "T", None)
