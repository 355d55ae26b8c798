"""Canonical: fastapi_outbox.storage.doctor (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.storage.doctor import (
    DOCTOR_AHEAD_SECONDS,
    LOCK_NOT_AVAILABLE,
    OBSOLETE_COLUMNS,
    UPGRADE_LOCK_ATTEMPTS,
    UPGRADE_LOCK_TIMEOUT_SECONDS,
    UPGRADE_RETRY_PAUSE_SECONDS,
    Finding,
    UpgradeLockTimeout,
    examine,
    examine_sync,
    upgrade,
)

__all__ = [
    "DOCTOR_AHEAD_SECONDS",
    "LOCK_NOT_AVAILABLE",
    "OBSOLETE_COLUMNS",
    "UPGRADE_LOCK_ATTEMPTS",
    "UPGRADE_LOCK_TIMEOUT_SECONDS",
    "UPGRADE_RETRY_PAUSE_SECONDS",
    "Finding",
    "UpgradeLockTimeout",
    "examine",
    "examine_sync",
    "upgrade",
]
