"""What a user may rely on of ``Outbox`` and ``UnitOfWork``: the API reference and ``dir()``
show it, and nothing the library alone calls (rows written, wake-ups after a commit, the
unit of work's activation) is among it."""

from __future__ import annotations

from fastapi_outbox import Outbox, UnitOfWork

OUTBOX_PUBLIC = {
    "aclose",
    "all_brokers",
    "asyncapi",
    "asyncapi_router",
    "brokers",
    "cancel",
    "consumers_status",
    "create_tables",
    "dashboard_router",
    "default_broker",
    "dependency",
    "drop_tables",
    "external_brokers",
    "health_router",
    "lifespan",
    "load_tenants",
    "relaying",
    "router",
    "session_factory",
    "subscriber",
    "tenant_outbox",
    "unit_of_work",
}
UNIT_OF_WORK_PUBLIC = {"flush", "pending", "publish", "queued"}
PLUMBING = {
    "write_rows",
    "committed",
    "notify_after_commit",
    "notify_with_commit",
    "side_tables",
    "make_unit_of_work",
    "harvest",
    "activate",
    "take_notify",
    "mark_committed",
    "close",
    "dispatcher",
    "processors",
}


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_outbox_shows_what_users_call_and_no_plumbing() -> None:
    assert _public(Outbox) == OUTBOX_PUBLIC
    assert not _public(Outbox) & PLUMBING


def test_unit_of_work_shows_what_users_call_and_no_plumbing() -> None:
    assert _public(UnitOfWork) == UNIT_OF_WORK_PUBLIC
    assert not _public(UnitOfWork) & PLUMBING


def test_public_methods_are_typed() -> None:
    """No ``Any`` in what the HTTP surface and the decorator return."""
    import typing

    from fastapi import APIRouter

    for name in ("router", "health_router", "dashboard_router", "asyncapi_router"):
        prop = getattr(Outbox, name)
        assert typing.get_type_hints(prop.fget)["return"] is APIRouter, name
    hints = typing.get_type_hints(Outbox.subscriber)
    assert hints["return"] is not typing.Any
    assert typing.get_type_hints(Outbox.dependency.fget)["return"] is not typing.Any
