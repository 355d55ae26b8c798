"""A user header can never shadow ``message-id``, ``type`` or ``occurred-at``, on any database
and in any broker's entry; ``Nats-*`` headers belong to NATS."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings, PublishError
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.events import Envelope
from fastapi_outbox.testing import drain
from tests.conftest import unique


@pytest.fixture
async def outbox(db_url: str) -> AsyncIterator[Outbox]:
    box = Outbox(
        db_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(run_relays=False)
    )
    await box.create_tables()
    yield box
    await box.aclose()


@pytest.mark.parametrize(
    "name",
    [
        "message-id",
        "Message-ID",
        "MESSAGE_ID",
        "Type",
        "occurred_at",
        "Occurred-At",
        '"message-id',
        'x"message-id',
        "message-id\\",
        "Nats-Msg-Id",
        "nats-expected-stream",
        "NATS-Rollup",
        "naïve",
        "",
    ],
)
async def test_reserved_or_malformed_header_names_are_refused(outbox: Outbox, name: str) -> None:
    with pytest.raises(PublishError) as error:
        async with outbox.unit_of_work() as uow:
            uow.publish(Message(stream="s", type="T", payload={}), headers={name: "00000000-evil"})
    assert repr(name)[1:-1] in str(error.value) or name == ""
    assert await outbox.store.messages.count() == 0


async def test_ordinary_headers_pass(outbox: Outbox) -> None:
    async with outbox.unit_of_work() as uow:
        uow.publish(
            Message(stream="s", type="T", payload={}),
            headers={"x-tenant": "acme", "Content-Language": "en", "trace_flag": "1"},
        )
    assert await outbox.store.messages.count() == 1


@pytest.mark.parametrize(
    "headers_json",
    [
        # compact JSON (SQLite stores the text as written) and JSONB's rendering
        '{"\\"message-id":"evil","message-id":"real"}',
        '{"x\\"message-id": "evil", "message-id": "real"}',
        '{"a":"b\\\\","message-id":"real"}',
        '{"message-id": "real", "type": "T"}',
    ],
)
def test_message_id_is_read_from_its_own_key_only(headers_json: str) -> None:
    envelope = Envelope("row", "s", "T", None, b"{}", headers_json=headers_json)
    assert envelope.message_id == "real"
    assert envelope.message_id == json.loads(headers_json)["message-id"]


@pytest.mark.redis
async def test_redis_entry_id_is_the_real_message_id(sqlite_url: str, redis_url: str) -> None:
    """SQLite keeps the headers' JSON text as written: the Redis entry's ``id`` must still
    be the message id, whatever a (refused) header could have looked like."""
    stream = unique("hdr")
    broker = RedisStreamsBroker(redis_url)
    box = Outbox(sqlite_url, brokers={"default": broker}, settings=OutboxSettings(run_relays=False))
    await box.create_tables()
    try:
        async with box.unit_of_work() as uow:
            real = uow.publish(
                Message(stream=stream, type="T", payload={}),
                headers={"x-note": '"message-id":"evil"'},  # a value may hold anything
            )
        await broker.connect()
        await drain(box)
        [(_, fields)] = await broker.client.xrange(stream)
        assert fields[b"id"].decode() == str(real)
        assert json.loads(fields[b"headers"])["x-note"] == '"message-id":"evil"'
    finally:
        await broker.client.delete(stream)
        await box.aclose()
