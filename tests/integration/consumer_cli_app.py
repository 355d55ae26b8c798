"""A consuming service for the CLI tests: ``--app tests.integration.consumer_cli_app:outbox``
(``CONSUMER_DATABASE_URL``, ``CONSUMER_BROKER_URL``, ``CONSUMER_STREAM``, and for RabbitMQ
``CONSUMER_EXCHANGE``)."""

from __future__ import annotations

import os

from fastapi_outbox import Message, Outbox
from fastapi_outbox.brokers import broker_from_url

STREAM = os.environ.get("CONSUMER_STREAM", "cli_orders")

outbox = Outbox(
    os.environ.get("CONSUMER_DATABASE_URL", "sqlite+aiosqlite:///./cli.db"),
    brokers={
        "default": broker_from_url(
            os.environ.get("CONSUMER_BROKER_URL", "memory://"),
            **(
                {"exchange": os.environ["CONSUMER_EXCHANGE"]}
                if "CONSUMER_EXCHANGE" in os.environ
                else {}
            ),
        )
    },
)


@outbox.subscriber(STREAM, group="billing", start="all")
async def bill(message: Message) -> None:
    raise RuntimeError("billing is broken")
