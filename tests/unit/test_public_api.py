"""The documented public surface: the four public modules' ``__all__``, ``py.typed``, the
``Event`` keywords. Internal modules are not pinned: their names may move."""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

import pytest

import fastapi_outbox
from fastapi_outbox import (
    AggregateRoot,
    Event,
    EventDefinitionError,
    Message,
    Outbox,
    OutboxSettings,
    UnitOfWork,
    UnitOfWorkDep,
    unit_of_work,
)
from fastapi_outbox import brokers as brokers_module
from fastapi_outbox.brokers import (
    MemoryBroker,
    NatsJetStreamBroker,
    RabbitMQBroker,
    RedisStreamsBroker,
)

PACKAGE_DIR = Path(fastapi_outbox.__file__).parent

# The documented surface: the four public modules and their ``__all__``, sorted. Every other
# module is internal (its names may move); what a user's code needs is exported here.
PUBLIC_ALL: dict[str, list[str]] = {
    "fastapi_outbox": [
        "AggregateRoot",
        "AuthenticationFailed",
        "BatchUnitOfWork",
        "BrokerRefusing",
        "BrokerUnavailable",
        "ConfigurationError",
        "Envelope",
        "Event",
        "EventDefinitionError",
        "JsonFormatter",
        "Message",
        "MessageRejected",
        "MessageStatus",
        "Outbox",
        "OutboxError",
        "OutboxSettings",
        "PayloadTooLarge",
        "PrometheusInstrumentation",
        "PublishError",
        "SerializationError",
        "TextFormatter",
        "UnitOfWork",
        "UnitOfWorkDep",
        "UnitOfWorkError",
        "UnknownBroker",
        "UnknownTenant",
        "__version__",
        "build_archive_table",
        "build_table",
        "metadata",
        "metrics_router",
        "mount_metrics",
        "outbox_table",
        "unit_of_work",
        "uuid7",
    ],
    "fastapi_outbox.brokers": [
        "Broker",
        "KafkaBroker",
        "MemoryBroker",
        "NatsJetStreamBroker",
        "PublishResults",
        "RabbitMQBroker",
        "RedisStreamsBroker",
        "broker_from_url",
        "redact_url",
    ],
    "fastapi_outbox.exceptions": [
        "AuthenticationFailed",
        "BrokerError",
        "BrokerRefusing",
        "BrokerTimeout",
        "BrokerUnavailable",
        "CommitOutcomeUnknown",
        "ConfigurationError",
        "EventDefinitionError",
        "HandlerEscaped",
        "MessageNotFound",
        "MessageRejected",
        "OperationError",
        "OutboxError",
        "PayloadTooLarge",
        "PayloadUnreadable",
        "PublishError",
        "SerializationError",
        "StaleDeadLetters",
        "TooLate",
        "UnitOfWorkError",
        "UnknownBroker",
        "UnknownEncryptionKey",
        "UnknownTenant",
        "UnstorableText",
    ],
    "fastapi_outbox.testing": [
        "OutboxHarness",
        "UndecodableWalMessage",
        "drain",
        "memory_broker",
        "sqlite_outbox",
    ],
}


def test_design_names_are_importable() -> None:
    # The import block at the top is what the README shows a user importing; these are the objects.
    assert isinstance(Outbox, type) and isinstance(OutboxSettings, type)
    assert isinstance(UnitOfWork, type) and callable(unit_of_work)
    assert issubclass(Event, object) and isinstance(AggregateRoot, type)
    assert {MemoryBroker, RedisStreamsBroker, NatsJetStreamBroker, RabbitMQBroker} <= {
        getattr(brokers_module, n) for n in brokers_module.__all__
    }


@pytest.mark.parametrize("module", sorted(PUBLIC_ALL))
def test_public_all_is_pinned_sorted_and_every_name_resolves(module: str) -> None:
    import importlib

    public = importlib.import_module(module)
    assert list(public.__all__) == sorted(public.__all__), f"{module}.__all__ is not sorted"
    assert list(public.__all__) == PUBLIC_ALL[module]
    for name in public.__all__:
        assert getattr(public, name) is not None, f"{module}.{name}"


def test_every_exception_is_public() -> None:
    from fastapi_outbox import exceptions

    raised = {
        name
        for name, value in vars(exceptions).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == exceptions.__name__
    }
    assert raised == set(exceptions.__all__)


