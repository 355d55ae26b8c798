"""Canonical: fastapi_outbox.storage.inbox (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.storage.inbox import Inbox, build_inbox_table, inbox_table

__all__ = ["Inbox", "build_inbox_table", "inbox_table"]
