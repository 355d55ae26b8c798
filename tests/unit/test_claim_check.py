"""Claim-check without services: the settings' checks, the stage's seal and open on a store
in memory, the labels, and the file store's refusal of a reference that is not a message id."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from fastapi_outbox import OutboxSettings
from fastapi_outbox.exceptions import PayloadUnreadable
from fastapi_outbox.payloads import Parts
from fastapi_outbox.payloads.claim_check import ROW_KEY, ClaimCheckStage, label_of, put_claims
from fastapi_outbox.storage.claim_check import (
    HEADER_CLAIM_CHECK,
    HEADER_CLAIM_CHECK_SIZE,
    FilePayloadStore,
)


class MemoryStore:
    kind = "memory"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, connection: Any, ref: str, data: bytes, due_in: float = 0.0) -> None:
        self.data[ref] = data

    async def get(self, ref: str) -> bytes | None:
        return self.data.get(ref)


def test_settings_refuse_a_threshold_not_below_the_largest_payload_and_an_unknown_store() -> None:
    with pytest.raises(ValueError, match=r"claim_check_bytes .* not below max_payload_bytes"):
        OutboxSettings(claim_check_bytes=2048, max_payload_bytes=1024)
    with pytest.raises(ValueError, match="claim_check_store"):
        OutboxSettings(claim_check_bytes=10, claim_check_store="s3://bucket")
    settings = OutboxSettings(claim_check_bytes=10, published_retention_seconds=30 * 86400)
    assert settings.claim_check_retention_seconds == 30 * 86400  # the longer: published
    assert OutboxSettings().claim_check_retention_seconds == 14 * 86400  # the inbox's
    assert OutboxSettings(inbox_retention_seconds=None).claim_check_retention_seconds is None


async def test_the_stage_stores_large_payloads_only_and_restores_them() -> None:
    store = MemoryStore()
    stage = ClaimCheckStage(store, threshold=10)  # type: ignore[arg-type]
    mid = str(uuid.uuid4())
    small = Parts(mid, "s", "T", b'{"a":1}', {"h": "v"})
    assert stage.seal(small, None) is small
    big = stage.seal(Parts(mid, "s", "T", b'{"a":"0123456789"}', {"h": "v"}), None)
    assert big.payload == b"{}"
    assert big.headers == {"h": "v", HEADER_CLAIM_CHECK: mid, HEADER_CLAIM_CHECK_SIZE: "18"}
    assert label_of(big.headers) == f"claim-check: {mid} (18 B)"
    row: dict[str, Any] = {"id": mid, **big.row}
    put_claims(store, None, [row])  # type: ignore[arg-type]
    assert ROW_KEY not in row and store.data == {mid: b'{"a":"0123456789"}'}
    opened = await stage.open(big)
    assert (opened.payload, opened.headers) == (b'{"a":"0123456789"}', {"h": "v"})
    store.data.clear()
    with pytest.raises(PayloadUnreadable, match=f"message {mid} \\(reference {mid}\\) is gone"):
        await stage.open(big)


async def test_the_file_store_takes_message_ids_only(tmp_path: Path) -> None:
    store = FilePayloadStore(tmp_path)
    with pytest.raises(ValueError, match="badly formed"):
        store.put(None, "../../etc/passwd", b"x")  # type: ignore[arg-type]
    assert await store.get("../../etc/passwd") is None
    ref = str(uuid.uuid4())
    store.put(None, ref, b"payload")  # type: ignore[arg-type]
    assert await store.get(ref) == b"payload"
