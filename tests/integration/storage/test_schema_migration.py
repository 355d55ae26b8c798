"""The README's hand-written Alembic migration: ``build_table(name).create(op.get_bind())``
runs on the synchronous connection Alembic hands to migrations."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, inspect

from fastapi_outbox import build_table


def test_build_table_create_makes_the_table_and_its_partial_indexes(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path}/migrated.db")
    try:
        with engine.begin() as connection:  # what op.get_bind() returns
            build_table("outbox_messages").create(connection)
        inspector = inspect(engine)
        assert inspector.get_table_names() == ["outbox_messages"]
        indexes = {i["name"] for i in inspector.get_indexes("outbox_messages")}
        assert {"ix_outbox_messages_due", "ix_outbox_messages_key"} <= indexes
    finally:
        engine.dispose()
