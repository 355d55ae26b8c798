"""The database of one tenant of a multi-tenant outbox: its own URL (a database per
tenant) or a schema of a shared database (a schema per tenant), whose connections set
``search_path`` to it, so every statement of the outbox — and the application's own —
finds that tenant's tables without naming a schema."""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox import exceptions
from fastapi_outbox.storage.engine import create_engine

__all__ = ["create_schema", "is_schema", "tenant_engine"]

_SCHEMA = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def is_schema(target: str) -> bool:
    """A tenant's target is a schema name (rather than a database URL)."""
    return "://" not in target


def tenant_engine(target: str, base: URL | None, options: dict[str, Any]) -> AsyncEngine:
    """An engine for a tenant's database URL, or for its schema in the database ``base``
    (PostgreSQL only)."""
    if not is_schema(target):
        return create_engine(target, options)
    if not _SCHEMA.match(target):
        raise exceptions.ConfigurationError(
            f"tenant schema {target!r}: a schema is a plain identifier (letters, digits, _)"
        )
    if base is None or base.get_backend_name() != "postgresql":
        raise exceptions.ConfigurationError(
            f"tenant schema {target!r}: a schema per tenant needs Outbox(database) to be "
            "a PostgreSQL URL (the database the schemas are in); give SQLite tenants a URL"
        )
    engine = create_engine(make_url(base).render_as_string(hide_password=False), options)

    @event.listens_for(engine.sync_engine, "connect")
    def _search_path(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f'SET search_path TO "{target}"')
        finally:
            cursor.close()
        # A session-level SET outlives the transaction it ran in only once committed.
        dbapi_connection.commit()

    return engine


async def create_schema(engine: AsyncEngine, schema: str) -> None:
    """``CREATE SCHEMA IF NOT EXISTS`` a tenant's schema (before its tables)."""
    async with engine.begin() as conn:
        await conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))


async def close_idle(engine: AsyncEngine) -> None:
    """Close the connections of ``engine``'s pool that nobody uses now (a tenant whose
    relay turns ended), each one properly: taken from the pool and invalidated, so the
    pool itself — and the connections in use — stay as they are."""
    checkedin = getattr(engine.pool, "checkedin", None)
    for _ in range(0 if checkedin is None else int(checkedin())):
        async with engine.connect() as conn:
            await conn.invalidate()