def test_py_typed_is_shipped() -> None:
    marker = PACKAGE_DIR / "py.typed"
    assert marker.is_file()
    # Tracked by git and not ignored: hatchling builds the wheel from the package
    # directory and honours .gitignore, so this is what keeps py.typed in the wheel.
    root = PACKAGE_DIR.parent
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", "fastapi_outbox/py.typed"],
        cwd=root,
        capture_output=True,
        check=False,
    )
    assert tracked.returncode == 0, tracked.stderr
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "fastapi_outbox/py.typed"], cwd=root, check=False
    )
    assert ignored.returncode == 1  # 1 = not ignored
    pyproject = (root / "pyproject.toml").read_text()
    assert 'packages = ["fastapi_outbox"]' in pyproject
    assert '"Typing :: Typed"' in pyproject


def test_event_class_keywords() -> None:
    class OrderPlaced(Event, stream="orders", key="order_id", external=True):
        order_id: int
        total: float

    class Internal(Event, stream="audit"):
        what: str

    message = OrderPlaced(order_id=3, total=9.5).to_message()
    assert (message.stream, message.type, message.key, message.external) == (
        "orders",
        "OrderPlaced",
        "3",
        True,
    )
    assert message.payload == {"order_id": 3, "total": 9.5}
    internal = Internal(what="x").to_message()
    assert (internal.key, internal.external) == (None, False)


def test_event_without_stream_is_refused_at_definition_naming_stream() -> None:
    with pytest.raises(EventDefinitionError) as info:

        class Orphan(Event):
            x: int

    assert "stream" in str(info.value) and "Orphan" in str(info.value)


@pytest.mark.parametrize("stream", ["", "   "])
def test_event_with_empty_stream_is_refused(stream: str) -> None:
    with pytest.raises(EventDefinitionError, match="stream"):

        class Blank(Event, stream=stream):
            x: int


def test_message_is_the_explicit_envelope_for_publish() -> None:
    message = Message(stream="orders", type="Custom", payload={"a": 1}, key="k", headers={"h": "v"})
    assert (message.stream, message.type, message.payload, message.key, message.headers) == (
        "orders",
        "Custom",
        {"a": 1},
        "k",
        {"h": "v"},
    )


def test_unit_of_work_dep_is_an_annotated_alias_of_the_dependency() -> None:
    assert typing.get_origin(UnitOfWorkDep) is typing.Annotated
    origin, depends = typing.get_args(UnitOfWorkDep)
    assert origin is UnitOfWork
    assert depends.dependency is unit_of_work


def test_publish_signature_matches_the_contract() -> None:
    import inspect

    params = inspect.signature(UnitOfWork.publish).parameters
    assert list(params) == [
        "self", "event", "key", "headers", "broker", "delay", "deliver_at"
    ]  # fmt: skip
    for name in ("key", "headers", "broker", "delay", "deliver_at"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default is None


CAPABILITY_PACKAGES = [
    "fastapi_outbox.storage",
    "fastapi_outbox.payloads",
    "fastapi_outbox.write",
    "fastapi_outbox.relay",
    "fastapi_outbox.consume",
    "fastapi_outbox.ops",
    "fastapi_outbox.cli",
    "fastapi_outbox.brokers",
    "fastapi_outbox.brokers.redis",
    "fastapi_outbox.brokers.nats",
    "fastapi_outbox.brokers.memory",
]


def _public_modules() -> list[str]:
    import pkgutil

    names = (m.name for m in pkgutil.walk_packages(fastapi_outbox.__path__, "fastapi_outbox."))
    return sorted(n for n in names if n != "fastapi_outbox.__main__")


def test_no_module_forwards_to_another() -> None:
    # Every module is the one home of its names: no module only re-exports another's.
    import importlib

    for name in _public_modules():
        doc = importlib.import_module(name).__doc__ or ""
        assert not doc.startswith("Canonical:"), name


def test_each_capability_package_says_what_it_owns() -> None:
    import importlib

    for name in CAPABILITY_PACKAGES:
        doc = importlib.import_module(name).__doc__
        assert doc and len(doc.split()) >= 15, name


def test_unit_of_work_is_the_dependency_not_a_module() -> None:
    code = (
        "import fastapi_outbox, importlib.util, inspect\n"
        "assert inspect.isfunction(fastapi_outbox.unit_of_work), fastapi_outbox.unit_of_work\n"
        "assert importlib.util.find_spec('fastapi_outbox.unit_of_work') is None\n"
        "from fastapi_outbox.cli import main\n"
        "assert inspect.isfunction(main)\n"
    )
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
