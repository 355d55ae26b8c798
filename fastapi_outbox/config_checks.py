"""The checks an ``Outbox`` makes of its configuration before it does anything: the
database it is given, its broker names, each broker's de-duplication window against the
settings, and the settings that need a given database (``partitioning``, ``capture="wal"``).

They look at plain values (a dialect name, a driver name, broker names, a broker's window)
and raise [`ConfigurationError`][fastapi_outbox.ConfigurationError] with a message that names
the setting or the broker, so each is unit-tested without a database. The composition root
(`fastapi_outbox.outbox`) calls them; ``OutboxSettings`` checks what a setting can
decide on its own (`fastapi_outbox.settings`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.settings import OutboxSettings

__all__ = [
    "SUPPORTED_DIALECTS",
    "check_broker_names",
    "check_database",
    "check_dedup_window",
    "check_partitioning",
    "check_wal_capture",
]

#: The databases an outbox runs on.
SUPPORTED_DIALECTS = ("postgresql", "sqlite", "mysql")
_BROKER_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_database(dialect: str) -> None:
    """PostgreSQL, SQLite or MariaDB/MySQL (``mysql``), nothing else."""
    if dialect not in SUPPORTED_DIALECTS:
        raise exceptions.ConfigurationError(
            f"unsupported database {dialect!r}: use PostgreSQL, SQLite or MariaDB/MySQL"
        )


def check_broker_names(internal: Iterable[Any], external: Iterable[Any]) -> None:
    """Each name 1-64 letters, digits, ``_``, ``.``, ``-``; none both internal and
    external."""
    internal, external = list(internal), list(external)
    for name in (*internal, *external):
        if not isinstance(name, str) or not _BROKER_NAME.match(name):
            raise exceptions.ConfigurationError(
                f"invalid broker name {name!r}: 1-64 letters, digits, '_', '.', '-'"
            )
    clash = set(internal) & set(external)
    if clash:
        raise exceptions.ConfigurationError(
            f"broker names used as internal and external: {', '.join(sorted(clash))}"
        )


def check_dedup_window(name: str, broker: Any, settings: OutboxSettings) -> None:
    """Refuse a broker whose de-duplication window (set on the broker itself) is shorter
    than a republish can come late: after a lease expires, after the longest backoff, or
    after the longest outage it is meant to absorb."""
    window = getattr(broker, "dedup_window_seconds", None)
    needed = settings.dedup_window_needed_seconds
    if isinstance(window, int | float) and window < needed:
        raise exceptions.ConfigurationError(
            f"broker {name!r}: its de-duplication window ({window:g} s) is shorter than "
            "lease_seconds + retry_max_delay_seconds + dedup_outage_seconds "
            f"({needed:g} s), so a message republished after a lease expiry, the longest "
            "backoff or an outage would appear twice: raise the broker's "
            "dedup_window_seconds or lower those settings"
        )


def check_partitioning(partitioning: str | None, dialect: str) -> None:
    """``partitioning`` (a time-partitioned table) needs PostgreSQL."""
    if partitioning is not None and dialect != "postgresql":
        raise exceptions.ConfigurationError(
            f"partitioning={partitioning!r} (OUTBOX_PARTITIONING) needs PostgreSQL; "
            f"{dialect} keeps one plain table: leave partitioning unset"
        )


def check_wal_capture(dialect: str, driver: str) -> None:
    """``capture="wal"`` writes with ``pg_logical_emit_message`` and reads the slot through
    asyncpg: PostgreSQL through asyncpg only."""
    if dialect != "postgresql" or driver != "asyncpg":
        raise exceptions.ConfigurationError(
            f"capture='wal' (OUTBOX_CAPTURE) needs PostgreSQL through asyncpg "
            f"(postgresql+asyncpg://…), not {dialect}+{driver}: use capture='table'"
        )


def check_tenants(settings: Any) -> None:
    """A multi-tenant outbox keeps its messages in the outbox table of each tenant: the
    table capture only, and claim-checked payloads are not supported there yet."""
    if settings.capture != "table":
        raise exceptions.ConfigurationError(
            f'tenants=: capture="{settings.capture}" is not supported; tenants need capture="table"'
        )
    if settings.claim_check_bytes is not None:
        raise exceptions.ConfigurationError(
            "tenants=: claim_check_bytes is not supported with tenants (payloads stay in "
            "each tenant's outbox rows)"
        )
