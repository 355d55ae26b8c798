"""Redis Streams: ``RedisStreamsBroker`` publishes with XADD, de-duplicated by message id, and
consumes with consumer groups.

The package holds ``connection`` (``RedisConnection``: the client, the server version,
outage translation), ``wire`` (the entry fields and their decoding, the refusal and outage
classifier), ``publisher`` and ``consumer``, which each receive the connection and never
import each other; ``broker`` composes them. This module re-exports what
``fastapi_outbox.brokers.redis`` always offered.
"""

from __future__ import annotations

from fastapi_outbox.brokers.redis.broker import (
    RedisStreamsBroker,
)
from fastapi_outbox.brokers.redis.publisher import (
    DEDUP_WINDOW_SECONDS,
    IDMP_MAX_DURATION_SECONDS,
    IDMP_MAX_SIZE,
    IDMP_PRODUCERS,
    SCRIPT_CHUNK,
    DedupMode,
)
from fastapi_outbox.brokers.redis.wire import (
    REFUSAL_CODES,
    refusal_code,
)

__all__ = [
    "DEDUP_WINDOW_SECONDS",
    "IDMP_MAX_DURATION_SECONDS",
    "IDMP_MAX_SIZE",
    "IDMP_PRODUCERS",
    "REFUSAL_CODES",
    "SCRIPT_CHUNK",
    "DedupMode",
    "RedisStreamsBroker",
    "refusal_code",
]
