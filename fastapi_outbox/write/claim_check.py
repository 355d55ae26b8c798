"""Claim-check on the write path: a payload over ``claim_check_bytes`` leaves the message.

:func:`check_in` (called by ``UnitOfWork.publish``) swaps the payload for a stub and the
reference headers, and hands the payload's bytes to the message's first row under
:data:`ROW_KEY`; :func:`put_claims` (called by the outbox's ``write_rows``, in the session's
``before_commit``, before the capture writes the rows) takes them off the rows and stores
them on the session's connection: in the producer's transaction for the database store,
just before the commit for a file store.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy.engine import Connection

from fastapi_outbox.storage.claim_check import (
    HEADER_CLAIM_CHECK,
    HEADER_CLAIM_CHECK_SIZE,
    STUB_PAYLOAD,
    PayloadStore,
)

__all__ = ["ROW_KEY", "check_in", "put_claims"]

#: Key of a row dict holding the claim-checked payload's bytes until the commit stores them.
ROW_KEY = "claim_check"


def check_in(payload: str, size: int, message_id: uuid.UUID) -> tuple[bytes, str, dict[str, str]]:
    """``(payload bytes to store, stub payload, headers)`` of a claim-checked message: the
    reference is the message id."""
    headers = {HEADER_CLAIM_CHECK: str(message_id), HEADER_CLAIM_CHECK_SIZE: str(size)}
    return payload.encode(), STUB_PAYLOAD, headers


def put_claims(
    store: PayloadStore | None, connection: Connection, rows: list[dict[str, Any]]
) -> None:
    """Store the claim-checked payloads of ``rows`` (taking them off the rows) on
    ``connection``. A row carrying one with no store configured is a bug: refused."""
    for row in rows:
        data = row.pop(ROW_KEY, None)
        if data is None:
            continue
        if store is None:
            raise RuntimeError("a claim-checked message, and no claim-check store configured")
        store.put(connection, str(row["id"]), data)
