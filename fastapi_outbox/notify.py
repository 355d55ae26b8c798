"""Canonical: fastapi_outbox.relay.wakeups (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.relay.wakeups import (
    PING_PREFIX,
    RECONNECT_MAX_SECONDS,
    RECONNECT_MIN_SECONDS,
    RELEASE_TIMEOUT_SECONDS,
    Listener,
    Notifier,
    Wakeup,
    channel_name,
    set_keepalive,
)

__all__ = [
    "PING_PREFIX",
    "RECONNECT_MAX_SECONDS",
    "RECONNECT_MIN_SECONDS",
    "RELEASE_TIMEOUT_SECONDS",
    "Listener",
    "Notifier",
    "Wakeup",
    "channel_name",
    "set_keepalive",
]
