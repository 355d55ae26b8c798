"""``MemoryConsumer``: the consumer side of [`MemoryBroker`][fastapi_outbox.brokers.MemoryBroker].

Consumer groups over the broker's message log, with the semantics of the real brokers
that fit in one process: a cursor per group, pending deliveries with a delivery count,
retries after a delay, release at shutdown, dead letters appended to the dead-letter
stream of the same broker (``broker.on_stream("orders.billing.dlq")``). Its state lives on
the broker's ``MemoryConnection``, so a subscriber restarted in the same process carries
on where it stopped.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Sequence

import anyio

from fastapi_outbox.brokers import cloudevents
from fastapi_outbox.brokers import consumer as consumer_mod
from fastapi_outbox.brokers.consumer import ConsumerConfig, ConsumerLag, DeadLetter, Delivery
from fastapi_outbox.brokers.memory.connection import MemoryConnection
from fastapi_outbox.events import HEADER_MESSAGE_ID, Envelope, uuid7


@dataclasses.dataclass(slots=True)
class _Group:
    cursor: int
    #: index in connection.messages → [delivery count, monotonic time of the last delivery]
    pending: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    #: indexes due again: (monotonic due time, index)
    retries: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    #: dead letters removed by a replay (envelope ids)
    replayed: set[str] = dataclasses.field(default_factory=set)


class MemoryConsumer:
    """One group's reader of one stream of a ``MemoryConnection``."""

    def __init__(self, connection: MemoryConnection, config: ConsumerConfig) -> None:
        self.connection = connection
        self.config = config

    def _group(self) -> _Group:
        groups: dict[tuple[str, str], _Group] = self.connection.groups
        key = (self.config.stream, self.config.group)
        if key not in groups:
            start = 0 if self.config.start == "all" else len(self.connection.messages)
            groups[key] = _Group(cursor=start)
        return groups[key]

    async def setup(self) -> None:
        await self.connection.ping()
        self._group()

    def _delivery(self, index: int, count: float) -> Delivery:
        e = self.connection.messages[index]
        event = cloudevents.as_delivery(
            e.headers, e.payload, stream=e.stream, entry_id=str(index), attempt=int(count)
        )
        if event is not None:
            return event
        return Delivery(
            stream=e.stream,
            entry_id=str(index),
            message_id=e.message_id,
            type=e.type,
            key=e.key,
            headers=dict(e.headers),
            payload=e.payload,
            attempt=int(count),
        )

    def _take(self, group: _Group, max_messages: int) -> list[Delivery]:
        out: list[Delivery] = []
        now = time.monotonic()
        due = [r for r in group.retries if r[0] <= now]
        waiting = {index for _, index in group.retries}
        stale = [
            (0.0, index)
            for index, (_, since) in group.pending.items()
            if index not in waiting and now - since >= self.config.claim_idle_seconds
        ]
        for item in (due + stale)[:max_messages]:
            if item in group.retries:
                group.retries.remove(item)
            index = item[1]
            if index in group.pending:
                entry = group.pending[index]
                entry[0] += 1
                entry[1] = now
                out.append(self._delivery(index, entry[0]))
        messages = self.connection.messages
        while len(out) < max_messages and group.cursor < len(messages):
            index = group.cursor
            group.cursor += 1
            if messages[index].stream != self.config.stream:
                continue
            group.pending[index] = [1, now]
            out.append(self._delivery(index, 1))
        return out

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        await self.connection.ping()
        group = self._group()
        deadline = time.monotonic() + timeout
        while True:
            out = self._take(group, max_messages)
            if out:
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            wait = min(left, max(0.01, self.config.claim_idle_seconds / 4))
            if group.retries:
                wait = min(wait, max(0.0, min(r[0] for r in group.retries) - time.monotonic()))
            with anyio.move_on_after(wait):
                await self.connection.wait_changed()

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        await self.connection.ping()
        group = self._group()
        for d in deliveries:
            group.pending.pop(int(d.entry_id), None)

    async def ack_soon(self, deliveries: Sequence[Delivery]) -> None:
        await self.ack(deliveries)

    async def retry(self, delivery: Delivery, delay: float) -> None:
        self._group().retries.append((time.monotonic() + delay, int(delivery.entry_id)))
        self.connection.changed()

    async def defer(self, delivery: Delivery, delay: float) -> None:
        group = self._group()
        index = int(delivery.entry_id)
        if index in group.pending:
            group.pending[index][0] = max(0, delivery.attempt - 1)  # uncharged
            group.retries.append((time.monotonic() + delay, index))
        self.connection.changed()

    async def touch(self, deliveries: Sequence[Delivery]) -> None:
        group = self._group()
        for d in deliveries:
            entry = group.pending.get(int(d.entry_id))
            if entry is not None:
                entry[1] = time.monotonic()

    async def release(self, deliveries: Sequence[Delivery]) -> None:
        group = self._group()
        for d in deliveries:
            index = int(d.entry_id)
            if index in group.pending:
                # Not handled: the redelivery is the same attempt, not one more.
                group.pending[index][0] = max(0, d.attempt - 1)
                group.retries.append((0.0, index))

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        await self.connection.ping()
        headers = {
            **delivery.headers,
            HEADER_MESSAGE_ID: delivery.message_id,
            consumer_mod.DEAD_LETTER_ERROR: consumer_mod.truncate_error(error),
            consumer_mod.DEAD_LETTER_GROUP: self.config.group,
            consumer_mod.DEAD_LETTER_ATTEMPTS: str(delivery.attempt),
            consumer_mod.DEAD_LETTER_STREAM: delivery.stream,
            consumer_mod.DEAD_LETTERED_AT: dt.datetime.now(dt.UTC).isoformat(),
        }
        envelope = Envelope(
            str(uuid7()),
            self.config.dead_letter,
            delivery.type,
            delivery.key,
            delivery.payload,
            headers,
        )
        self.connection.store([envelope])
        await self.ack([delivery])

    async def lag(self) -> ConsumerLag:
        group = self._group()
        messages = self.connection.messages
        behind = sum(1 for m in messages[group.cursor :] if m.stream == self.config.stream)
        return ConsumerLag(lag=behind, pending=len(group.pending))

    def _dead_entries(self) -> list[tuple[int, Envelope]]:
        replayed = self._group().replayed
        return [
            (i, e)
            for i, e in enumerate(self.connection.messages)
            if e.stream == self.config.dead_letter
            and e.headers.get(consumer_mod.DEAD_LETTER_GROUP) == self.config.group
            and e.id not in replayed
        ]

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        out = []
        for i, e in self._dead_entries()[:limit]:
            h = e.headers
            out.append(DeadLetter.from_headers(str(i), e.message_id, e.type, h, self.config))
        return out

    async def count_dead_letters(self) -> int:
        return len(self._dead_entries())

    async def replay_dead_letters(self, entry_ids: Sequence[str] | None = None) -> int:
        wanted = None if entry_ids is None else set(entry_ids)
        group = self._group()
        replayed = 0
        for i, e in self._dead_entries():
            if wanted is not None and str(i) not in wanted:
                continue
            headers = {
                k: v
                for k, v in e.headers.items()
                if not k.startswith("dead-letter") and k != consumer_mod.DEAD_LETTERED_AT
            }
            copy = Envelope(
                str(uuid7()),
                e.headers.get(consumer_mod.DEAD_LETTER_STREAM, self.config.stream),
                e.type,
                e.key,
                e.payload,
                headers,
            )
            self.connection.store([copy])
            group.replayed.add(e.id)
            replayed += 1
        return replayed

    async def aclose(self) -> None:
        pass
