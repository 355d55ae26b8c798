"""Logs are structured (action + ids) and never carry payloads or credentials."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import select

from fastapi_outbox import BrokerUnavailable, Message, MessageRejected, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.events import Envelope
from fastapi_outbox.log import JsonFormatter, TextFormatter, redact, safe_error
from fastapi_outbox.testing import drain

SECRET = "card-4111-1111-TOPSECRET"
PASSWORD = "hunter2-Pw9x"
BROKER_URL = f"redis://app:{PASSWORD}@10.1.2.3:6379/0"


class LeakyBroker(MemoryBroker):
    """A broker whose errors quote its URL (password included) or the message itself,
    as third-party clients sometimes do."""

    mode = "reject"

    async def publish(self, batch: Sequence[Envelope]) -> Any:
        if self.mode == "down":
            raise BrokerUnavailable(f"connection to {BROKER_URL} refused")
        if self.mode == "bug":
            raise ValueError(f"cannot encode {batch[0].payload.decode()} for {BROKER_URL}")
        return [MessageRejected(f"{BROKER_URL} refused the message") for _ in batch]


def rendered(records: list[logging.LogRecord]) -> list[str]:
    json_fmt, text_fmt = JsonFormatter(), TextFormatter()
    return [f(r) for r in records for f in (json_fmt.format, text_fmt.format)] + [
        repr(r.__dict__) for r in records
    ]


async def test_failing_publish_logs_ids_never_payload_or_password(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker = LeakyBroker()
    outbox = Outbox(
        f"sqlite+aiosqlite:///{tmp_path}/log.db",
        brokers={"default": broker},
        settings=OutboxSettings(run_relays=False, max_attempts=3, retry_base_delay_seconds=0),
    )
    await outbox.create_tables()
    caplog.set_level(logging.DEBUG, logger="fastapi_outbox")
    try:
        async with outbox.unit_of_work() as uow:
            message_id = uow.publish(
                Message(stream="payments", type="Charged", payload={"card": SECRET})
            )
        # Attempt 1 refused, broker down (attempt refunded), attempt 2 hits a broker bug,
        # attempt 3 refused: abandoned.
        for mode in ("reject", "down", "bug", "reject"):
            broker.mode = mode
            await drain(outbox, max_batches=1)
        async with outbox.engine.connect() as conn:
            stored = (
                await conn.execute(select(outbox.table.c.status, outbox.table.c.last_error))
            ).one()
    finally:
        await outbox.aclose()

    ours = [r for r in caplog.records if r.name.startswith("fastapi_outbox")]
    actions = {getattr(r, "action", None) for r in ours}
    assert {"publish.failed", "broker.unavailable", "publish.error", "publish.abandoned"} <= actions
    assert all(getattr(r, "action", None) for r in ours)  # every record names its action
    for r in ours:
        if r.action in ("publish.failed", "publish.abandoned"):
            assert r.message_id == str(message_id)
            assert r.broker == "default"
    for line in rendered(caplog.records):
        assert SECRET not in line
        assert PASSWORD not in line
    # What the table keeps for operators is scrubbed the same way.
    assert stored.status == "abandoned"
    assert PASSWORD not in stored.last_error and SECRET not in stored.last_error
    assert "app:***@10.1.2.3" in stored.last_error


def test_json_formatter() -> None:
    record = logging.LogRecord(
        "fastapi_outbox.x", logging.WARNING, __file__, 1, "hello %s", ("w",), None
    )
    record.action = "publish.failed"
    record.message_id = "0190-abc"
    record.brokers = ["a", "b"]
    data = json.loads(JsonFormatter().format(record))
    assert data["message"] == "hello w"
    assert data["level"] == "WARNING"
    assert data["logger"] == "fastapi_outbox.x"
    assert data["action"] == "publish.failed"
    assert data["message_id"] == "0190-abc"
    assert data["brokers"] == ["a", "b"]
    assert data["ts"].endswith("+00:00")


def test_json_formatter_exception_is_scrubbed() -> None:
    try:
        raise ConnectionError(f"cannot connect to {BROKER_URL}")
    except ConnectionError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    data = json.loads(JsonFormatter().format(record))
    assert data["exc_type"] == "ConnectionError"
    assert PASSWORD not in data["exc"]
    assert "app:***@10.1.2.3" in data["exc"]


def test_safe_error_and_redact() -> None:
    from sqlalchemy.exc import IntegrityError

    exc = IntegrityError("UPDATE t SET x=$1", {"error": SECRET}, Exception("duplicate key"))
    text = safe_error(exc)
    assert SECRET not in text and "[SQL" not in text
    assert text.startswith("IntegrityError: ")
    assert redact("postgresql://u:p4ss@h/db and password=s3cr3t") == (
        "postgresql://u:***@h/db and password=***"
    )
    assert redact("redis://:p4ss@h:6379") == "redis://:***@h:6379"
    assert len(safe_error(RuntimeError("x" * 1000))) == 300
    group = ExceptionGroup("group", [KeyError("k")])
    assert safe_error(group) == "KeyError: 'k'"


def test_loggers_are_named_after_the_package_that_logs() -> None:
    # A logging configuration filters by package (``fastapi_outbox.relay``, ``.consume``…):
    # each module logs under its own package or an ancestor of it, never a name of its own.
    import ast
    import importlib.util
    from pathlib import Path

    import fastapi_outbox

    root = Path(fastapi_outbox.__file__).parent
    checked = 0
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("fastapi_outbox", *path.relative_to(root).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getLogger"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("fastapi_outbox")
            ):
                continue
            name = str(node.args[0].value)
            checked += 1
            assert module == name or module.startswith(name + "."), f"{module} logs as {name}"
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.submodule_search_locations, f"{name}: not a package"
    assert checked > 20
