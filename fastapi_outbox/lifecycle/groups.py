"""Consumer groups before the first publish: a group created after a message was published
starts past it (``start="new"``, the default) and a RabbitMQ exchange drops what no queue
is bound to, so without this the simplest app would lose its first messages.

The relays publish through `GroupsFirst`, a broker wrapper whose ``connect``
declares this process's consumer groups on the broker once before it lets anything be
published, so the first message of a stream never reaches the broker before the groups of
the subscribers declared here exist. `gate_brokers` wraps the brokers that this
process's subscribers consume from and declares their groups before any relay starts,
bounded in time. `declare_groups` is the declaration itself
(``outbox.lifecycle.declare_groups()``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.consume.subscriber import Subscriber

__all__ = [
    "DECLARE_GROUPS_TIMEOUT_SECONDS",
    "GroupsFirst",
    "declare_groups",
    "declare_or_warn",
    "gate_brokers",
]

logger = logging.getLogger("fastapi_outbox.lifecycle")

#: Bound on declaring the consumer groups at start (a broker that does not answer in time
#: gets them declared before the first publish instead).
DECLARE_GROUPS_TIMEOUT_SECONDS = 5.0

Declare = Callable[[str], Awaitable[None]]


async def declare_groups(subscribers: Iterable[Subscriber], broker: str | None = None) -> None:
    """Create the broker-side group of every subscriber (of ``broker``, or all) — Redis
    consumer group, JetStream durable and dead-letter stream — or bring an existing
    one to the declared settings (idempotent). BrokerUnavailable when its broker does
    not answer; ConfigurationError naming the subscriber for anything else."""
    for sub in subscribers:
        if broker is not None and sub.broker_name != broker:
            continue
        consumer = sub.make_consumer()
        try:
            await consumer.setup()
        except exceptions.BrokerUnavailable:
            raise
        except Exception as exc:
            raise exceptions.ConfigurationError(
                f"{sub!r}: cannot create or update its consumer group on broker "
                f"{sub.broker_name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            with contextlib.suppress(Exception):
                await consumer.aclose()


class GroupsFirst:
    """A broker whose ``connect`` declares this process's consumer groups on it once
    (``outbox.lifecycle.declare_groups()``) before it lets anything be published: the
    table relays and the WAL relay publish through it, so the first message of a stream
    never reaches the broker before the groups of the subscribers declared here exist.
    Until they do,
    ``connect`` and ``publish`` raise what the declaration raised (BrokerUnavailable: the
    relay pauses and tries again). Everything else is the broker's own."""

    def __init__(self, broker: Broker, name: str, declare: Declare) -> None:
        self._broker = broker
        self._name = name
        self._declare = declare
        self._declared = False
        self._lock = anyio.Lock()

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._broker, attribute)

    def __repr__(self) -> str:
        return repr(self._broker)

    async def connect(self) -> None:
        await self._broker.connect()
        if self._declared:
            return
        async with self._lock:
            if not self._declared:
                await self._declare(self._name)
                self._declared = True
                logger.info(
                    "consumer groups declared",
                    extra={"action": "consumer.groups_declared", "broker": self._name},
                )

    async def publish(self, batch: Sequence[Any]) -> Any:
        if not self._declared:
            await self.connect()
        return await self._broker.publish(batch)

    async def aclose(self) -> None:
        await self._broker.aclose()

    async def ping(self) -> None:
        await self._broker.ping()

    def configure(self, *, dedup_window_seconds: float) -> None:
        self._broker.configure(dedup_window_seconds=dedup_window_seconds)


async def gate_brokers(
    brokers: Mapping[str, Broker], consumed: Collection[str], declare: Declare
) -> dict[str, Broker]:
    """The brokers the table relays and the WAL relay publish with: those in ``consumed``
    (this process's subscribers consume from them) are wrapped so that nothing is
    published to them before the subscribers' groups exist. The groups are
    declared here, before any relay starts, bounded in time; a broker that does not
    answer gets them declared by the first publish's connect, which waits until they are
    (a refusal of a group's settings refuses the start)."""
    out: dict[str, Broker] = dict(brokers)
    for name, broker in brokers.items():
        if name not in consumed:
            continue
        gated = GroupsFirst(broker, name, declare)
        out[name] = gated
        await declare_or_warn(
            gated.connect,
            "consumer groups not declared yet: dispatch to this broker waits for them",
            broker=name,
        )
    return out


async def declare_or_warn(
    declare: Callable[[], Awaitable[None]], message: str, **extra: Any
) -> bool:
    """Run ``declare`` (a declaration of consumer groups) within
    ``DECLARE_GROUPS_TIMEOUT_SECONDS``; a broker that does not answer is warned about
    (``message``, action ``consumer.groups_pending``), not raised: False then. Anything
    else it raises (a refusal of a group's settings) is raised."""
    try:
        with anyio.fail_after(DECLARE_GROUPS_TIMEOUT_SECONDS):
            await declare()
    except (exceptions.BrokerUnavailable, TimeoutError) as exc:
        logger.warning(
            message,
            extra={
                "action": "consumer.groups_pending",
                **extra,
                "error": f"{type(exc).__name__}: {exc}"[:300],
            },
        )
        return False
    return True
