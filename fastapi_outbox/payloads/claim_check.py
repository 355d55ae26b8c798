"""Claim-check, the last payload stage: a payload over ``claim_check_bytes`` leaves the message.

Write side (`ClaimCheckStage.seal`, inside ``publish``, after encryption: the store
holds the ciphertext): the payload is swapped for `STUB_PAYLOAD` and the reference
headers, and handed to the message's first outbox row (`Parts.row`); the commit's
write (`put_claims`, called by the outbox's ``write_rows`` in the session's
``before_commit``, before the capture writes the rows) takes it off the row and stores it
on the session's connection — in the producer's transaction for the database store, just
before the commit for a file store. A savepoint or a transaction that rolls back drops the
row, and the payload with it, before anything is stored.

Consume side (`ClaimCheckStage.open`, first of the reversed stages): the payload is
fetched back; gone (retention, never stored) raises ``PayloadUnreadable`` (dead-letter,
naming the message id and the reference); a store that fails raises what it raised (the
database unreachable: waited out in place; anything else: a failed attempt).

Ops side (`ClaimCheckStage.reveal`): the payload when the store holds it, else a
note ``claim-check: <ref> (5.0 MiB): gone from the database store …``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection

from fastapi_outbox import exceptions
from fastapi_outbox.log import safe_error
from fastapi_outbox.payloads.stages import Parts, Revealed
from fastapi_outbox.storage.claim_check import (
    HEADER_CLAIM_CHECK,
    HEADER_CLAIM_CHECK_SIZE,
    STUB_PAYLOAD,
    PayloadStore,
)

__all__ = ["ROW_KEY", "ClaimCheckStage", "human_size", "label_of", "put_claims"]

#: Key of a row dict holding the claim-checked payload's bytes until the commit stores them.
ROW_KEY = "claim_check"
_STUB = STUB_PAYLOAD.encode()
_HEADERS = frozenset({HEADER_CLAIM_CHECK, HEADER_CLAIM_CHECK_SIZE})


def human_size(size: int) -> str:
    """``5.0 MiB``, ``12.3 KiB``, ``512 B``."""
    if size >= 1024 * 1024:
        return f"{size / (1024 * 1024):.1f} MiB"
    if size >= 1024:
        return f"{size / 1024:.1f} KiB"
    return f"{size} B"


def label_of(headers: dict[str, str]) -> str | None:
    """``claim-check: <ref> (5.0 MiB)`` for a claim-checked message's headers, else None."""
    ref = headers.get(HEADER_CLAIM_CHECK)
    if ref is None:
        return None
    try:
        size = int(headers.get(HEADER_CLAIM_CHECK_SIZE, "0"))
    except ValueError:
        size = 0
    return f"claim-check: {ref} ({human_size(size)})"


class ClaimCheckStage:
    """Payloads over ``threshold`` bytes (as they leave the earlier stages) go to ``store``."""

    marker = HEADER_CLAIM_CHECK
    headers = _HEADERS

    def __init__(self, store: PayloadStore | None, threshold: int | None) -> None:
        self.store = store
        self.threshold = threshold

    @property
    def seals(self) -> bool:
        return self.store is not None and self.threshold is not None

    def seal(self, parts: Parts, session: Any) -> Parts:
        if self.threshold is None or len(parts.payload) <= self.threshold:
            return parts
        headers = {
            **parts.headers,
            HEADER_CLAIM_CHECK: parts.message_id,
            HEADER_CLAIM_CHECK_SIZE: str(len(parts.payload)),
        }
        row = {**parts.row, ROW_KEY: parts.payload}
        return Parts(parts.message_id, parts.stream, parts.type, _STUB, headers, row)

    async def open(self, parts: Parts) -> Parts:
        ref = parts.headers.get(HEADER_CLAIM_CHECK)
        if ref is None:
            return parts
        if self.store is None:
            raise exceptions.PayloadUnreadable(
                f"message {parts.message_id} is claim-checked (reference {ref}) but this "
                "process has no claim-check store: set claim_check_bytes and "
                "claim_check_store as the producer's"
            )
        data = await self.store.get(ref)
        if data is None:
            raise exceptions.PayloadUnreadable(
                f"the claim-checked payload of message {parts.message_id} (reference {ref}) "
                f"is gone from the {self.store.kind} claim-check store: removed by retention "
                "(claim_check_retention_seconds: the longer of published_retention_seconds "
                "and inbox_retention_seconds) or never stored"
            )
        return Parts(parts.message_id, parts.stream, parts.type, data, _without(parts.headers))

    async def reveal(self, parts: Parts) -> Parts | Revealed:
        label = label_of(parts.headers)
        if label is None:
            return parts
        rest = _without(parts.headers)
        if self.store is None:
            return Revealed(f"{label}: no claim-check store is configured here", rest)
        try:
            data = await self.store.get(parts.headers[HEADER_CLAIM_CHECK])
        except Exception as exc:
            return Revealed(
                f"{label}: the {self.store.kind} store could not be read: {safe_error(exc)}",
                rest,
            )
        if data is None:
            return Revealed(
                f"{label}: gone from the {self.store.kind} store (retention) or never stored",
                rest,
            )
        return Parts(parts.message_id, parts.stream, parts.type, data, rest)


def _without(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k not in _HEADERS}


def put_claims(
    store: PayloadStore | None, connection: Connection, rows: list[dict[str, Any]]
) -> None:
    """Store the claim-checked payloads of ``rows`` (taking them off the rows) on
    ``connection``, in the commit (the session's ``before_commit``). A row carrying one
    with no store configured is a bug: refused."""
    for row in rows:
        data = row.pop(ROW_KEY, None)
        if data is None:
            continue
        if store is None:
            raise RuntimeError("a claim-checked message, and no claim-check store configured")
        delay = row.get("delay")
        # Dated from when the message is due: retention counts from its publication.
        store.put(connection, str(row["id"]), data, delay.total_seconds() if delay else 0.0)
