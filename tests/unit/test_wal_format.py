"""The WAL message format and pgoutput parsing (no I/O)."""

from __future__ import annotations

import json
import struct
import uuid

import pytest

from fastapi_outbox import OutboxSettings, exceptions
from fastapi_outbox.wal_slot import (
    _PG_EPOCH,
    decode,
    encode,
    format_lsn,
    message_prefix,
    parse_lsn,
)

PREFIX = message_prefix("outbox_messages")


def begin(micros: int) -> bytes:
    return b"B" + struct.pack(">QqI", 0x1000, micros, 42)


def message(prefix: str, content: bytes, lsn: int = 0x1010) -> bytes:
    return (
        b"M"
        + struct.pack(">BQ", 1, lsn)
        + prefix.encode()
        + b"\0"
        + struct.pack(">i", len(content))
        + content
    )


def commit(end_lsn: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, end_lsn - 8, end_lsn, 0)


def row(n: int, key: str | None = "k") -> dict[str, object]:
    return {
        "id": uuid.UUID(int=n),
        "broker": "default",
        "stream": "orders",
        "type": "OrderPlaced",
        "key": key,
        "headers": json.dumps({"message-id": str(uuid.UUID(int=n))}),
        "payload": json.dumps({"n": n, "text": 'quote " and é'}),
    }


def test_a_transaction_round_trips() -> None:
    content = encode([row(1), row(2, key=None)]).encode()
    rows = [begin(5_000_000), message(PREFIX, content), commit(0x2000)]
    (txn,) = decode(rows, PREFIX)
    assert txn.end_lsn == 0x2000
    assert txn.commit_time == pytest.approx(_PG_EPOCH + 5.0)
    first, second = txn.messages
    assert first.id == str(uuid.UUID(int=1)) and first.key == "k" and second.key is None
    assert json.loads(first.payload)["text"] == 'quote " and é'
    assert json.loads(first.headers) == {"message-id": str(uuid.UUID(int=1))}


def test_other_prefixes_are_skipped_but_their_transactions_kept() -> None:
    ours = encode([row(3)]).encode()
    rows = [
        begin(0),
        message("someone_else", b"not json"),
        commit(0x3000),
        begin(0),
        message(PREFIX + "_other_table", ours),
        message(PREFIX, ours),
        commit(0x4000),
    ]
    first, second = decode(rows, PREFIX)
    assert first.messages == [] and first.end_lsn == 0x3000
    assert [m.id for m in second.messages] == [str(uuid.UUID(int=3))]


def test_undecodable_content_is_skipped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    rows = [begin(0), message(PREFIX, b'{"v": 99, "m": []}'), commit(0x5000)]
    (txn,) = decode(rows, PREFIX)
    assert txn.messages == []
    assert "undecodable WAL message skipped" in caplog.text


def test_lsn_text() -> None:
    assert format_lsn(0x1_0000_00A0) == "1/A0"
    assert parse_lsn("1/A0") == 0x1_0000_00A0


def test_capture_settings() -> None:
    assert OutboxSettings().capture == "table"
    assert OutboxSettings(table_name="Orders_Outbox").slot_name == "fastapi_outbox_orders_outbox"
    assert OutboxSettings(capture="wal", wal_slot_name="mine").slot_name == "mine"
    with pytest.raises(exceptions.ConfigurationError, match="capture"):
        OutboxSettings.from_env(capture="binlog")
    with pytest.raises(exceptions.ConfigurationError, match="wal_slot_name"):
        OutboxSettings.from_env(wal_slot_name="Bad-Name")


def test_server_checks_say_what_to_do() -> None:
    from fastapi_outbox.wal_slot import check_ready

    with pytest.raises(exceptions.ConfigurationError, match="PostgreSQL 14 or later"):
        check_ready(130011, "logical", True, "s", slot=True)
    with pytest.raises(exceptions.ConfigurationError, match=r"wal_level=logical.*restart"):
        check_ready(150004, "replica", True, "s", slot=True)
    with pytest.raises(exceptions.ConfigurationError, match="db create"):
        check_ready(150004, "logical", False, "s", slot=True)
    check_ready(150004, "logical", False, "s", slot=False)
