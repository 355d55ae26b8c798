"""A multi-tenant outbox for the CLI tests: SQLite tenant databases in ``$TENANTS_DIR``."""

import os

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker


def make() -> Outbox:
    where = os.environ["TENANTS_DIR"]
    return Outbox(
        tenants={name: f"sqlite+aiosqlite:///{where}/{name}.db" for name in ("acme", "globex")},
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
    )
