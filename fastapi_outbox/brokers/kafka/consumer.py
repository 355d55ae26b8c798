"""``KafkaConsumer``: a subscriber group as a Kafka consumer group.

* ``setup``: the stream's topic (``topic_partitions`` partitions) and the group's
  dead-letter topic (one partition) created when missing; a group without committed
  offsets and ``start="new"`` gets the topic's current end offsets committed (0 on a new
  topic), so it exists and receives what is published from then on even if its first
  member joins later (``start="all"``: from the beginning). The Kafka group is
  ``group_id`` with ``{topic}`` (or ``{stream}``) and ``{group}`` filled in (default
  ``{topic}.{group}``).
* ``fetch``: aiokafka's ``AIOKafkaConsumer`` subscribed to the topic with a rebalance
  listener, ``getmany`` for new records; retries that are due come first. Kafka keeps no
  per-message delivery count: the attempt is counted here (1 on the first fetch, one more
  per retry); the subscriber's inbox and its own attempt counts cover a restart.
* ``ack``: an offset is committed only after the handler's transaction committed, and only
  up to the first record of the partition still unsettled (Kafka commits a position, not a
  message): a crash or a rebalance redelivers from there, and the inbox skips what was
  handled. ``ack_soon`` commits with the next ``fetch`` (one commit per batch).
* ``retry(delay)`` and ``defer``: the record is kept here and handed out again after
  ``delay``; the partition's offset stays below it until it is settled. ``release``: handed
  out again at once (not committed, so a consumer that stops leaves it to the group).
  ``touch``: a delivery held past ``claim_idle_seconds`` without a touch, an ack or a retry
  (an ack the subscriber lost) is handed out again, as Redis's ``XAUTOCLAIM`` does.
* a rebalance: the listener commits what was settled of the partitions taken away and
  waits (``REVOKE_WAIT_SECONDS``) for their deliveries in flight, then forgets them; an
  ack arriving later for one of them is ignored (the new owner redelivers from the last
  commit and the inbox skips it): no message is lost, no effect doubled.
* ``dead_letter``: the record, its original headers and key plus ``dead-letter-*`` headers
  on the dead-letter topic, acknowledged by the cluster, then acknowledged here.
  ``dead_letters`` / ``replay_dead_letters`` read the dead-letter topic from its start;
  Kafka removes no single record, so a replay appends a marker (``dead-letter-replayed``)
  that hides the letter from later listings, counts and replays.
* ``lag``: per partition, the topic's end offset minus the group's committed offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import heapq
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import consumer as consumer_mod
from fastapi_outbox.brokers.consumer import ConsumerConfig, ConsumerLag, DeadLetter, Delivery
from fastapi_outbox.brokers.kafka.connection import DEAD_LETTER_PARTITIONS, KafkaConnection
from fastapi_outbox.brokers.kafka.wire import GROUP_TEMPLATE, decode_record, header_dict
from fastapi_outbox.events import HEADER_MESSAGE_ID, HEADER_TYPE, uuid7

__all__ = [
    "DEAD_LETTER_ID",
    "DEAD_LETTER_REPLAYED",
    "DEAD_LETTER_SCAN",
    "REVOKE_WAIT_SECONDS",
    "KafkaConsumer",
]

logger = logging.getLogger("fastapi_outbox.brokers.kafka")

#: Header naming a dead letter (its entry id for listing and replay).
DEAD_LETTER_ID = "dead-letter-id"
#: Header of a replay marker: the id of the dead letter replayed.
DEAD_LETTER_REPLAYED = "dead-letter-replayed"
#: Records of a dead-letter topic read for listing, counting and replay.
DEAD_LETTER_SCAN = 10_000
#: Longest wait of a rebalance for the deliveries in flight of the partitions taken away
#: (their acks then commit before the next owner starts): bounded well inside the session.
REVOKE_WAIT_SECONDS = 3.0
#: Prefetch of a consumer whose subscriber did not say.
DEFAULT_PREFETCH = 500


class _Partition:
    """What this consumer holds of one assigned partition."""

    __slots__ = ("committed", "epoch", "next", "outstanding")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        #: The offset after the last record fetched (None: nothing fetched yet).
        self.next: int | None = None
        #: offset -> [delivery, last seen (monotonic), waiting for a retry]
        self.outstanding: dict[int, list[Any]] = {}
        self.committed: int | None = None

    def commit_offset(self) -> int | None:
        """Where the group may resume: the first record still unsettled, else past the
        last fetched one."""
        if self.outstanding:
            return min(self.outstanding)
        return self.next


class KafkaConsumer:
    """One subscriber group of one stream, as a Kafka consumer group."""

    def __init__(
        self,
        connection: KafkaConnection,
        config: ConsumerConfig,
        *,
        group_id: str = GROUP_TEMPLATE,
    ) -> None:
        self.connection = connection
        self.config = config
        self.topic = connection.topic(config.stream)
        self.dead_letter_topic = connection.topic(config.dead_letter)
        self.group_id = group_id.format(stream=config.stream, topic=self.topic, group=config.group)
        self.prefetch = config.prefetch or DEFAULT_PREFETCH
        self._consumer: Any = None
        self._partitions: dict[Any, _Partition] = {}
        self._epochs = itertools.count(1)
        self._retries: list[tuple[float, int, Delivery, bool]] = []
        self._seq = itertools.count()
        self._dirty: set[Any] = set()
        self._soon: list[Delivery] = []
        #: The acks of the last fetch's ``ack_soon`` batch, committing while it fetches.
        self._acking: asyncio.Future[Any] | None = None
        #: The commit in flight (``_commit_dirty``).
        self._committing: asyncio.Future[Any] | None = None
        self._settled = asyncio.Event()
        self._last_sweep = time.monotonic()

    def __repr__(self) -> str:
        return f"KafkaConsumer(topic={self.topic!r}, group_id={self.group_id!r})"

    # -- declaring ---------------------------------------------------------------------------

    async def setup(self) -> None:
        """The topic and the dead-letter topic; the group's initial offsets (idempotent)."""
        conn = self.connection
        await conn.ensure_topics([self.topic])
        await conn.ensure_topics([self.dead_letter_topic], partitions=DEAD_LETTER_PARTITIONS)
        if self.config.start == "new":
            await self._start_at_end()

    async def _start_at_end(self) -> None:
        """Give a group that has no committed offsets yet the topic's end offsets (0 on a
        new topic): the group then exists, positioned before whatever is published next,
        even if its first member joins later; a group with offsets keeps them."""
        async with self._standalone(self.group_id) as client:
            tps = await self._topic_partitions(client, self.topic)
            if not tps:
                return
            for tp in tps:
                if await client.committed(tp) is not None:
                    return
            ends = await client.end_offsets(tps)
            client.assign(tps)
            await client.commit({tp: ends[tp] for tp in tps})

    @contextlib.asynccontextmanager
    async def _standalone(self, group_id: str | None) -> Any:
        """A consumer of this group (or of none) that joins no group: for offsets and the
        dead-letter topic."""
        from aiokafka import AIOKafkaConsumer

        client = AIOKafkaConsumer(**self.connection.consumer_options(group_id))
        try:
            await asyncio.wait_for(client.start(), self.connection.request_timeout_seconds)
        except Exception as exc:
            with contextlib.suppress(Exception):
                await client.stop()
            raise self.connection.unavailable(exc) from exc
        try:
            yield client
        except exceptions.OutboxError:
            raise
        except Exception as exc:
            raise self.connection.unavailable(exc) from exc
        finally:
            with contextlib.suppress(Exception):
                await client.stop()

    async def _topic_partitions(self, client: Any, topic: str) -> list[Any]:
        from aiokafka.structs import TopicPartition

        numbers = await self.connection.partitions(topic)
        return [TopicPartition(topic, n) for n in numbers]

    # -- consuming ---------------------------------------------------------------------------

    async def _start(self) -> Any:
        if self._consumer is not None:
            return self._consumer
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(
            **self.connection.consumer_options(self.group_id), max_poll_records=self.prefetch
        )
        try:
            await asyncio.wait_for(consumer.start(), self.connection.request_timeout_seconds)
            consumer.subscribe(topics=[self.topic], listener=_listener(self))
        except Exception as exc:
            with contextlib.suppress(Exception):
                await consumer.stop()
            raise self.connection.unavailable(exc) from exc
        self._consumer = consumer
        return consumer

    def _assigned(self, assigned: Any) -> None:
        for tp in assigned:
            self._partitions[tp] = _Partition(next(self._epochs))
        logger.info(
            "kafka partitions assigned",
            extra={
                "action": "consumer.assigned",
                "group_id": self.group_id,
                "partitions": sorted(tp.partition for tp in assigned),
            },
        )

    async def _revoked(self, revoked: Any) -> None:
        """Partitions taken away: wait a moment for their deliveries in flight, commit what
        was settled, then forget them (their later acks are ignored)."""
        waiting, self._soon = self._soon, []
        self._settle(waiting)
        await self._acks_done()
        deadline = time.monotonic() + REVOKE_WAIT_SECONDS
        while time.monotonic() < deadline and any(
            any(not entry[2] for entry in self._partitions[tp].outstanding.values())
            for tp in revoked
            if tp in self._partitions
        ):
            self._settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), deadline - time.monotonic())
        with contextlib.suppress(Exception):
            await self._commit({tp for tp in revoked if tp in self._partitions})
        for tp in revoked:
            self._partitions.pop(tp, None)
            self._dirty.discard(tp)

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        consumer = await self._start()
        if self._soon:  # the acks of ack_soon: committed while this fetch waits
            waiting, self._soon = self._soon, []
            await self._acks_done()
            self._acking = asyncio.ensure_future(self.ack(waiting))
            self._acking.add_done_callback(_quiet)
        self._sweep()
        out = self._due(max_messages)
        if len(out) >= max_messages:
            return out
        wait = 0 if out else timeout
        try:
            batches = await consumer.getmany(
                timeout_ms=int(wait * 1000), max_records=max_messages - len(out)
            )
        except Exception as exc:
            raise self.connection.unavailable(exc) from exc
        now = time.monotonic()
        for tp, records in batches.items():
            part = self._partitions.get(tp)
            if part is None:  # revoked meanwhile: the next owner reads it
                continue
            for record in records:
                d = decode_record(self.config.stream, record, part.epoch, tp=tp)
                part.outstanding[record.offset] = [d, now, False]
                part.next = record.offset + 1
                out.append(d)
        return out

    def _due(self, limit: int) -> list[Delivery]:
        """Retries whose time has come, handed out again (attempt + 1 unless released)."""
        out: list[Delivery] = []
        now = time.monotonic()
        while self._retries and self._retries[0][0] <= now and len(out) < limit:
            _, _, d, bump = heapq.heappop(self._retries)
            tp, offset, epoch, record = d.handle
            part = self._partitions.get(tp)
            if part is None or part.epoch != epoch or offset not in part.outstanding:
                continue
            again = decode_record(self.config.stream, record, epoch, d.attempt + int(bump), tp)
            part.outstanding[offset] = [again, now, False]
            out.append(again)
        return out

    def _sweep(self) -> None:
        """Hand out again deliveries held past ``claim_idle_seconds`` untouched."""
        now = time.monotonic()
        idle = self.config.claim_idle_seconds
        if now - self._last_sweep < idle / 4:
            return
        self._last_sweep = now
        stale = 0
        for part in self._partitions.values():
            for entry in part.outstanding.values():
                if not entry[2] and now - entry[1] > idle:
                    entry[2] = True
                    heapq.heappush(self._retries, (now, next(self._seq), entry[0], False))
                    stale += 1
        if stale:
            logger.info(
                "kafka deliveries idle past claim_idle_seconds handed out again",
                extra={"action": "consumer.reclaimed", "topic": self.topic, "count": stale},
            )

    def _settle(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            tp, offset, epoch = d.handle[0], d.handle[1], d.handle[2]
            part = self._partitions.get(tp)
            if part is None or part.epoch != epoch:
                continue  # revoked: the next owner redelivers it, the inbox skips it
            part.outstanding.pop(offset, None)
            self._dirty.add(tp)
        self._settled.set()

    async def _commit(self, tps: set[Any]) -> None:
        consumer = self._consumer
        offsets = {}
        for tp in tps:
            part = self._partitions.get(tp)
            if part is None:
                continue
            offset = part.commit_offset()
            if offset is not None and offset != part.committed:
                offsets[tp] = offset
        if not offsets or consumer is None:
            return
        from aiokafka import errors

        try:
            # Bounded: aiokafka waits for a coordinator as long as it takes (a broker down).
            await asyncio.wait_for(
                consumer.commit(offsets), self.connection.request_timeout_seconds
            )
        except (errors.CommitFailedError, errors.IllegalStateError) as exc:
            # A rebalance took the partition: its next owner resumes from the last commit.
            logger.info(
                "kafka commit refused by a rebalance",
                extra={
                    "action": "consumer.commit_refused",
                    "group_id": self.group_id,
                    "error": f"{type(exc).__name__}: {exc}",
                },
            )
            return
        except Exception as exc:
            self._dirty |= {tp for tp in offsets if tp in self._partitions}  # the next try
            raise self.connection.unavailable(exc) from exc
        for tp, offset in offsets.items():
            part = self._partitions.get(tp)
            if part is not None:
                part.committed = offset

    async def _commit_dirty(self) -> None:
        """Commit what was settled: one commit in flight at a time, and the acks settled
        while it flies share the next one (a handler per message with concurrency 8 makes
        a commit per round trip, not one per message)."""
        while self._dirty:
            running = self._committing
            if running is not None and not running.done():
                await asyncio.wait([running])
                continue
            dirty, self._dirty = self._dirty, set()
            self._committing = task = asyncio.ensure_future(self._commit(dirty))
            await asyncio.shield(task)
            return

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        self._settle(deliveries)
        await self._commit_dirty()

    async def _acks_done(self) -> None:
        task = self._acking
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await task

    async def ack_soon(self, deliveries: Sequence[Delivery]) -> None:
        # Acknowledged with the next fetch: one commit for the batches settled meanwhile.
        self._soon.extend(deliveries)

    async def retry(self, delivery: Delivery, delay: float) -> None:
        self._hold(delivery, delay, bump=True)

    async def defer(self, delivery: Delivery, delay: float) -> None:
        # A partition has one consumer in the group: handed out here again after delay.
        self._hold(delivery, delay, bump=True)

    def _hold(self, d: Delivery, delay: float, *, bump: bool) -> None:
        tp, offset, epoch = d.handle[0], d.handle[1], d.handle[2]
        part = self._partitions.get(tp)
        if part is None or part.epoch != epoch or offset not in part.outstanding:
            return
        part.outstanding[offset][2] = True
        due = time.monotonic() + max(0.0, delay)
        heapq.heappush(self._retries, (due, next(self._seq), d, bump))

    async def touch(self, deliveries: Sequence[Delivery]) -> None:
        now = time.monotonic()
        for d in deliveries:
            part = self._partitions.get(d.handle[0])
            if part is not None and part.epoch == d.handle[2]:
                entry = part.outstanding.get(d.handle[1])
                if entry is not None:
                    entry[1] = now

    async def release(self, deliveries: Sequence[Delivery]) -> None:
        # Not committed: handed out again here, or by the partition's next owner.
        for d in deliveries:
            self._hold(d, 0.0, bump=False)

    # -- dead letters ------------------------------------------------------------------------

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        record = delivery.handle[3]
        original = list(record.headers or ())
        extra = {
            HEADER_MESSAGE_ID: delivery.message_id,
            HEADER_TYPE: delivery.type,
            consumer_mod.DEAD_LETTER_ERROR: " ".join(consumer_mod.truncate_error(error).split()),
            consumer_mod.DEAD_LETTER_GROUP: self.config.group,
            consumer_mod.DEAD_LETTER_ATTEMPTS: str(delivery.attempt),
            consumer_mod.DEAD_LETTER_STREAM: self.config.stream,
            consumer_mod.DEAD_LETTERED_AT: dt.datetime.now(dt.UTC).isoformat(),
            DEAD_LETTER_ID: str(uuid7()),
        }
        headers = [(k, v) for k, v in original if k not in extra]
        headers += [(k, v.encode()) for k, v in extra.items()]
        await self.connection.send_and_wait(
            self.dead_letter_topic, record.value or b"", key=record.key, headers=headers
        )
        await self.ack([delivery])

    async def _scan(self) -> tuple[list[Any], set[str]]:
        """The dead-letter topic's records of this group, oldest first, and the ids of the
        letters already replayed."""
        from aiokafka.structs import TopicPartition

        letters: list[Any] = []
        replayed: set[str] = set()
        async with self._standalone(None) as client:
            numbers = await self.connection.partitions(self.dead_letter_topic)
            tps = [TopicPartition(self.dead_letter_topic, n) for n in numbers]
            if not tps:
                return letters, replayed
            client.assign(tps)
            await client.seek_to_beginning(*tps)
            ends = await client.end_offsets(tps)
            remaining = {tp for tp in tps if ends[tp] > 0}
            seen = 0
            while remaining and seen < DEAD_LETTER_SCAN:
                batches = await client.getmany(
                    *remaining, timeout_ms=int(self.connection.request_timeout_seconds * 1000)
                )
                if not batches:
                    break
                for tp, records in batches.items():
                    for record in records:
                        seen += 1
                        h = header_dict(record.headers)
                        if h.get(consumer_mod.DEAD_LETTER_GROUP) != self.config.group:
                            continue
                        if DEAD_LETTER_REPLAYED in h:
                            replayed.add(h[DEAD_LETTER_REPLAYED])
                        else:
                            letters.append(record)
                    if records and records[-1].offset + 1 >= ends[tp]:
                        remaining.discard(tp)
        return letters, replayed

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        letters, replayed = await self._scan()
        out: list[DeadLetter] = []
        for record in letters:
            h = header_dict(record.headers)
            if h.get(DEAD_LETTER_ID) in replayed:
                continue
            out.append(
                DeadLetter.from_headers(
                    h.get(DEAD_LETTER_ID, ""),
                    h.get(HEADER_MESSAGE_ID, ""),
                    h.get(HEADER_TYPE, ""),
                    h,
                    self.config,
                )
            )
            if len(out) >= limit:
                break
        return out

    async def count_dead_letters(self) -> int:
        letters, replayed = await self._scan()
        return sum(header_dict(r.headers).get(DEAD_LETTER_ID) not in replayed for r in letters)

    async def replay_dead_letters(self, entry_ids: Sequence[str] | None = None) -> int:
        wanted = None if entry_ids is None else set(entry_ids)
        letters, replayed = await self._scan()
        count = 0
        for record in letters:
            h = header_dict(record.headers)
            letter_id = h.get(DEAD_LETTER_ID, "")
            if letter_id in replayed or (wanted is not None and letter_id not in wanted):
                continue
            headers = [
                (k, v)
                for k, v in record.headers or ()
                if not k.startswith("dead-letter") and k != consumer_mod.DEAD_LETTERED_AT
            ]
            # Back on the stream's topic: this group handles it again, the stream's other
            # groups skip it (their inbox has the message id).
            await self.connection.send_and_wait(
                self.topic, record.value or b"", key=record.key, headers=headers
            )
            await self.connection.send_and_wait(
                self.dead_letter_topic,
                b"",
                key=None,
                headers=[
                    (consumer_mod.DEAD_LETTER_GROUP, self.config.group.encode()),
                    (DEAD_LETTER_REPLAYED, letter_id.encode()),
                ],
            )
            replayed.add(letter_id)
            count += 1
        return count

    async def lag(self) -> ConsumerLag:
        """Records of the topic past the group's committed offsets, in all and per
        partition; ``pending``: handed out here and not settled yet."""
        async with self._standalone(self.group_id) as client:
            tps = await self._topic_partitions(client, self.topic)
            if not tps:
                return ConsumerLag(lag=None, pending=None)
            ends = await client.end_offsets(tps)
            per_partition: dict[int, int] = {}
            for tp in tps:
                committed = await client.committed(tp)
                per_partition[tp.partition] = max(0, ends[tp] - (committed or 0))
        pending = sum(len(p.outstanding) for p in self._partitions.values())
        return ConsumerLag(
            lag=sum(per_partition.values()),
            pending=pending if self._consumer is not None else None,
            partitions=per_partition,
        )

    async def aclose(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        with contextlib.suppress(Exception):  # what fails to commit is redelivered
            waiting, self._soon = self._soon, []
            self._settle(waiting)
            await self._acks_done()
            await self._commit_dirty()
        self._consumer = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(consumer.stop(), self.connection.request_timeout_seconds)
        self._partitions.clear()
        self._retries.clear()


def _quiet(task: asyncio.Future[Any]) -> None:
    """Retrieve a background ack's error (committed again with the next one)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("kafka commit failed: %r", task.exception())


def _listener(owner: KafkaConsumer) -> Any:
    """aiokafka's rebalance listener, handing each change to ``owner``."""
    from aiokafka.abc import ConsumerRebalanceListener

    class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: Any) -> None:
            await owner._revoked(revoked)

        async def on_partitions_assigned(self, assigned: Any) -> None:
            owner._assigned(assigned)

    return Listener()
