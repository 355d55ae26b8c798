"""Canonical: fastapi_outbox.storage.wal_slot (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.storage.wal_slot import (
    Read,
    SlotStats,
    Transaction,
    Undecodable,
    UndecodableWalMessage,
    WalMessage,
    WalSlot,
    decode,
    encode,
)

__all__ = [
    "Read",
    "SlotStats",
    "Transaction",
    "Undecodable",
    "UndecodableWalMessage",
    "WalMessage",
    "WalSlot",
    "decode",
    "encode",
]
