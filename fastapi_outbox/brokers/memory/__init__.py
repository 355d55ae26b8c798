"""In process: ``MemoryBroker`` holds messages in a list, for tests and the embedded default.

The package holds ``connection`` (``MemoryConnection``: the message log and the groups'
state), ``publisher`` and ``consumer``, which each receive the connection and never import
each other; ``broker`` composes them. This module re-exports what
``fastapi_outbox.brokers.memory`` always offered.
"""

from __future__ import annotations

from fastapi_outbox.brokers.memory.broker import (
    MemoryBroker,
)

__all__ = [
    "MemoryBroker",
]
