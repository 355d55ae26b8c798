"""Canonical: fastapi_outbox.cli.support (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.cli.support import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
    confirm,
    destructive_options,
    guard,
    operator_name,
    render_table,
    sqlstate,
    target,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CliError",
    "confirm",
    "destructive_options",
    "guard",
    "operator_name",
    "render_table",
    "sqlstate",
    "target",
]
