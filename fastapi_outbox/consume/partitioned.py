"""Ordered subscribers across processes: partitions, leases and a reader per process.

``@outbox.subscriber(stream, group=…, ordered=True)`` on a broker whose consumer reads a
stream from a position (``read_after``: Redis Streams, NATS JetStream) runs here instead of
the fetch loop of `subscriber`:

* each message's key is hashed into one of ``consumer_ordered_partitions`` partitions
  (`partition_of`; CRC-32, the same in every process); a message without a key goes
  by its message id (no order between keyless messages);
* each partition is owned by one process at a time through a lease in the inbox's database
  (`fastapi_outbox.storage.leases`): a row with the owner, the lease's end (the
  database's clock), a fencing token and the position of the partition's last settled
  message. A coordinator task heartbeats every third of the lease
  (``consumer_claim_idle_seconds``), renews its leases and rebalances: each process holds
  its fair share, ``ceil(partitions / live processes)``, releasing the excess (once the
  message it works on is settled) and taking free or expired partitions;
* the process reads the whole stream itself, from the oldest position of its partitions
  (no consumer group: Redis ``XREAD``, a NATS ephemeral consumer without acks), and keeps
  the messages of its partitions, each partition's in a queue of its own;
* one task per partition handles its queue in stream order, one message at a time, in the
  usual handler transaction (inbox row, effects, events; the first messages of the queue
  together in one transaction, the handler on each in turn, unless ``batch=False``; one by
  one when that fails) whose first statement is the fence: the partition's position moves
  to the (last) message if the token is still ours, else
  `LeaseLost` rolls everything back and the process
  drops the partition. A message settled without a handler transaction (skipped,
  dead-lettered) moves the position in a transaction of its own, fenced the same way.

So a message is handled only after every earlier message of its partition was settled,
by whichever process owned the partition then; a process killed at any point leaves the
position at its last commit, and the next owner (after the lease) reads from there. A
failing message is retried in place and holds back its partition (not only its key) until
it is handled or dead-lettered.

Attempts survive the process (a handler that kills its process on every try must not hold
its partition back forever): before a handler runs, the partition's row says what it starts
on (``started``: the first message after the position; ``attempts``: the handler's starts
on it alone, 0 for a batch beginning with it; `fastapi_outbox.storage.leases`). The
fence writes it for the partition's next transaction, from the messages queued behind, so
under load no statement is added; a transaction the last fence did not announce (an empty
queue then, a retry in place) records it first in a statement of its own. A new owner that
finds ``started`` past the position knows its predecessor died inside that transaction: a
batch, and it handles the next ``batch_size`` messages one by one (a crashed batch costs no
attempt); one message, and that message starts at ``attempts + 1`` — past
``consumer_max_attempts`` it is dead-lettered without running. A drained or stopped
partition forgets an announcement that never started (no attempt is charged for a
hand-over); one whose handler was running keeps its count.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import time
import zlib
from collections.abc import Sequence
from typing import Any

import anyio
from sqlalchemy.ext.asyncio import AsyncConnection

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.consumer import Consumer, Delivery
from fastapi_outbox.consume.processing import (
    InFlight,
    Processing,
    ReleasedAtStop,
    pause_for,
)
from fastapi_outbox.log import safe_error
from fastapi_outbox.storage.leases import LeaseLost, Leases, OwnedPartition

__all__ = [
    "PARTITION_QUEUE_MAX",
    "PartitionedRun",
    "can_read_partitions",
    "fair_share",
    "partition_of",
    "rebalance",
]

logger = logging.getLogger("fastapi_outbox.consume")

#: Messages one partition may have read ahead, waiting for their turn; past it the reader
#: leaves the partition's messages in the stream and reads them again later.
PARTITION_QUEUE_MAX = 200
#: Entries one read asks for.
READ_COUNT = 200
#: Longest wait of one read: bounds how long a stop or a new partition waits for it.
READ_TIMEOUT_SECONDS = 1.0
#: Longest wait of one read while a partition is left out because its queue is full: the
#: others may be read to the end of the stream, and the full one must be read again from its
#: position as soon as it has room, not after a whole blocking read of nothing.
FULL_READ_TIMEOUT_SECONDS = 0.05


def partition_of(key: str | None, message_id: str, partitions: int) -> int:
    """The partition of a message: CRC-32 of its key (of its message id when it has
    none) modulo ``partitions`` — the same in every process and every release."""
    return zlib.crc32((key if key is not None else message_id).encode()) % partitions


def fair_share(partitions: int, members: int) -> int:
    """The most partitions one of ``members`` live processes holds."""
    return math.ceil(partitions / max(1, members))


def rebalance(owned: int, partitions: int, members: int) -> tuple[int, int]:
    """(partitions to release, partitions to take) for a process owning ``owned`` of
    ``partitions`` while ``members`` processes live: each holds at most its fair share
    and takes free ones up to it."""
    fair = fair_share(partitions, members)
    return max(0, owned - fair), max(0, fair - owned)


def can_read_partitions(consumer: Any) -> bool:
    """Whether ``consumer`` reads a stream from a position (Redis, NATS): ordered
    subscribers then run partitioned; others (RabbitMQ's single active consumer, the
    memory broker) keep the broker's order."""
    return all(
        callable(getattr(consumer, name, None))
        for name in ("read_after", "tail_position", "position_key")
    )


