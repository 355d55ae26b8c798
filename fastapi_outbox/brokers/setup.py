"""Which brokers an outbox has: the ones it was given, or the one ``OUTBOX_BROKER_URL``
names; which one is the default; each checked (names, de-duplication window) and
configured. The composition root ([`fastapi_outbox.outbox.Outbox`][fastapi_outbox.Outbox]) calls
`setup_brokers` once and `resolve_broker` per published event."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fastapi_outbox import config_checks, exceptions
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.redaction import remember
from fastapi_outbox.settings import OutboxSettings

__all__ = ["DEFAULT_BROKER", "NO_BROKER", "BrokerSetup", "resolve_broker", "setup_brokers"]

#: The broker an event goes to when it names none (and the one ``OUTBOX_BROKER_URL`` makes).
DEFAULT_BROKER = "default"
#: Why an outbox without brokers does not dispatch, and what to do about it.
NO_BROKER = (
    "no broker to dispatch to: pass brokers={'default': RedisStreamsBroker(...)} to Outbox "
    "(MemoryBroker() for tests and the embedded default), --broker-url to "
    "`fastapi-outbox dispatch`, or set OUTBOX_BROKER_URL "
    "(redis://, redis+cluster://, nats://, amqp://, kafka://, memory://); "
    "an API-only process sets run_relays=False"
)


@dataclasses.dataclass
class BrokerSetup:
    """An outbox's brokers: those it dispatches to, the external ones (written for, never
    dispatched to by this outbox) and the name of the default one."""

    brokers: dict[str, Broker]
    external_brokers: dict[str, Broker]
    default_broker: str


def setup_brokers(
    brokers: Mapping[str, Broker] | None,
    external: Mapping[str, Broker] | None,
    settings: OutboxSettings,
) -> BrokerSetup:
    """The brokers, checked and configured. No silent sink: without brokers (and without
    OUTBOX_BROKER_URL) an outbox can write rows for the "default" broker (an API-only
    process needs no broker connection) but refuses to dispatch. A memory broker only
    when asked for by name."""
    if brokers:
        internal: dict[str, Broker] = dict(brokers)
    elif settings.broker_url:
        from fastapi_outbox.brokers import broker_from_url

        internal = {DEFAULT_BROKER: broker_from_url(settings.broker_url)}
    else:
        internal = {}
    external_brokers: dict[str, Broker] = dict(external or {})
    config_checks.check_broker_names(internal, external_brokers)
    default = (
        next(iter(internal)) if internal and DEFAULT_BROKER not in internal else DEFAULT_BROKER
    )
    for broker_name, broker in {**internal, **external_brokers}.items():
        if isinstance(getattr(broker, "url", None), str):
            remember(broker.url)  # type: ignore[attr-defined]
        broker.configure(dedup_window_seconds=settings.dedup_window_seconds)
        config_checks.check_dedup_window(broker_name, broker, settings)
    return BrokerSetup(internal, external_brokers, default)


def resolve_broker(
    name: str | None,
    brokers: Mapping[str, Broker],
    external: Mapping[str, Broker],
    default: str,
) -> str:
    """The broker an event names (``default`` when it names none); UnknownBroker for a
    name that is not one of ``brokers`` (saying so when it is an external one). Without
    brokers, "default" is accepted: an API-only process writes rows for it."""
    if name is None:
        return default
    if name not in brokers and not (name == DEFAULT_BROKER and not brokers):
        hint = " (it is external: mark the event external=True)" if name in external else ""
        raise exceptions.UnknownBroker(
            f"no broker named {name!r}{hint}; configured: {', '.join(brokers)}"
        )
    return name
