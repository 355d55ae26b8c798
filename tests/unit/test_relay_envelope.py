"""``relay.loop.envelope_of``: the one way a claimed row (table relay) and a WAL message
(WAL relay) become the envelope a broker publishes."""

from __future__ import annotations

import uuid

from fastapi_outbox.relay.loop import envelope_of
from fastapi_outbox.storage.store import ClaimedRow
from fastapi_outbox.storage.wal_slot import WalMessage

HEADERS = '{"message-id":"m","type":"Placed"}'


def test_a_claimed_row_keeps_its_headers_as_text() -> None:
    row_id = uuid.uuid4()
    row = ClaimedRow(row_id, "orders", "Placed", "k1", '{"n":1}', HEADERS, attempts=1)
    envelope = envelope_of(row)
    assert (envelope.id, envelope.stream, envelope.type, envelope.key) == (
        str(row_id),
        "orders",
        "Placed",
        "k1",
    )
    assert envelope.payload == b'{"n":1}'
    assert envelope.headers_json == HEADERS
    assert envelope.headers == {"message-id": "m", "type": "Placed"}


def test_a_row_whose_driver_decoded_the_headers_gets_a_copy() -> None:
    decoded = {"type": "Placed"}
    row = ClaimedRow(uuid.uuid4(), "orders", "Placed", None, "{}", decoded, attempts=1)  # type: ignore[arg-type]
    envelope = envelope_of(row)
    assert envelope.headers == decoded and envelope.headers is not decoded


def test_a_wal_message_becomes_the_same_envelope() -> None:
    message = WalMessage("id-1", "default", "orders", "Placed", None, HEADERS, '{"n":2}')
    envelope = envelope_of(message)
    assert (envelope.id, envelope.stream, envelope.type, envelope.key) == (
        "id-1",
        "orders",
        "Placed",
        None,
    )
    assert envelope.payload == b'{"n":2}'
    assert envelope.headers_json == HEADERS