class _Partition:
    """A partition this process owns: its token, its queue and its task."""

    __slots__ = (
        "begun",
        "careful",
        "draining",
        "inherited",
        "inherited_by",
        "lost",
        "mark",
        "number",
        "pending",
        "queue",
        "scope",
        "seen",
        "stopped",
        "token",
        "wake",
    )

    def __init__(self, number: int, token: int, position: str) -> None:
        self.number = number
        self.token = token
        #: (started, attempts) as the partition's row holds them (committed).
        self.mark: tuple[str | None, int] = (None, 0)
        #: A handler's transaction began under ``mark`` (False: announced by the last
        #: fence, not started yet; forgotten at a release).
        self.begun = True
        #: (last entry of the transaction under way, the mark its fence announced): the
        #: mark once that transaction committed.
        self.pending: tuple[str, tuple[str | None, int]] | None = None
        #: Taken over from an owner that died inside the handler of one message: that
        #: message (``inherited_by``) starts after ``inherited`` attempts.
        self.inherited = 0
        self.inherited_by: str | None = None
        #: Every entry of the partition up to here is queued or settled.
        self.seen = position
        self.queue: collections.deque[Delivery] = collections.deque()
        #: Released once its current message is settled (a rebalance).
        self.draining = False
        #: Messages at the head of the queue to handle one by one (their batch failed).
        self.careful = 0
        #: Taken over by another process: dropped at once.
        self.lost = False
        self.wake = anyio.Event()
        self.scope = anyio.CancelScope()
        self.stopped = anyio.Event()

    def notify(self) -> None:
        self.wake.set()
        self.wake = anyio.Event()


class _Settling:
    """The consumer `Processing` sees for a partition's messages: an ack or a dead
    letter moves the partition's position (fenced), a release gives nothing back (the
    position did not move: the next owner reads the message again)."""

    def __init__(self, run: PartitionedRun) -> None:
        self.run = run
        self.config = run.consumer.config

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            await self.run.settled(d)

    async def ack_soon(self, deliveries: Sequence[Delivery]) -> None:
        await self.ack(deliveries)

    async def retry(self, delivery: Delivery, delay: float) -> None:
        """Not settled: the partition's task tries it again (a dead letter that could not
        be written)."""

    async def touch(self, deliveries: Sequence[Delivery]) -> None:
        """Nothing to keep: no other process reads the partition."""

    async def release(self, deliveries: Sequence[Delivery]) -> None:
        """Nothing to give back: the position did not move."""

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        await self.run.consumer.dead_letter(delivery, error)
        # Its handler's transactions (if any) rolled back: the position moves on its own.
        await self.run.settled(delivery, fenced=False)


