"""In process: ``MemoryBroker`` holds messages in a list, for tests and the embedded default.

The package holds ``broker``, ``publisher``, ``connection``, ``consumer``: the publisher and
the consumer share the connection and the wire rules and never import each other; ``broker``
composes them. This module re-exports what ``fastapi_outbox.brokers.memory`` always offered.
"""

from __future__ import annotations

from fastapi_outbox.brokers.memory.broker import (
    MemoryBroker,
)

__all__ = [
    "MemoryBroker",
]
