"""Port conformance (as pgqueuer's ``test_port_conformance.py``): ``ops/`` is typed against
:mod:`fastapi_outbox.ops.port`, and the objects the outbox really builds must offer every
member of it, methods with the same signature. ``mypy --strict`` checks the same wherever
the package hands an ``Outbox`` to ``ops/``; this catches a member renamed or a signature
changed on one side only, at run time and without a database (nothing here connects)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.ops import port
from fastapi_outbox.relay.table import TableRelay
from fastapi_outbox.relay.wakeups import Listener
from fastapi_outbox.relay.wal import WalRelay
from fastapi_outbox.storage.archive import Archive
from fastapi_outbox.storage.wal_slot import WalSlot


def members(protocol: type) -> dict[str, Any]:
    """The members a protocol declares: its properties and methods by name."""
    return {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


@pytest.fixture
def outbox() -> Outbox:
    box = Outbox(
        "sqlite+aiosqlite://",
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_dispatchers=False),
        dashboard_dependencies=[],
    )

    @box.subscriber("orders", group="billing")
    async def bill(event: Message) -> None:  # pragma: no cover - never called
        del event

    return box


def built(outbox: Outbox) -> dict[type, Any]:
    """The object the outbox builds for each protocol of the port."""
    slot = WalSlot(outbox.engine, "outbox_slot", outbox.table.name)
    return {
        port.OutboxPort: outbox,
        port.MessageStore: outbox.store,
        port.InboxView: outbox.inbox,
        port.RelayState: TableRelay(
            store=outbox.store,
            broker_name="default",
            broker=outbox.brokers["default"],
            settings=outbox.settings,
            instance=outbox.instance,
        ),
        port.WalRelayState: WalRelay(
            store=outbox.store,
            slot=slot,
            brokers=outbox.brokers,
            settings=outbox.settings,
            instance=outbox.instance,
        ),
        port.SlotView: slot,
        port.ListenerState: Listener(outbox.store, outbox.channel, outbox.instance, lambda: None),
        port.SubscriberView: outbox.subscribers[0],
        port.ArchiveView: Archive(outbox.engine, outbox.table, "outbox_messages_archive"),
    }


PROTOCOLS = [
    port.OutboxPort,
    port.MessageStore,
    port.InboxView,
    port.RelayState,
    port.WalRelayState,
    port.SlotView,
    port.ListenerState,
    port.SubscriberView,
    port.ArchiveView,
]


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_the_outbox_parts_offer_every_member_of_the_port(outbox: Outbox, protocol: type) -> None:
    obj = built(outbox)[protocol]
    declared = members(protocol)
    assert declared, protocol
    for name, member in declared.items():
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {protocol.__name__}.{name}"
        if isinstance(member, property):
            continue
        # A method: the same parameters (names, kinds, defaults), sync or async alike.
        theirs = inspect.signature(getattr(type(obj), name))
        ours = inspect.signature(member)
        assert [(p.name, p.kind, p.default) for p in theirs.parameters.values()] == [
            (p.name, p.kind, p.default) for p in ours.parameters.values()
        ], f"{type(obj).__name__}.{name}{theirs} is not {protocol.__name__}.{name}{ours}"
        assert inspect.iscoroutinefunction(getattr(type(obj), name)) == (
            inspect.iscoroutinefunction(member)
        ), f"{type(obj).__name__}.{name}: async on one side only"


def test_outbox_is_an_outbox_port(outbox: Outbox) -> None:
    view: port.OutboxPort = outbox  # mypy: the structural check itself
    assert isinstance(view, port.OutboxPort)
    assert list(view.all_brokers) == ["default"]
    assert view.subscribers[0].dead_letters_unwritten == 0
    assert port.relay_here(view, "default") is None  # the dispatchers do not run here
