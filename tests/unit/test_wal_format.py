"""The WAL message format and pgoutput parsing (no I/O)."""

from __future__ import annotations

import json
import struct
import uuid

import pytest

from fastapi_outbox import OutboxSettings, exceptions
from fastapi_outbox.storage.wal_slot import (
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
    (txn,), undecodable = decode(rows, PREFIX)
    assert undecodable is None
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
    (first, second), undecodable = decode(rows, PREFIX)
    assert undecodable is None
    assert first.messages == [] and first.end_lsn == 0x3000
    assert [m.id for m in second.messages] == [str(uuid.UUID(int=3))]


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b'{"v": 99, "m": []}',
        b"[1, 2]",
        b'{"v": 1, "m": [[1]]}',
        b'{"v": 1, "m": [[1, 2, 3, 4, 5, 6, 7]]}',
        b'{"v": 1, "m": [["not-a-uuid", "b", "s", "t", null, "{}", "{}"]]}',
        b'{"v": 1}',
    ],
)
def test_undecodable_content_stops_the_decoding_before_its_transaction(content: bytes) -> None:
    ours = encode([row(1)]).encode()
    rows = [
        begin(0),
        message(PREFIX, ours),
        commit(0x4000),
        begin(0),
        message(PREFIX, ours, lsn=0x4010),
        message(PREFIX, content, lsn=0x4020),
        commit(0x5000),
        begin(0),
        message(PREFIX, ours, lsn=0x5010),
        commit(0x6000),
    ]
    transactions, undecodable = decode(rows, PREFIX)
    # The transaction before it only: neither its own nor any later one.
    assert [t.end_lsn for t in transactions] == [0x4000]
    assert undecodable is not None
    assert (undecodable.lsn, undecodable.end_lsn) == (0x4020, 0x5000)
    described = undecodable.describe("the_slot")
    assert "LSN 0/4020" in described and "'the_slot'" in described
    assert "pg_replication_slot_advance('the_slot', '0/5000')" in described


def test_wal_relay_bounds_are_validated_settings() -> None:
    settings = OutboxSettings()
    assert settings.wal_read_timeout_seconds == 60
    assert settings.wal_confirm_timeout_seconds == 30
    assert settings.wal_read_window_bytes == 64 << 20
    with pytest.raises(exceptions.ConfigurationError, match="wal_read_timeout_seconds"):
        OutboxSettings.from_env(wal_read_timeout_seconds=0)
    with pytest.raises(exceptions.ConfigurationError, match="wal_confirm_timeout_seconds"):
        OutboxSettings.from_env(wal_confirm_timeout_seconds=-1)
    with pytest.raises(exceptions.ConfigurationError, match="wal_read_window_bytes"):
        OutboxSettings.from_env(wal_read_window_bytes=1000)


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
    from fastapi_outbox.storage.wal_slot import check_ready

    with pytest.raises(exceptions.ConfigurationError, match="PostgreSQL 14 or later"):
        check_ready(130011, "logical", True, "s", slot=True)
    with pytest.raises(exceptions.ConfigurationError, match=r"wal_level=logical.*restart"):
        check_ready(150004, "replica", True, "s", slot=True)
    with pytest.raises(exceptions.ConfigurationError, match="db create"):
        check_ready(150004, "logical", False, "s", slot=True)
    check_ready(150004, "logical", False, "s", slot=False)
