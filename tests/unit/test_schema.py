"""The outbox table definition, its DDL and ``fastapi_outbox.metadata`` for Alembic."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.schema import CreateTable

import fastapi_outbox
from fastapi_outbox import ConfigurationError, build_table, metadata, outbox_table
from fastapi_outbox.storage.schema import ddl

ALEMBIC_ENV = Path(__file__).parents[2] / "examples" / "alembic" / "env.py"
ACTIVE = "WHERE status IN ('pending', 'processing', 'failed')"

#: Added to the default metadata by an Outbox with claim-check on the default table name.
CLAIM_CHECK_TABLE = "outbox_messages_payloads"


def test_default_metadata_holds_exactly_the_outbox_and_inbox_tables() -> None:
    from fastapi_outbox.storage.inbox import inbox_table

    # An Outbox with claim-check's database store adds its payloads table to its outbox
    # table's metadata (for create_tables and Alembic): other tests of the run may have.
    assert [t for t in metadata.tables if t != CLAIM_CHECK_TABLE] == [
        "outbox_messages",
        "outbox_inbox",
        "outbox_inbox_partitions",  # ordered subscribers' partition leases
        "outbox_inbox_members",
        "outbox_inbox_handlers",
        "outbox_inbox_attempts",
    ]
    assert metadata.tables["outbox_messages"] is outbox_table
    assert metadata.tables["outbox_inbox"] is inbox_table
    assert fastapi_outbox.metadata is metadata


def test_columns_of_the_data_model() -> None:
    assert [c.name for c in outbox_table.c] == [
        "id",
        "broker",
        "stream",
        "type",
        "key",
        "payload",
        "headers",
        "status",
        "attempts",
        "next_attempt_at",
        "locked_by",
        "locked_until",
        "last_error",
        "created_at",
        "published_at",
        "abandoned_at",
        "seq",
    ]
    assert [c.name for c in outbox_table.primary_key] == ["id"]
    nullable = {c.name for c in outbox_table.c if c.nullable}
    assert nullable == {
        "key",
        "locked_by",
        "locked_until",
        "last_error",
        "published_at",
        "abandoned_at",
    }


def test_custom_table_name_on_its_own_metadata() -> None:
    md = MetaData()
    table = build_table("shop_outbox", md)
    assert md.tables["shop_outbox"] is table
    assert {i.name for i in table.indexes} == {
        "ix_shop_outbox_due",
        "ix_shop_outbox_due_status",  # MySQL's claim index (no partial index there)
        "ix_shop_outbox_key",
        "ix_shop_outbox_published",
        "ix_shop_outbox_abandoned",
    }
    assert build_table("shop_outbox", md) is table  # idempotent per MetaData
    assert "shop_outbox" not in metadata.tables  # the default metadata is untouched


def test_custom_table_on_the_users_own_metadata() -> None:
    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(primary_key=True)

    build_table("orders_outbox", Base.metadata)
    assert set(Base.metadata.tables) == {"orders", "orders_outbox"}


def test_bad_table_name_names_table_name() -> None:
    with pytest.raises(ConfigurationError, match="table_name 'orders; drop table x'"):
        build_table("orders; drop table x")


def test_postgresql_ddl() -> None:
    text = ddl(outbox_table, postgresql.dialect())
    assert "CREATE TABLE outbox_messages" in text
    assert "id UUID NOT NULL" in text
    assert "payload JSONB NOT NULL" in text and "headers JSONB NOT NULL" in text
    assert "TIMESTAMP WITH TIME ZONE" in text
    assert (
        f"CREATE INDEX ix_outbox_messages_due ON outbox_messages (broker, next_attempt_at, id) "
        f"{ACTIVE}" in text
    )
    assert text.count("CREATE INDEX") == 4


def test_sqlite_ddl_has_the_same_partial_index() -> None:
    text = ddl(outbox_table, sqlite.dialect())
    assert "CREATE TABLE outbox_messages" in text
    assert "JSONB" not in text
    assert f"ix_outbox_messages_due ON outbox_messages (broker, next_attempt_at, id) {ACTIVE}" in (
        text
    )


@contextlib.contextmanager
def fake_alembic(offline: bool) -> Iterator[dict[str, Any]]:
    """Just enough of ``alembic.context`` to run the example env.py offline (alembic is an
    optional extra, not installed for the tests); records what env.py configures."""
    seen: dict[str, Any] = {}

    class Config:
        def get_main_option(self, name: str) -> str:
            return "sqlite+aiosqlite://"

    context = types.SimpleNamespace(
        config=Config(),
        is_offline_mode=lambda: offline,
        configure=lambda **kw: seen.update(kw),
        begin_transaction=contextlib.nullcontext,
        run_migrations=lambda: seen.setdefault("ran", True),
    )

    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(primary_key=True)

    alembic = types.ModuleType("alembic")
    alembic.context = context  # type: ignore[attr-defined]
    service = types.ModuleType("myservice")
    models = types.ModuleType("myservice.models")
    models.Base = Base  # type: ignore[attr-defined]
    stubs = {"alembic": alembic, "myservice": service, "myservice.models": models}
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        yield seen
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_alembic_example_env_targets_the_outbox_metadata() -> None:
    source = ALEMBIC_ENV.read_text()
    assert len(source.splitlines()) < 60  # a snippet, not a framework
    with fake_alembic(offline=True) as seen:
        exec(compile(source, str(ALEMBIC_ENV), "exec"), {"__name__": "env"})
    assert seen["ran"] is True
    targets = seen["target_metadata"]
    assert metadata in targets
    tables = {name for md in targets for name in md.tables}
    assert tables - {CLAIM_CHECK_TABLE} == {
        "orders",
        "outbox_messages",
        "outbox_inbox",
        "outbox_inbox_partitions",
        "outbox_inbox_members",
        "outbox_inbox_handlers",
        "outbox_inbox_attempts",
    }


def test_the_lease_table_on_the_alembic_metadata_counts_attempts() -> None:
    """Alembic's autogenerate sees the partition lease columns, the attempt count of the
    message after the position included; the columns added after the first layout take no
    value from rows already there (``db upgrade`` adds them to a table with rows)."""
    leases = metadata.tables["outbox_inbox_partitions"]
    assert [c.name for c in leases.c] == [
        "group",
        "stream",
        "partition",
        "partitions",
        "owner",
        "token",
        "position",
        "expires_at",
        "started",
        "attempts",
    ]
    assert leases.c.started.nullable
    assert not leases.c.attempts.nullable
    assert leases.c.attempts.server_default is not None
    ddl = str(CreateTable(leases).compile(dialect=postgresql.dialect()))
    assert "started VARCHAR(64)" in ddl and "attempts INTEGER DEFAULT '0' NOT NULL" in ddl
