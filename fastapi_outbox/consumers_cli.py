"""Canonical: fastapi_outbox.cli.consumers (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.cli.consumers import EXIT_OK, add_commands, add_replay_arguments, replay, run

__all__ = ["EXIT_OK", "add_commands", "add_replay_arguments", "replay", "run"]
