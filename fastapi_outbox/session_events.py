"""Canonical: fastapi_outbox.write.session_events (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.write.session_events import JOINED_KEY, STATE_KEY, SessionState, state_of

__all__ = ["JOINED_KEY", "STATE_KEY", "SessionState", "state_of"]
