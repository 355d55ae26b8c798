"""The port ``consume/`` sees: ``Outbox`` satisfies ``ConsumeContext`` (mypy checks the
types where the composition root passes itself; this checks every member is there), and
nothing in ``consume/`` imports ``fastapi_outbox.outbox``."""

from __future__ import annotations

import ast
import pathlib

import fastapi_outbox.consume
from fastapi_outbox import Outbox
from fastapi_outbox.brokers.memory import MemoryBroker
from fastapi_outbox.consume.context import AfterCommit, ConsumeContext
from fastapi_outbox.consume.handlers import BatchUnitOfWork
from fastapi_outbox.write.unit_of_work import UnitOfWork


def _members(protocol: type) -> set[str]:
    return {
        name
        for cls in protocol.__mro__
        if cls not in (object,) and cls.__name__ not in ("Protocol", "Generic")
        for name in vars(cls)
        if not name.startswith("_")
    }


def test_outbox_has_every_member_of_the_port(tmp_path: pathlib.Path) -> None:
    outbox = Outbox(f"sqlite+aiosqlite:///{tmp_path}/c.db", brokers={"m": MemoryBroker()})
    members = _members(ConsumeContext)
    assert {"engine", "inbox", "notify_after_commit", "make_unit_of_work"} <= members
    assert _members(AfterCommit) <= members
    missing = [name for name in sorted(members) if not hasattr(outbox, name)]
    assert missing == []
    context: ConsumeContext = outbox
    assert dict(context.brokers) == outbox.brokers
    assert context.default_broker == "m"


async def test_make_unit_of_work_builds_the_class_asked_for(tmp_path: pathlib.Path) -> None:
    outbox = Outbox(f"sqlite+aiosqlite:///{tmp_path}/c.db", brokers={"m": MemoryBroker()})
    async with outbox.session_factory() as session:
        for cls in (UnitOfWork, BatchUnitOfWork):
            uow = outbox.make_unit_of_work(
                cls, session, correlation_id="c-1", causation_id="m-1", traceparent=None
            )
            assert type(uow) is cls
            assert (uow.outbox, uow.session) == (outbox, session)
            assert (uow.correlation_id, uow.causation_id) == ("c-1", "m-1")
    await outbox.aclose()


def test_consume_never_imports_the_outbox() -> None:
    root = pathlib.Path(fastapi_outbox.consume.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert "fastapi_outbox.outbox" not in names, path.name