class PartitionedRun:
    """One run of an ordered subscriber on a broker read by position."""

    def __init__(self, subscriber: Any, consumer: Consumer, flight: InFlight) -> None:
        """``subscriber``: the `Subscriber` that
        runs (its options, stats and pause; not imported: it imports this module)."""
        self.sub = subscriber
        self.consumer = consumer
        self.flight = flight
        self.options = subscriber._options
        settings = subscriber.context.settings
        self.partitions = settings.consumer_ordered_partitions
        self.lease_seconds = subscriber.claim_idle_seconds
        self.member = consumer.config.consumer_name
        self.leases: Leases = subscriber.context.inbox.leases(subscriber.group, subscriber.stream)
        self.key: Any = consumer.position_key  # type: ignore[attr-defined]
        self.parts: dict[int, _Partition] = {}
        #: Entry ids whose position moved in their handler's transaction.
        self._fenced: set[str] = set()
        #: Entry ids settled (the position moved past them).
        self._settled: set[str] = set()
        #: Entry id -> the partition whose queue holds it (its fence takes that token).
        self._queued_in: dict[str, _Partition] = {}
        self._changed = anyio.Event()
        self._limiter = anyio.CapacityLimiter(subscriber.concurrency)
        self.processing = Processing(
            subscriber.context,
            _Settling(self),  # type: ignore[arg-type]
            self.options,
            subscriber.stats,
            flight,
            rng=subscriber._rng,
            unwritten_dead_letters=subscriber._unwritten_dead_letters,
            fence=self._fence,
            before_attempt=self._before_attempt,
        )
        self._tg: anyio.abc.TaskGroup | None = None

    # -- the position ---------------------------------------------------------------------

    def _part_of(self, d: Delivery) -> _Partition:
        """The partition (as this process took it: its token) whose queue holds ``d``."""
        part = self._queued_in.get(d.entry_id)
        if part is None or part.lost:
            n = partition_of(d.key, d.message_id, self.partitions)
            raise LeaseLost(self.sub.group, self.sub.stream, n)
        return part

    async def _fence(self, conn: AsyncConnection, todo: list[Delivery]) -> None:
        """The fence of a transaction over ``todo`` (one message, or the first messages
        of one partition's queue, in order): the position moves to the last one, and the
        partition's next transaction is announced (its start recorded ahead)."""
        last = todo[-1]
        part = self._part_of(last)
        part.begun = True
        careful = part.careful - len(todo) if len(todo) == 1 else 0
        after = self._next_start(part, todo, careful)
        await self.leases.fence(conn, part.number, part.token, last.entry_id, after)
        part.pending = (last.entry_id, after)
        self._fenced.update(d.entry_id for d in todo)

    def _next_start(
        self, part: _Partition, todo: list[Delivery], careful: int
    ) -> tuple[str | None, int]:
        """(started, attempts) of the transaction that follows one over ``todo`` (the
        first messages of the partition's queue), as `_batch` and `_one` will
        run it: a batch beginning with the next queued message (no attempt counted), or
        that message's first attempt alone; (None, 0) when none is queued."""
        queue, n = part.queue, len(todo)
        if len(queue) <= n or queue[n - 1] is not todo[-1]:
            return None, 0
        head = queue[n]
        if self.sub.batch_requested and len(queue) - n >= 2 and careful <= 0 and head.attempt == 1:
            return head.entry_id, 0
        return head.entry_id, 1

    async def _before_attempt(self, d: Delivery, attempt: int) -> None:
        """Before try ``attempt`` of the handler on ``d`` alone: the partition's row says
        so, committed (unless the last fence announced exactly that)."""
        part = self._part_of(d)
        if part.mark != (d.entry_id, attempt):
            await self.leases.start(part.number, part.token, d.entry_id, attempt)
            part.mark = (d.entry_id, attempt)
            part.pending = None

    @staticmethod
    def _committed(part: _Partition, entry_id: str) -> None:
        """The transaction whose last message is ``entry_id`` committed: what its fence
        announced is on the partition's row now."""
        if part.pending is not None and part.pending[0] == entry_id:
            part.mark, part.pending, part.begun = part.pending[1], None, False

    async def settled(self, d: Delivery, *, fenced: bool = True) -> None:
        """``d`` is settled: the position moves past it — in its handler's committed
        transaction already (an ack after it), or now in one of its own (``fenced=False``:
        a dead letter, whose transactions rolled back; an ack without a transaction)."""
        if fenced and d.entry_id in self._fenced:
            self._fenced.discard(d.entry_id)
            part = self._queued_in.get(d.entry_id)
            if part is not None:
                self._committed(part, d.entry_id)
        else:
            self._fenced.discard(d.entry_id)
            part = self._part_of(d)
            after = self._next_start(part, [d], part.careful - 1)
            await self.leases.settle(part.number, part.token, d.entry_id, after)
            part.mark, part.pending, part.begun = after, None, False
        self._settled.add(d.entry_id)

    # -- running --------------------------------------------------------------------------

    async def run(self) -> None:
        """Set up, then read, handle and coordinate until the stop; at the end the
        partitions are released for the other processes."""
        stop = self.flight.stop
        failures = 0
        while not stop.is_set():  # the group, its partitions (waited out while unreachable)
            try:
                await self.consumer.setup()
                origin = await self.consumer.tail_position()  # type: ignore[attr-defined]
                if self.sub.start == "all":
                    origin = self.consumer.origin_position  # type: ignore[attr-defined]
                await self.leases.ensure(self.partitions, origin)
                break
            except exceptions.ConfigurationError:
                raise
            except Exception as exc:
                failures += 1
                await self.sub._paused(exc, failures, stop)
        if stop.is_set():
            return
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._coordinate)
                await self._read_loop()
                await self._drain()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                try:
                    await self.leases.leave(self.member, unstarted=self._unstarted())
                except Exception as exc:
                    logger.warning(
                        "releasing the partitions failed: they move after the lease",
                        extra=self.options.log_extra("consumer.leave_failed", error=repr(exc)),
                    )

    async def _drain(self) -> None:
        """The stop: each partition finishes the message it is on (within the shutdown's
        drain share), then the rest is cancelled (rolled back; read again by the next
        owner)."""
        for part in self.parts.values():
            part.notify()
        settings = self.sub.context.settings
        with anyio.move_on_after(settings.shutdown_timeout_seconds * 0.7):
            for part in list(self.parts.values()):
                await part.stopped.wait()

    def _unstarted(self, parts: Sequence[_Partition] | None = None) -> list[int]:
        """Those of ``parts`` (default: all) whose row announces a start that never came:
        given up, they must not charge their next owner an attempt."""
        chosen = list(self.parts.values()) if parts is None else parts
        return [p.number for p in chosen if not p.begun and p.mark[0] is not None]

    def _start(self, owned: OwnedPartition) -> None:
        number = owned.partition
        old = self.parts.get(number)
        if old is not None:  # taken again with a new token: the old task's fence fails
            self._drop(old)
        part = _Partition(number, owned.token, owned.position)
        started = owned.started
        if started is not None and self.key(started) > self.key(owned.position):
            # The previous owner died (or stopped) inside the transaction it recorded: a
            # batch (its messages one by one now, each counted), or the handler of one.
            part.mark = (started, owned.attempts)
            if owned.attempts:
                part.careful = 1
                part.inherited, part.inherited_by = owned.attempts, started
            else:
                part.careful = self.sub.batch_size
            logger.info(
                "partition taken over mid-transaction: its messages go one by one",
                extra=self.options.log_extra(
                    "consumer.partition_recovered",
                    partition=number,
                    position=owned.position,
                    started=started,
                    attempts=owned.attempts,
                ),
            )
        self.parts[number] = part
        assert self._tg is not None
        self._tg.start_soon(self._work, part)
        self._changed.set()

    def _drop(self, part: _Partition) -> None:
        """Taken over: stop at once (a transaction under way rolls back)."""
        part.lost = True
        part.scope.cancel()
        if self.parts.get(part.number) is part:
            del self.parts[part.number]
        logger.warning(
            "partition taken over by another process",
            extra=self.options.log_extra("consumer.partition_lost", partition=part.number),
        )

    async def _coordinate(self) -> None:
        """Heartbeat, renew, rebalance: every third of the lease."""
        every = max(0.05, self.lease_seconds / 3)
        failures = 0
        while True:
            try:
                await self._rebalance()
                failures = 0
            except Exception as exc:
                failures += 1
                logger.warning(
                    "partition coordination failed",
                    extra=self.options.log_extra(
                        "consumer.coordination_failed", error=safe_error(exc)
                    ),
                )
            await anyio.sleep(every if not failures else min(every, pause_for(failures)))

    async def _rebalance(self) -> None:
        members = await self.leases.heartbeat(self.member, self.lease_seconds)
        held = await self.leases.renew(self.member, self.lease_seconds)
        for part in list(self.parts.values()):
            if held.get(part.number) != part.token:
                self._drop(part)
        # Drained partitions go back at once.
        done = [p for p in self.parts.values() if p.draining and p.stopped.is_set()]
        if done:
            await self.leases.release(
                self.member, [p.number for p in done], unstarted=self._unstarted(done)
            )
            for p in done:
                self.parts.pop(p.number, None)
        if self.flight.stopping:
            return
        active = [p for p in self.parts.values() if not p.draining]
        give, take = rebalance(len(active), self.partitions, members)
        for part in sorted(active, key=lambda p: -p.number)[:give]:
            part.draining = True
            part.notify()
        if take and not any(p.draining for p in self.parts.values()):
            got = await self.leases.acquire(self.member, take, self.lease_seconds)
            for owned in got:
                self._start(owned)
            if got:
                logger.info(
                    "partitions taken",
                    extra=self.options.log_extra(
                        "consumer.partitions_taken",
                        taken=[o.partition for o in got],
                        owned=sorted(self.parts),
                        members=members,
                    ),
                )

    async def _read_loop(self) -> None:
        """Read the stream from the oldest position of the partitions that take messages,
        and queue each partition's messages (in stream order, each once)."""
        stop = self.flight.stop
        failures = 0
        while not stop.is_set():
            taking = [p for p in self.parts.values() if not p.lost and not p.draining]
            open_ = [p for p in taking if len(p.queue) < PARTITION_QUEUE_MAX]
            wait = READ_TIMEOUT_SECONDS if len(open_) == len(taking) else FULL_READ_TIMEOUT_SECONDS
            if not open_:
                self._changed = anyio.Event()
                with anyio.move_on_after(0.2):
                    await self._changed.wait()
                continue
            start = min((p.seen for p in open_), key=self.key)
            try:
                batch = await self.consumer.read_after(  # type: ignore[attr-defined]
                    start, READ_COUNT, wait
                )
            except Exception as exc:
                failures += 1
                await self.sub._paused(exc, failures, stop)
                continue
            if failures:
                logger.info("broker reachable again", extra=self.options.log_extra("resumed"))
            failures = 0
            self.sub.broker_ok = True
            self.sub.paused_since = None
            self._queue(open_, start, batch)

    def _queue(self, open_: list[_Partition], start: Any, batch: list[Delivery]) -> None:
        if not batch:
            return
        key = self.key
        readable = {p.number: p for p in open_ if key(p.seen) >= key(start)}
        full: set[int] = set()
        for d in batch:
            n = partition_of(d.key, d.message_id, self.partitions)
            part = readable.get(n)
            if part is None or part.lost or part.draining or n in full:
                continue
            if key(d.entry_id) <= key(part.seen):
                continue  # queued or settled already
            if len(part.queue) >= PARTITION_QUEUE_MAX:
                full.add(n)  # read again from its position once it has room
                continue
            part.queue.append(d)
            self._queued_in[d.entry_id] = part
            part.seen = d.entry_id
            part.notify()
        last = batch[-1].entry_id
        for n, part in readable.items():
            if n not in full and key(part.seen) < key(last):
                part.seen = last  # nothing else of it up to there

    async def _work(self, part: _Partition) -> None:
        """Handle the partition's queue in order, one message at a time."""
        stop = self.flight.stop
        try:
            with part.scope:
                while not stop.is_set() and not part.lost:
                    if not part.queue:
                        if part.draining:
                            break
                        with anyio.move_on_after(1.0):
                            await part.wake.wait()
                        continue
                    async with self._limiter:
                        done = await self._batch(part)
                        if not done:
                            if not await self._one(part, part.queue[0]):
                                break
                            done = 1
                            part.careful = max(0, part.careful - 1)
                    for _ in range(done):
                        self._queued_in.pop(part.queue.popleft().entry_id, None)
                    if part.draining:
                        break
                    self._changed.set()
        except LeaseLost:
            if not part.lost:
                self._drop(part)
        finally:
            for d in part.queue:
                if self._queued_in.get(d.entry_id) is part:
                    del self._queued_in[d.entry_id]
            part.stopped.set()

    async def _batch(self, part: _Partition) -> int:
        """The first messages of the partition's queue (up to ``batch_size``, stopping
        before one that does not decode for the handler) in one transaction, the handler
        on each in stream order: how many were settled — 0 when fewer than two could go
        together or the transaction failed (then they go one by one, the careful way)."""
        if not self.sub.batch_requested or len(part.queue) < 2 or part.careful:
            return 0
        decoder = self.options.decoder
        todo: list[Delivery] = []
        messages: list[Any] = []
        for d in itertools.islice(part.queue, self.sub.batch_size):
            if d.attempt > 1:
                break
            try:
                messages.append(decoder.decode(d))
            except Exception:  # undecodable, not for the handler: settled on its own
                break
            todo.append(d)
        if len(todo) < 2:
            return 0
        # The start of the batch on record: announced by the last fence (no statement),
        # else recorded now.
        announced = part.mark == (todo[0].entry_id, 0)
        stats = self.sub.stats
        try:
            if not announced:
                await self.leases.start(part.number, part.token, todo[0].entry_id, 0)
                part.mark, part.pending = (todo[0].entry_id, 0), None
            new, duplicates = await self.processing.run_batch(todo, messages)
        except Exception as exc:
            self._fenced.difference_update(d.entry_id for d in todo)
            part.careful = len(todo)  # each of them on its own now, then batches again
            stats.failures += 1
            stats.last_error = safe_error(exc)
            logger.info(
                "batch failed, handling its messages one by one",
                extra=self.options.log_extra(
                    "consumer.batch_failed", count=len(todo), error=repr(exc)[:200]
                ),
            )
            return 0
        self._fenced.difference_update(d.entry_id for d in todo)
        self._committed(part, todo[-1].entry_id)
        stats.handled += new
        stats.duplicates += duplicates
        stats.last_handled_at = time.time()
        return len(todo)

    async def _one(self, part: _Partition, d: Delivery) -> bool:
        """``d`` through its handler until settled; False when the partition stops (the
        subscriber stops, the database went away at the stop)."""
        if part.inherited:
            # The first message after a take-over inside its handler: the handler started
            # that many times already (each time its process died).
            if d.entry_id == part.inherited_by:
                d.attempt = max(d.attempt, part.inherited + 1)
            part.inherited = 0
        failures = 0
        while True:
            self._fenced.discard(d.entry_id)
            try:
                await self.processing.process(d, in_place=True)
            except ReleasedAtStop:
                return False
            if d.entry_id in self._settled:
                self._settled.discard(d.entry_id)
                return True
            # Not settled: its dead letter could not be written. Again after a pause,
            # straight to the dead letter.
            failures += 1
            d.attempt = self.options.max_attempts + 1
            with anyio.move_on_after(pause_for(failures)):
                await self.flight.stop.wait()
            if self.flight.stopping:
                return False
