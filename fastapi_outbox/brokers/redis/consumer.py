"""``RedisStreamsConsumer``: consumer groups on Redis Streams.

* ``setup``: ``XGROUP CREATE <stream> <group> $|0 MKSTREAM`` (``BUSYGROUP`` = exists).
* ``fetch``: first this consumer's retries that are due (``XCLAIM`` to itself, which
  raises the delivery count), then, at most every quarter of ``claim_idle_seconds``,
  entries other consumers left pending for ``claim_idle_seconds`` (``XAUTOCLAIM``; their
  delivery counts come from the pending entries list, ``XPENDING``), after a connection
  failure its own pending entries it is not working on (``XREADGROUP … 0``: a read whose
  reply was lost, an ack that was), then new entries (``XREADGROUP … >``, blocking up to
  the timeout). One consumer name per process.
* ``ack``: ``XACK``, after the handler's transaction committed. ``ack_soon`` (the
  subscriber's batches): the acks ride with the fetch loop's next ``XREADGROUP`` (one
  pipeline: the ``XACK`` runs first, then the read; one round trip instead of two); while
  the read is blocked waiting for new entries, and after close, they go on their own.
* ``dead_letter``: ``XADD`` to the dead-letter stream (the original fields plus error,
  group, attempts, original stream and entry id; never trimmed unless the broker's
  ``dead_letter_maxlen`` says so) then ``XACK``, in one script: an ``XADD`` that fails
  leaves the entry pending (in a ``MULTI`` the ``XACK`` would run anyway). Redis has no
  "max deliver": an entry stays pending until acknowledged, the subscriber counts.
* ``release`` at shutdown: ``XCLAIM … IDLE <claim_idle> JUSTID`` makes the entries look
  stale at once, so the next consumer's ``XAUTOCLAIM`` takes them without waiting.

On a Redis Cluster every command names one stream (or the stream and its dead-letter
stream, which share its slot: ``wire.dead_letter_key``), so redis-py's cluster client
sends it to the master serving that slot and follows it to the promoted replica after a
failover; nothing scans keys.

Entries are decoded from the fields the publish side writes: ``id`` (message id), ``type``,
``key``, ``headers`` (JSON), ``payload``. Connection failures and broker-wide refusals
(``refusal_code``) raise BrokerUnavailable / BrokerRefusing, as on the publish side.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import consumer as consumer_mod
from fastapi_outbox.brokers.consumer import (
    ConsumerConfig,
    ConsumerLag,
    DeadLetter,
    Delivery,
)
from fastapi_outbox.brokers.redis.connection import RedisConnection
from fastapi_outbox.brokers.redis.wire import (
    decode_entry,
    is_unreachable,
    refusal_code,
    reply_entries,
    same_slot,
    text,
)

logger = logging.getLogger("fastapi_outbox.brokers.redis")

#: Most entries one XAUTOCLAIM takes.
AUTOCLAIM_COUNT = 100
#: Dead letters scanned for one group's count.
DEAD_LETTER_SCAN = 10_000
#: KEYS[1] = dead-letter stream, KEYS[2] = stream; ARGV = group, entry id, maxlen (0: none),
#: then field, value pairs. The XACK only once the XADD succeeded (an error stops the
#: script): a dead letter that could not be written stays pending.
DEAD_LETTER_SCRIPT = """
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
local maxlen = tonumber(ARGV[3])
local id
if maxlen > 0 then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', unpack(fields))
else
  id = redis.call('XADD', KEYS[1], '*', unpack(fields))
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return id
"""


def _entry_id(value: Any) -> tuple[int, int]:
    ms, _, seq = text(value).partition("-")
    return int(ms), int(seq or 0)


#: The most entries seen trimmed before a group read them, per (Redis URL, stream, group).
_TRIMMED_SEEN: dict[tuple[str, str, str], int] = {}


def trimmed_unread(group: dict[str, Any], stream: dict[str, Any]) -> tuple[int | None, int | None]:
    """(entries ``MAXLEN`` trimmed from the stream before ``group`` read them, the group's
    real lag), from ``XINFO GROUPS`` / ``XINFO STREAM`` (Redis 7+); None when Redis
    cannot say.

    A group that has read (``entries-read`` counts its reads, one per entry delivered):
    Redis's ``lag`` is ``entries-added - entries-read``, so entries trimmed before the
    group read them stay in that lag forever, while at most ``length`` entries can still
    be unread. A lag above the stream's length is that many entries lost at least, and the
    whole lag of a group that has read up to the newest entry is lost (exact). A group
    that has read nothing yet (``entries-read`` null, at ``0-0``): every entry no longer in
    the stream is lost to it. An ``XDEL`` after the group's position leaves Redis without
    a lag: None."""
    lag, added = group.get("lag"), stream.get("entries-added")
    if added is None:
        return None, None if lag is None else int(lag)
    length = int(stream.get("length", 0))
    position = _entry_id(group.get("last-delivered-id", "0-0"))
    if group.get("entries-read") is None:
        if position == (0, 0):
            return max(0, int(added) - length), length
        return None, None if lag is None else int(lag)
    if lag is None:
        return None, None
    last_generated = stream.get("last-generated-id")
    if last_generated is not None and position >= _entry_id(last_generated):
        return int(lag), 0  # caught up: all of Redis's lag is lost entries
    lost = max(0, int(lag) - length)
    return lost, int(lag) - lost


def _raw(response: Any, **_options: Any) -> Any:
    """Response callback that keeps the reply as the parser built it."""
    return response


class RedisStreamsConsumer:
    """One consumer group's reader of one stream, on the broker's ``RedisConnection``."""

    def __init__(
        self,
        connection: RedisConnection,
        config: ConsumerConfig,
        *,
        dead_letter_maxlen: int | None = None,
    ) -> None:
        """``dead_letter_maxlen``: ``MAXLEN ~`` of the dead-letter stream (None: never
        trimmed)."""
        self.connection = connection
        self.config = config
        self.dead_letter_maxlen = dead_letter_maxlen
        self.key = connection.stream_key(config.stream)
        try:
            #: On a Redis Cluster in the stream's slot (``wire.dead_letter_key``): the
            #: dead-letter script writes it and acknowledges the entry in one call.
            self.dead_key = connection.dead_letter_key(config.dead_letter, self.key)
        except ValueError as exc:
            raise exceptions.ConfigurationError(
                f"subscriber of {config.stream!r} (group {config.group!r}): {exc}"
            ) from exc
        self._idle_ms = max(1, int(config.claim_idle_seconds * 1000))
        #: (due monotonic time, entry id, attempt so far) of this consumer's retries.
        self._retries: list[tuple[float, str, int]] = []
        self._next_autoclaim = 0.0
        self._autoclaim_cursor = "0-0"
        #: Entry ids acknowledged since the last fetch: sent with the next XREADGROUP.
        self._acks: list[str] = []
        #: Acks go on their own: before the first fetch, while a fetch waits inside a
        #: blocking XREADGROUP, after close. Otherwise the next fetch follows shortly (the
        #: subscriber's fetch loop) and takes them along.
        self._blocked = True
        #: (client the reader was made for, reader): see ``_reader_for``.
        self._reader: tuple[Any, Any] | None = None
        #: Entry ids handed out by ``fetch`` and not finished yet (acked, retried, released
        #: or dead-lettered): what this process is working on.
        self._held: set[str] = set()
        #: A call failed on the connection: the next fetch first reads this consumer's own
        #: pending entries (``XREADGROUP … 0``) for those it never received or whose ack was
        #: lost, instead of leaving them to ``XAUTOCLAIM`` after ``claim_idle_seconds``.
        self._recover = False
        self._recover_cursor = "0-0"

    @property
    def ack_soon_sends_at_once(self) -> bool:
        """Whether ``ack_soon`` sends its ``XACK`` at once rather than with the next fetch:
        before the first fetch, while a fetch waits in a blocking ``XREADGROUP``, after
        ``aclose``."""
        return self._blocked

    @contextlib.asynccontextmanager
    async def _calls(self) -> AsyncIterator[Any]:
        """The client; Redis failures become BrokerUnavailable / BrokerRefusing."""
        import redis.exceptions as rexc

        await self.connection.connect()
        try:
            yield self.connection.client
        except Exception as exc:
            if is_unreachable(exc):
                self._recover = True  # a reply or an ack may have been lost with it
                raise self.connection.unavailable(exc) from exc
            code = refusal_code(exc) if isinstance(exc, rexc.ResponseError) else None
            if code is not None:
                raise self.connection.refusing(code, exc) from exc
            raise

    async def setup(self) -> None:
        import redis.exceptions as rexc

        start = "0" if self.config.start == "all" else "$"
        async with self._calls() as client:
            try:
                await client.xgroup_create(self.key, self.config.group, id=start, mkstream=True)
            except rexc.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            else:
                logger.info(
                    "redis consumer group created",
                    extra={
                        "action": "consumer.group_created",
                        "stream": self.key,
                        "group": self.config.group,
                        "start": start,
                    },
                )

    async def _reader_for(self, client: Any) -> Any:
        """The fetch loop's own client: a connection pool of its own, made like the
        broker's (``connection_kwargs``), whose XREADGROUP replies redis-py leaves as the
        parser built them (the deliveries are made straight from its lists). Its commands
        are bounded by ``_bounded`` rather than by a ``socket_timeout``: redis-py sends
        every command of a client with a socket timeout in a task of its own
        (``asyncio.wait_for``), a cost on each round trip of the loop.

        On a Redis Cluster: the broker's cluster client itself (it follows the stream's
        slot from master to promoted replica); its replies come parsed, which
        ``decode_entry`` reads too, and a blocking read waits less than its socket
        timeout (``_read``)."""
        if self.connection.cluster:
            return client
        if self._reader is None or self._reader[0] is not client:
            import redis.asyncio as aioredis

            pool = client.connection_pool
            kwargs = {
                k: v
                for k, v in pool.connection_kwargs.items()
                if k != "maint_notifications_pool_handler"  # the other pool's; one of its own
            }
            kwargs.update(socket_timeout=None, orig_socket_timeout=None)
            own = aioredis.ConnectionPool(
                connection_class=pool.connection_class, max_connections=4, **kwargs
            )
            reader = aioredis.Redis(connection_pool=own)
            reader.set_response_callback("XREADGROUP", _raw)
            reader.set_response_callback("XREAD", _raw)
            await self._close_reader()  # made for a client the broker has replaced
            self._reader = (client, reader)
        return self._reader[1]

    async def _close_reader(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader[1], None
            await reader.connection_pool.disconnect()

    def _delivery(self, entry_id: Any, fields: Any, attempt: int) -> Delivery:
        return decode_entry(self.config.stream, entry_id, fields, attempt)

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        out: list[Delivery] = []
        gone: list[str] = []
        group, me = self.config.group, self.config.consumer_name
        async with self._calls() as client:
            now = time.monotonic()
            due = [r for r in self._retries if r[0] <= now][:max_messages]
            if due:
                for item in due:
                    self._retries.remove(item)
                attempts = {entry: attempt for _, entry, attempt in due}
                claimed = await client.xclaim(self.key, group, me, 0, list(attempts))
                for entry_id, fields in claimed:
                    if fields:
                        out.append(self._delivery(entry_id, fields, attempts[text(entry_id)] + 1))
                returned = {text(e) for e, _ in claimed}
                gone += [e for e in attempts if e not in returned]
            if len(out) < max_messages and now >= self._next_autoclaim:
                self._next_autoclaim = now + max(0.05, self.config.claim_idle_seconds / 4)
                out += await self._autoclaim(client, max_messages - len(out), gone, out)
            if len(out) < max_messages and self._recover:
                out += await self._recover_own(client, max_messages - len(out), gone, out)
            if len(out) < max_messages:
                for entry_id, fields in reply_entries(
                    await self._read(client, max_messages - len(out), None if out else timeout)
                ):
                    out.append(self._delivery(entry_id, fields, 1))
            if gone:  # trimmed or deleted while pending: nothing left to handle
                await client.xack(self.key, group, *gone)
        self._held.update(d.entry_id for d in out)
        return out

    def _busy(self, taken: Sequence[Delivery], *, held: bool = True) -> set[str]:
        """Entry ids this process is working on: acks not sent yet, retries waiting, those
        this fetch already ``taken`` and (``held``) those handed out and not finished. A
        pending entry of this consumer among them is not handed out again: twice at once,
        the second copy could be dead-lettered past max_attempts while the first is being
        handled (seen after a Redis Cluster failover: XAUTOCLAIM, then the recovery of
        the consumer's own entries, took the same entries in one fetch)."""
        busy = set(self._acks) | {entry for _, entry, _ in self._retries}
        if held:
            busy |= self._held
        return busy | {d.entry_id for d in taken}

    # -- reading from a position (ordered subscribers: fastapi_outbox.consume.partitioned) --

    #: The position before the stream's first entry.
    origin_position = "0-0"

    @staticmethod
    def position_key(entry_id: str) -> tuple[int, int]:
        """Stream order of entry ids."""
        return _entry_id(entry_id)

    async def tail_position(self) -> str:
        """The newest entry's id ("0-0": an empty stream): where a group that starts with
        new messages begins."""
        import redis.exceptions as rexc

        async with self._calls() as client:
            try:
                info = await client.xinfo_stream(self.key)
            except rexc.ResponseError:  # no such stream yet
                return "0-0"
        return text(info.get("last-generated-id") or "0-0")

    async def read_after(self, position: str, count: int, timeout: float) -> list[Delivery]:
        """Up to ``count`` entries after ``position``, in stream order, waiting up to
        ``timeout`` for the first (``XREAD``, no consumer group: the caller keeps its
        position). Attempt 1: the caller counts its own tries."""
        block = self._block_ms(timeout)
        async with self._calls() as client:
            reader = await self._reader_for(client)
            args = ["XREAD", "COUNT", count, "BLOCK", block, "STREAMS", self.key, position]
            with anyio.fail_after(block / 1000 + self.connection.socket_timeout):
                reply = await reader.execute_command(*args)
        return [self._delivery(e, f, 1) for e, f in reply_entries(reply) if f]

    async def _recover_own(
        self, client: Any, count: int, gone: list[str], taken: Sequence[Delivery] = ()
    ) -> list[Delivery]:
        """After a failed call: this consumer's own pending entries that this process is not
        working on — delivered by an ``XREADGROUP`` whose reply was lost, or handled with
        their ``XACK`` lost (the inbox skips those) — one page per fetch until none is left."""
        reader = await self._reader_for(client)
        args: list[Any] = ["XREADGROUP", "GROUP", self.config.group, self.config.consumer_name]
        args += ["COUNT", count, "STREAMS", self.key, self._recover_cursor]
        with anyio.fail_after(self.connection.socket_timeout):
            entries = reply_entries(await reader.execute_command(*args))
        if not entries:
            self._recover, self._recover_cursor = False, "0-0"
            return []
        busy = self._busy(taken)
        lost = [(e, f) for e, f in entries if text(e) not in busy]
        out = await self._with_counts(client, [(e, f) for e, f in lost if f])
        # Past this page only once its deliveries are made: a failure reads it again.
        self._recover_cursor = text(entries[-1][0])
        gone += [text(e) for e, f in lost if not f]
        if out:
            logger.info(
                "took back own pending entries after a connection failure",
                extra={
                    "action": "consumer.recovered",
                    "stream": self.key,
                    "group": self.config.group,
                    "count": len(out),
                },
            )
        return out

    async def _with_counts(self, client: Any, entries: list[tuple[Any, Any]]) -> list[Delivery]:
        """Deliveries of ``entries`` with their delivery counts from the pending entries
        list (``XPENDING``, one pipeline)."""
        if not entries:
            return []
        async with client.pipeline(transaction=False) as pipe:
            for entry_id, _ in entries:
                pipe.xpending_range(
                    self.key, self.config.group, min=entry_id, max=entry_id, count=1
                )
            counts = await pipe.execute()
        return [
            self._delivery(entry_id, fields, int(pending[0]["times_delivered"]) if pending else 1)
            for (entry_id, fields), pending in zip(entries, counts, strict=True)
        ]

    def _block_ms(self, timeout: float) -> int:
        """The ``BLOCK`` of a read waiting up to ``timeout`` seconds, in ms (at least 1); on a
        Redis Cluster less than the cluster client's socket timeout, which bounds the wait."""
        if self.connection.cluster:
            timeout = min(timeout, self.connection.socket_timeout / 2)
        return max(1, int(timeout * 1000))

    async def _read(self, client: Any, count: int, timeout: float | None) -> Any:
        """``XREADGROUP … >``, after an ``XACK`` of the acks waiting for it in the same
        pipeline; the raw reply. With a ``timeout``: when nothing is there yet, a second
        read blocks up to it (acks that come meanwhile go on their own)."""
        reader = await self._reader_for(client)
        head = ["XREADGROUP", "GROUP", self.config.group, self.config.consumer_name]
        tail = ["COUNT", count, "STREAMS", self.key, ">"]
        reply = await self._call(reader, [*head, *tail], 0.0)
        self._blocked = False  # the fetch loop comes back for more
        if timeout is None or reply_entries(reply):
            return reply
        block = self._block_ms(timeout)
        self._blocked = True
        try:
            return await self._call(reader, [*head, "BLOCK", block, *tail], block / 1000)
        finally:
            self._blocked = False

    async def _call(self, reader: Any, args: list[Any], blocking: float) -> Any:
        """One command on the reader, with the waiting acks before it in one pipeline.
        Bounded by ``blocking`` plus the broker's ``socket_timeout``: a Redis that stops
        answering raises (BrokerUnavailable, through ``_calls``), it does not hang the
        loop; redis-py drops a connection whose command was cancelled mid-reply."""
        acks, self._acks = self._acks, []
        try:
            with anyio.fail_after(blocking + self.connection.socket_timeout):
                if not acks:
                    return await reader.execute_command(*args)
                async with reader.pipeline(transaction=False) as pipe:
                    pipe.execute_command("XACK", self.key, self.config.group, *acks)
                    pipe.execute_command(*args)
                    _acked, reply = await pipe.execute()
                    return reply
        except BaseException:
            self._acks[:0] = acks  # not sent (or not known to be): with the next read
            raise

    async def _autoclaim(
        self, client: Any, count: int, gone: list[str], taken: Sequence[Delivery] = ()
    ) -> list[Delivery]:
        group, me = self.config.group, self.config.consumer_name
        reply = await client.xautoclaim(
            self.key,
            group,
            me,
            self._idle_ms,
            start_id=self._autoclaim_cursor,
            count=min(count, AUTOCLAIM_COUNT),
        )
        self._autoclaim_cursor = text(reply[0])
        if self._autoclaim_cursor != "0-0":
            self._next_autoclaim = 0.0  # more stale entries: take the next page at once
        # Not those this fetch took already, nor acks and retries waiting. Entries handed
        # out and not finished for claim_idle_seconds (their heartbeat failed) may come
        # again: the handler has stalled, or crashed without ack nor release.
        busy = self._busy(taken, held=False)
        entries = [(e, f) for e, f in reply[1] if f and text(e) not in busy]
        gone += [text(e) for e, f in reply[1] if not f]
        if len(reply) > 2:
            gone += [text(e) for e in reply[2]]
        if not entries:
            return []
        out = await self._with_counts(client, entries)  # XAUTOCLAIM raised the counts
        logger.info(
            "reclaimed stale entries",
            extra={
                "action": "consumer.reclaimed",
                "stream": self.key,
                "group": group,
                "count": len(out),
            },
        )
        return out

    def _done(self, deliveries: Sequence[Delivery]) -> list[str]:
        ids = [d.entry_id for d in deliveries]
        self._held.difference_update(ids)
        return ids

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        ids = self._done(deliveries)
        if ids:
            await self._xack(ids)

    async def ack_soon(self, deliveries: Sequence[Delivery]) -> None:
        if not self._blocked:  # a fetch is on its way: ride with its XREADGROUP
            self._acks += self._done(deliveries)
            return
        await self.ack(deliveries)

    async def _xack(self, ids: list[str]) -> None:
        async with self._calls() as client:
            await client.xack(self.key, self.config.group, *ids)

    async def flush(self) -> None:
        """Send the acks still waiting for a fetch."""
        acks, self._acks = self._acks, []
        if acks:
            try:
                await self._xack(acks)
            except BaseException:
                self._acks[:0] = acks
                raise

    async def retry(self, delivery: Delivery, delay: float) -> None:
        self._done([delivery])
        self._retries.append((time.monotonic() + delay, delivery.entry_id, delivery.attempt))

    async def defer(self, delivery: Delivery, delay: float) -> None:
        # Claimed with the idle time ``delay`` short of claim_idle: after ``delay`` any
        # consumer's XAUTOCLAIM takes it, with its delivery count as before this delivery.
        self._done([delivery])
        idle = max(0, self._idle_ms - int(delay * 1000))
        await self._claim([delivery.entry_id], idle=idle, retrycount=max(0, delivery.attempt - 1))

    async def touch(self, deliveries: Sequence[Delivery]) -> None:
        await self._claim([d.entry_id for d in deliveries])

    async def release(self, deliveries: Sequence[Delivery]) -> None:
        # Claimed with the idle time already at claim_idle: the next XAUTOCLAIM takes them.
        # A released delivery was not handled: its delivery count goes back to what it was
        # before this delivery, so the redelivery is the same attempt, not one more (the
        # retries keep theirs: their failure was charged).
        by_attempt: dict[int, list[str]] = {}
        for d in deliveries:
            by_attempt.setdefault(max(0, d.attempt - 1), []).append(d.entry_id)
        self._done(deliveries)
        retries = [entry for _, entry, _ in self._retries]
        self._retries.clear()
        await self._claim(retries, idle=self._idle_ms)
        for count, ids in by_attempt.items():
            await self._claim(ids, idle=self._idle_ms, retrycount=count)

    async def _claim(
        self, ids: list[str], idle: int | None = None, retrycount: int | None = None
    ) -> None:
        """``XCLAIM … JUSTID`` of ``ids`` to this consumer: idle reset (or set to ``idle``
        ms), the delivery count unchanged (or set to ``retrycount``)."""
        if not ids:
            return
        async with self._calls() as client:
            await client.xclaim(
                self.key,
                self.config.group,
                self.config.consumer_name,
                0,
                ids,
                idle=idle,
                retrycount=retrycount,
                justid=True,
            )

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        self._done([delivery])
        fields = {
            "id": delivery.message_id,
            "type": delivery.type,
            "key": delivery.key or "",
            # The original headers as they came (parsed and re-encoded only when they
            # did not come as one field).
            "headers": delivery.raw_headers
            if delivery.raw_headers is not None
            else json.dumps(delivery.headers, separators=(",", ":")),
            "payload": delivery.payload,
            "error": consumer_mod.truncate_error(error),
            "group": self.config.group,
            "attempts": str(delivery.attempt),
            "stream": self.config.stream,
            "entry": delivery.entry_id,
            "at": dt.datetime.now(dt.UTC).isoformat(),
        }
        args: list[Any] = [
            self.config.group,
            delivery.entry_id,
            self.dead_letter_maxlen or 0,
        ]
        for name, value in fields.items():
            args += [name, value]
        async with self._calls() as client:
            await client.eval(DEAD_LETTER_SCRIPT, 2, self.dead_key, self.key, *args)

    async def lag(self) -> ConsumerLag:
        """The group's lag and pending count, and the entries ``MAXLEN`` trimmed before the
        group read them (see `trimmed_unread`)."""
        if self.config.ordered:
            # An ordered subscriber reads the stream by position, not through the group
            # (fastapi_outbox.consume.partitioned): the group's figures are not its own.
            return ConsumerLag(lag=None, pending=None)
        import redis.exceptions as rexc

        async with self._calls() as client:
            try:
                groups = await client.xinfo_groups(self.key)
                stream = await client.xinfo_stream(self.key)
            except rexc.ResponseError:  # no such stream yet
                return ConsumerLag(lag=None, pending=None)
        for info in groups:
            if text(info.get("name")) == self.config.group:
                trimmed, lag = trimmed_unread(info, stream)
                if trimmed is not None:
                    # Redis forgets the loss of a group that had read nothing yet once it
                    # reads again: what this process saw stays shown.
                    seen = (self.connection.url, self.key, self.config.group)
                    trimmed = _TRIMMED_SEEN[seen] = max(trimmed, _TRIMMED_SEEN.get(seen, 0))
                return ConsumerLag(lag=lag, pending=int(info.get("pending", 0)), trimmed=trimmed)
        return ConsumerLag(lag=None, pending=None)

    async def _deadreply_entries(self, count: int) -> list[tuple[str, dict[str, Any]]]:
        async with self._calls() as client:
            entries = await client.xrange(self.dead_key, "-", "+", count=count)
        out = []
        for entry_id, fields in entries:
            get = {text(k): v for k, v in fields.items()}
            if text(get.get("group", "")) == self.config.group:
                out.append((text(entry_id), get))
        return out

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        out = []
        for entry_id, get in (await self._deadreply_entries(DEAD_LETTER_SCAN))[:limit]:
            at = text(get.get("at", ""))
            out.append(
                DeadLetter(
                    entry_id=entry_id,
                    message_id=text(get.get("id", "")),
                    type=text(get.get("type", "")),
                    stream=text(get.get("stream", self.config.stream)),
                    group=self.config.group,
                    error=text(get.get("error", "")),
                    attempts=int(text(get.get("attempts", "0")) or 0),
                    dead_lettered_at=dt.datetime.fromisoformat(at) if at else None,
                )
            )
        return out

    async def count_dead_letters(self) -> int:
        if not self.config.dead_letter_shared:  # the group's own stream: its length
            async with self._calls() as client:
                return int(await client.xlen(self.dead_key))
        return len(await self._deadreply_entries(DEAD_LETTER_SCAN))

    async def replay_dead_letters(self, entry_ids: Sequence[str] | None = None) -> int:
        wanted = None if entry_ids is None else set(entry_ids)
        replayed = 0
        for entry_id, get in await self._deadreply_entries(DEAD_LETTER_SCAN):
            if wanted is not None and entry_id not in wanted:
                continue
            fields = {name: get.get(name, b"") for name in ("id", "type", "key", "headers")}
            fields["payload"] = get.get("payload", b"")
            target = self.connection.stream_key(text(get.get("stream", self.config.stream)))
            # One transaction, unless the target lives in another slot of a cluster (a dead
            # letter written elsewhere): then XADD first, XDEL after; a failure in
            # between replays it twice, and the inbox skips the copy.
            atomic = not self.connection.cluster or same_slot(target, self.dead_key)
            async with self._calls() as client, client.pipeline(transaction=atomic) as pipe:
                pipe.xadd(target, fields)
                if atomic:
                    pipe.xdel(self.dead_key, entry_id)
                await pipe.execute()
                if not atomic:
                    await client.xdel(self.dead_key, entry_id)
            replayed += 1
        return replayed

    async def aclose(self) -> None:
        self._blocked = True  # no fetch follows: acks go on their own
        try:
            await self.flush()
        finally:
            await self._close_reader()
