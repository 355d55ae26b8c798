"""Canonical: fastapi_outbox.cli.admin (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.cli.admin import (
    PROBLEMS_SHOWN,
    Progress,
    add_commands,
    parse_duration,
    parse_uuid,
    read_ids,
    run,
)

__all__ = [
    "PROBLEMS_SHOWN",
    "Progress",
    "add_commands",
    "parse_duration",
    "parse_uuid",
    "read_ids",
    "run",
]
