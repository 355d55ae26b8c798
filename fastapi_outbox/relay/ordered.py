"""Per-key order inside a claimed batch (``settings.ordered``): `publish_ordered`
publishes in rounds, stops a key at its first failure and gives back what it did not send
(`NotAttempted`)."""

from __future__ import annotations

import time

from fastapi_outbox.brokers.base import Broker, PublishResults
from fastapi_outbox.events import Envelope
from fastapi_outbox.relay.outcomes import NotAttempted

__all__ = ["publish_ordered"]


async def publish_ordered(
    broker: Broker, envelopes: list[Envelope], budget_seconds: float
) -> PublishResults:
    """Per-key order inside a batch: publish in rounds (the n-th message of every key in
    round n) and stop a key at its first failure; its later messages are given back.

    Rounds are one broker call each, so a deep key costs one round trip per message.
    They run within a time budget (``budget_seconds``; the table relay gives half of
    ``publish_timeout_seconds``): once it is spent no new round starts, what was sent is
    marked and the rest is given back with its attempt refunded and claimed again at once.
    A key whose queue is deeper than one publish timeout allows therefore drains batch
    after batch instead of timing out whole and being re-sent from its first message
    forever."""
    results: PublishResults = [None] * len(envelopes)
    # A message without a key is a queue of its own.
    queues: dict[tuple[str, str] | tuple[None, int], list[int]] = {}
    for i, e in enumerate(envelopes):
        queues.setdefault(("key", e.key) if e.key is not None else (None, i), []).append(i)
    blocked: set[tuple[str, str] | tuple[None, int]] = set()
    budget_ends = time.monotonic() + budget_seconds
    depth = 0
    while True:
        round_ = [(k, q[depth]) for k, q in queues.items() if len(q) > depth and k not in blocked]
        if not round_:
            break
        if depth and time.monotonic() >= budget_ends:
            for k, _first in round_:
                for later in queues[k][depth:]:
                    results[later] = NotAttempted()
            break
        out = await broker.publish([envelopes[i] for _, i in round_])
        for (k, i), res in zip(round_, out, strict=True):
            results[i] = res
            if res is not None:
                blocked.add(k)
                for later in queues[k][depth + 1 :]:
                    results[later] = NotAttempted()
        depth += 1
    return results
