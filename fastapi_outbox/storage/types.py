"""The column types of the outbox tables and the statuses their partial indexes cover.

Below `schema` (which builds the tables with them) and the
statements (which bind values with them), so that neither imports the other's module.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Dialect, Text
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.types import DateTime, TypeDecorator, TypeEngine

from fastapi_outbox.events import MessageStatus

__all__ = ["ACTIVE_STATUSES", "JsonText", "UtcDateTime"]

#: Statuses of rows that still need work; the partial indexes cover exactly these.
ACTIVE_STATUSES = (MessageStatus.PENDING, MessageStatus.PROCESSING, MessageStatus.FAILED)


class UtcDateTime(TypeDecorator[dt.datetime]):
    """``timestamptz`` on PostgreSQL; on SQLite an ISO string in UTC that sorts as text; on
    MySQL a ``DATETIME(6)`` in UTC (microseconds, as the clock's ``UTC_TIMESTAMP(6)``)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(self.impl)

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is not None and dialect.name != "postgresql":
            if value.tzinfo is None:
                raise ValueError("naive datetime given for a UTC column")
            value = value.astimezone(dt.UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value


class JsonText(TypeDecorator[str]):
    """JSON stored and returned as already-encoded text (JSONB on PostgreSQL, ``LONGTEXT``
    on MySQL: its JSON type is text too, and ``TEXT`` stops at 64 KiB).

    No json.dumps/json.loads happens in SQLAlchemy: the unit of work encodes each payload
    once (it needs the size anyway) and the relay publishes the text it reads back.
    """

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.JSONB())
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.LONGTEXT())
        return dialect.type_descriptor(Text())

    def bind_processor(self, dialect: Dialect) -> Any:
        return None  # already JSON text

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        return None  # keep the JSON text
