"""The app the crash tests dispatch: ``fastapi-outbox dispatch --app <this module>:outbox``.

Configuration comes from the environment: ``DATABASE_URL``, ``BROKER_URL`` and the usual
``OUTBOX_*`` settings (table name, lease, ...). With ``CRASH_ON_POISON=1`` the broker ends
the process with exit code :data:`POISON_EXIT_CODE` as soon as it is asked to publish a
payload marked ``"poison": true``: a message that crashes its relay on every attempt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import Broker, PublishResults, broker_from_url
from fastapi_outbox.events import Envelope

POISON_EXIT_CODE = 17


class PoisonedBroker:
    """Wraps a real broker; dies (``os._exit``, no cleanup, like a segfault) on poison."""

    def __init__(self, inner: Broker) -> None:
        self.inner = inner

    def configure(self, *, dedup_window_seconds: float) -> None:
        self.inner.configure(dedup_window_seconds=dedup_window_seconds)

    async def connect(self) -> None:
        await self.inner.connect()

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def ping(self) -> None:
        await self.inner.ping()

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        if any(envelope.json().get("poison") is True for envelope in batch):
            os._exit(POISON_EXIT_CODE)
        return await self.inner.publish(batch)


def build() -> Outbox:
    broker: Broker = broker_from_url(os.environ["BROKER_URL"])
    if os.environ.get("CRASH_ON_POISON") == "1":
        broker = PoisonedBroker(broker)
    return Outbox(
        os.environ["DATABASE_URL"],
        brokers={"default": broker},
        settings=OutboxSettings.from_env(),
    )


def __getattr__(name: str) -> Outbox:
    """``outbox`` is built on first access, so the tests can import the constants above
    without the subprocess environment."""
    if name == "outbox":
        return build()
    raise AttributeError(name)
