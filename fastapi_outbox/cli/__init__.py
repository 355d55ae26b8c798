"""The command line: ``fastapi-outbox`` (entry point ``fastapi_outbox.cli:main``).

It owns argument parsing, loading the application's ``Outbox`` and the commands: the schema
and health commands (``main``), the operator commands on messages (``admin``), the consumer
and dead-letter commands (``consumers``) and what they share (``support``: output, exit codes,
database-outage messages). It may import anything; nothing in the library imports it.
"""

from __future__ import annotations

from fastapi_outbox.cli.main import (
    BROKER_URL_ENV,
    build_parser,
    configure_logging,
    dispatch,
    load_outbox,
    main,
    resolve_outbox,
)

__all__ = [
    "BROKER_URL_ENV",
    "build_parser",
    "configure_logging",
    "dispatch",
    "load_outbox",
    "main",
    "resolve_outbox",
]
