"""The write path's port (``write.context.WriteContext``): ``Outbox`` provides every member
of it, and a unit of work needs nothing more (it works on a stand-in that has only those)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.payloads import build_payloads
from fastapi_outbox.write.context import WriteContext
from fastapi_outbox.write.session_events import Sink


def _members(protocol: type) -> set[str]:
    return {
        name
        for name, _ in inspect.getmembers(protocol)
        if not name.startswith("_") and name in vars(protocol)
    }


PORT_MEMBERS = _members(WriteContext) | _members(Sink)


class Placed(Event, stream="orders"):
    n: int


def test_the_port_is_small() -> None:
    assert {
        "committed",
        "external_brokers",
        "notify_after_commit",
        "notify_with_commit",
        "payloads",
        "resolve_broker",
        "session_factory",
        "settings",
        "trace_headers",
        "unit_of_work",
        "write_rows",
    } == PORT_MEMBERS


def test_outbox_provides_every_member() -> None:
    outbox = Outbox("sqlite+aiosqlite://", brokers={"default": MemoryBroker()})
    for name in PORT_MEMBERS:
        assert hasattr(outbox, name), name


class _Context:
    """Only the port's members."""

    def __init__(self) -> None:
        self.settings = OutboxSettings()
        self.session_factory: async_sessionmaker[AsyncSession] = async_sessionmaker(
            create_async_engine("sqlite+aiosqlite://")
        )
        self.external_brokers: dict[str, Any] = {"partner": object()}
        self.payloads = build_payloads(self.settings)

    def resolve_broker(self, name: str | None) -> str:
        return name or "default"

    def trace_headers(self, traceparent: str | None) -> dict[str, str]:
        return {}

    def unit_of_work(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    def write_rows(self, connection: Any, rows: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def notify_with_commit(self, brokers: Any) -> str | None:
        return None

    def committed(self, brokers: Any, *, notified: bool = False) -> bool:
        return False

    async def notify_after_commit(self) -> None:
        return None


def test_a_unit_of_work_needs_only_the_port() -> None:
    context = _Context()
    assert _members(_Context) == PORT_MEMBERS - {
        "settings",
        "session_factory",
        "external_brokers",
        "payloads",
    }
    uow = UnitOfWork(context, context.session_factory())
    uow.activate()
    uow.publish(Placed(n=1), broker="audit")
    assert [(r["broker"], r["stream"]) for r in uow.queued] == [("audit", "orders")]
    uow.close()
    with pytest.raises(Exception, match="already committed"):
        uow.publish(Placed(n=2))
