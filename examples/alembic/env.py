"""Alembic ``env.py`` (async) for a service that uses fastapi-outbox.

The one outbox-specific line is ``target_metadata``: list ``fastapi_outbox.metadata`` next to
your own models' metadata, and ``alembic revision --autogenerate`` adds the outbox table and
its partial indexes to your migrations. With a custom ``OUTBOX_TABLE_NAME``, put the table on
your own metadata instead: ``fastapi_outbox.build_table("my_outbox", Base.metadata)``.
"""

from __future__ import annotations

import asyncio

from alembic import context
from myservice.models import Base  # your declarative Base (hypothetical module)
from sqlalchemy.ext.asyncio import create_async_engine

import fastapi_outbox

target_metadata = [Base.metadata, fastapi_outbox.metadata]
url = context.config.get_main_option("sqlalchemy.url")


def run_sync_migrations(connection: object) -> None:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


async def run_online() -> None:
    engine = create_async_engine(url)
    async with engine.connect() as conn:
        await conn.run_sync(run_sync_migrations)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(run_online())
