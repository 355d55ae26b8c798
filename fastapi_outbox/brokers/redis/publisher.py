"""``RedisStreamsBroker``: XADD to Redis Streams, de-duplicated by message id.

One stream entry per message with the fields ``id`` (message id), ``type``, ``key``,
``headers`` (JSON) and ``payload`` (JSON).

De-duplication (``dedup=``):

* ``"script"`` (the default before Redis 8.6): a Lua script that, for each message, checks
  a key ``outbox:dedup:{<stream>}:<id>``, XADDs when it is absent and remembers the entry id
  under that key for the de-duplication window, all atomically. A republish after a crash
  returns the first entry id and adds nothing. The script takes a whole batch of one stream
  in one call, so the relay spends one command per stream and batch instead of one per
  message (redis-py building a pipeline costs about 26 µs per command). The ``{stream}``
  hash tag keeps the stream and its de-duplication keys in one cluster slot
  (``wire.dedup_key``). On a Redis Cluster the script goes as ``EVAL`` (its text each
  time): a replica promoted after a failover, or a restarted node, has no script cache,
  and redis-py's cluster pipeline does not load scripts before ``EVALSHA``.
* ``"idmp"`` (Redis 8.6+, opt-in): the server's own idempotent ``XADD … IDMP``. Redis keeps
  at most 10,000 idempotent ids per producer id, so ids are spread over ``idmp_producers``
  producer ids (the message id picks one). Each stream's ``IDMP-DURATION`` must be set once
  by the operator (``XCFGSET <stream> IDMP-DURATION <window> IDMP-MAXSIZE 10000``): the
  default is 100 s, shorter than a lease plus the longest backoff, and the library does not
  call XCFGSET itself because XCFGSET clears the ids already remembered, so a relay
  restarting after a crash would forget exactly the ids it needs.
  ``"auto"`` therefore picks the script on every version: it is tested here, its window
  follows the settings, and it holds any number of ids.
* ``"off"``: plain XADD, for consumers that de-duplicate themselves.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal, Self

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions
from fastapi_outbox.brokers.redis.connection import RedisConnection
from fastapi_outbox.brokers.redis.wire import (
    entry_fields,
    entry_values,
    is_unreachable,
    refusal_code,
)
from fastapi_outbox.events import Envelope
from fastapi_outbox.redaction import redact_url

logger = logging.getLogger("fastapi_outbox.brokers.redis")

#: Without an Outbox to configure it: lease + longest backoff + dedup_outage_seconds + margin
#: of the default settings (30 + 300 + 4 h + 60 s).
DEDUP_WINDOW_SECONDS = 14_790.0
#: Messages per script call: bounds how long one call holds the Redis event loop.
SCRIPT_CHUNK = 200
IDMP_PRODUCERS = 1024
IDMP_MAX_DURATION_SECONDS = 86_400
IDMP_MAX_SIZE = 10_000

# KEYS[1] = stream, KEYS[2..n+1] = de-duplication keys; ARGV = ttl, maxlen, then five
# values per message. Returns one entry id per message, or "!<error>" when XADD refused it.
_PUBLISH_SCRIPT = """
local ttl = tonumber(ARGV[1])
local maxlen = tonumber(ARGV[2])
local stream = KEYS[1]
local out = {}
for i = 2, #KEYS do
  local existing = redis.call('GET', KEYS[i])
  if existing then
    out[#out + 1] = existing
  else
    local b = 2 + (i - 2) * 5
    local r
    if maxlen > 0 then
      r = redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'id', ARGV[b + 1],
        'type', ARGV[b + 2], 'key', ARGV[b + 3], 'headers', ARGV[b + 4], 'payload', ARGV[b + 5])
    else
      r = redis.pcall('XADD', stream, '*', 'id', ARGV[b + 1], 'type', ARGV[b + 2],
        'key', ARGV[b + 3], 'headers', ARGV[b + 4], 'payload', ARGV[b + 5])
    end
    if type(r) == 'table' and r.err then
      out[#out + 1] = '!' .. r.err
    else
      if ttl > 0 then
        redis.call('SET', KEYS[i], r, 'EX', ttl)
      end
      out[#out + 1] = r
    end
  end
end
return out
"""

DedupMode = Literal["auto", "script", "idmp", "off"]


_pack_command: Callable[[tuple[Any, ...]], bytes] | None
try:  # redis[hiredis]: packs a command's arguments in C
    from hiredis import pack_command as _hiredis_pack

    _pack_command = _hiredis_pack
except ImportError:  # pragma: no cover - redis-py's own packer then
    _pack_command = None


def _utf8(encoding: str) -> bool:
    """Whether a client encodes text as UTF-8, as hiredis does (a caller's client may
    have been made with another ``encoding``: redis-py's packer then)."""
    return encoding.lower().replace("-", "").replace("_", "") == "utf8"


def _response_error() -> type[Exception]:
    import redis.exceptions as rexc

    return rexc.ResponseError


def _is_noscript(reply: Any) -> bool:
    import redis.exceptions as rexc

    return isinstance(reply, rexc.NoScriptError)


def _is_reply_error(exc: BaseException) -> bool:
    import redis.exceptions as rexc

    return isinstance(exc, rexc.ResponseError)


class RedisStreamsPublisher:
    """Publishes to Redis Streams (``redis.asyncio``), pipelined and de-duplicated."""

    def __init__(
        self,
        connection: RedisConnection,
        *,
        maxlen: int | None = None,
        dedup: DedupMode = "auto",
        dedup_window_seconds: float | None = None,
        idmp_producers: int = IDMP_PRODUCERS,
        envelope_format: CloudEventsOptions | None = None,
        wait_replicas: int = 0,
        wait_timeout_seconds: float = 1.0,
    ) -> None:
        """``maxlen`` trims the streams published to (``MAXLEN ~``). ``envelope_format``
        with CloudEvents writes each entry's ``headers`` field as the CloudEvent's headers
        (binary: ``ce-*``; structured: its content type) and ``payload`` as its body."""
        if maxlen is not None and maxlen < 1:
            raise exceptions.ConfigurationError(
                f"RedisStreamsBroker: maxlen must be >= 1, got {maxlen}"
            )
        if dedup not in ("auto", "script", "idmp", "off"):
            raise exceptions.ConfigurationError(
                f"RedisStreamsBroker: dedup must be auto, script, idmp or off, got {dedup!r}"
            )
        self.connection = connection
        self.envelope_format = envelope_format or CloudEventsOptions()
        self.maxlen = maxlen
        self.dedup: DedupMode = dedup
        self.idmp_producers = idmp_producers
        if wait_replicas < 0 or wait_timeout_seconds <= 0:
            raise exceptions.ConfigurationError(
                "RedisStreamsBroker: wait_replicas must be >= 0 and wait_timeout_seconds "
                f"> 0, got {wait_replicas} and {wait_timeout_seconds}"
            )
        #: ``WAIT`` for this many replicas of each master written to before a publish
        #: succeeds (0: not at all; Redis replication is asynchronous).
        self.wait_replicas = wait_replicas
        self.wait_timeout_seconds = wait_timeout_seconds
        self._window = dedup_window_seconds
        self._window_explicit = dedup_window_seconds is not None
        self._script: Any = None
        #: The de-duplication in use, chosen on connect from ``dedup`` and the server.
        self._mode: Literal["script", "idmp", "off"] | None = None
        #: The client ``_script`` was registered on: a new client gets it again.
        self._script_client: Any = None

    def __repr__(self) -> str:
        return f"RedisStreamsBroker({redact_url(self.url)!r})"

    @property
    def url(self) -> str:
        return self.connection.url

    @property
    def stream_prefix(self) -> str:
        return self.connection.stream_prefix

    @property
    def client(self) -> Any:
        """The connection's ``redis.asyncio`` client; BrokerUnavailable before ``connect``."""
        return self.connection.client

    @property
    def dedup_mode(self) -> Literal["script", "idmp", "off"] | None:
        """The de-duplication in use (``dedup`` with "auto" resolved); None before connect."""
        return self._mode

    @property
    def dedup_window_seconds(self) -> float:
        return self._window if self._window is not None else DEDUP_WINDOW_SECONDS

    def configure(self, *, dedup_window_seconds: float) -> None:
        if not self._window_explicit:
            self._window = dedup_window_seconds

    async def connect(self) -> None:
        await self.connection.connect()
        client = self.connection.client
        if self._mode is not None and self._script_client is client:
            return
        version = self.connection.server_version or (0, 0)
        mode = self.dedup
        if mode == "auto":
            mode = "script"
        elif mode == "idmp" and version < (8, 6):
            raise exceptions.ConfigurationError(
                f"RedisStreamsBroker(dedup='idmp') needs Redis 8.6+, "
                f"{redact_url(self.url)} runs {'.'.join(map(str, version))}"
            )
        self._mode = mode
        self._script = client.register_script(_PUBLISH_SCRIPT)
        self._script_client = client
        logger.info(
            "redis broker connected",
            extra={
                "action": "broker.connect",
                "broker_url": redact_url(self.url),
                "dedup": mode,
                "redis_version": ".".join(map(str, version)),
            },
        )

    async def aclose(self) -> None:
        await self.connection.aclose()
        if not self.connection.connected:
            self._mode = None
            self._script_client = None

    async def ping(self) -> None:
        await self.connection.ping()

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        if not batch:
            return []
        await self.connect()
        by_stream: dict[str, list[int]] = defaultdict(list)
        for index, envelope in enumerate(batch):
            by_stream[self.connection.stream_key(envelope.stream)].append(index)
        results: PublishResults = [None] * len(batch)
        try:
            if self._mode == "idmp":
                await self._publish_idmp(batch, by_stream, results)
            else:
                await self._publish_script(batch, by_stream, results)
        except Exception as exc:
            if is_unreachable(exc):
                raise self.connection.unavailable(exc) from exc
            code = refusal_code(exc) if _is_reply_error(exc) else None
            if code is not None:  # the whole pipeline refused (a cluster mid-failover)
                raise self.connection.refusing(code, exc) from exc
            raise
        for result in results:
            if isinstance(result, exceptions.BrokerRefusing):
                # Some messages of the batch may be in the stream already: the whole batch
                # comes back later and the de-duplication returns their first entries.
                raise result
        return results

    async def _publish_script(
        self, batch: Sequence[Envelope], by_stream: dict[str, list[int]], results: PublishResults
    ) -> None:
        ttl = int(self.dedup_window_seconds) if self._mode == "script" else 0
        maxlen = self.maxlen or 0
        calls: list[list[int]] = []
        scripts: list[tuple[list[str], list[Any]]] = []
        for stream, indexes in by_stream.items():
            try:
                self.connection.dedup_key(stream, "")
            except ValueError as exc:  # a name no hash tag can follow to its slot
                for i in indexes:
                    results[i] = exceptions.MessageRejected(
                        f"Redis refused message {batch[i].id}: {exc}"
                    )
                continue
            for start in range(0, len(indexes), SCRIPT_CHUNK):
                chunk = indexes[start : start + SCRIPT_CHUNK]
                keys = [stream]
                args: list[Any] = [ttl, maxlen]
                for i in chunk:
                    e = batch[i]
                    keys.append(self.connection.dedup_key(stream, e.id))
                    args += entry_values(e, self.envelope_format)
                scripts.append((keys, args))
                calls.append(chunk)
        if not calls:
            return
        streams = list(by_stream)
        if self.connection.cluster:
            replies, waits = await self._pipeline_scripts(scripts, streams)
        else:
            replies, waits = await self._send_scripts(scripts, streams)
        self._check_waits(waits, replies[len(calls) :], streams)
        for chunk, reply in zip(calls, replies[: len(calls)], strict=True):
            if isinstance(reply, BaseException):
                self._raise_if_unreachable(reply)
                for i in chunk:
                    results[i] = self._rejected(batch[i], reply)
                continue
            for i, entry in zip(chunk, reply, strict=True):
                text = entry.decode() if isinstance(entry, bytes) else str(entry)
                if text.startswith("!"):
                    results[i] = self._rejected(batch[i], text[1:])

    async def _pipeline_scripts(
        self, scripts: list[tuple[list[str], list[Any]]], streams: list[str]
    ) -> tuple[list[Any], list[str]]:
        """A Redis Cluster: the script calls as ``EVAL`` through redis-py's cluster
        pipeline, which sends each node its commands. The replies (errors in line) and
        the masters waited for."""
        async with self.client.pipeline(transaction=False) as pipe:
            for keys, args in scripts:
                pipe.execute_command("EVAL", _PUBLISH_SCRIPT, len(keys), *keys, *args)
            waits = self._queue_waits(pipe, streams)
            replies = await pipe.execute(raise_on_error=False)
        return replies, waits

    async def _send_scripts(
        self, scripts: list[tuple[list[str], list[Any]]], streams: list[str]
    ) -> tuple[list[Any], list[str]]:
        """A single Redis: the script calls (``EVALSHA``) and the ``WAIT`` packed by hiredis
        in one write and their replies read back on one connection of the pool: one round
        trip. redis-py's pipeline would encode every argument in Python (about 3 µs per
        message) and check the script cache with ``SCRIPT EXISTS`` first (a second round
        trip). A script cache emptied by a restart answers ``NOSCRIPT`` and executed
        nothing: the script is loaded and the whole batch sent again (the de-duplication
        returns the entries of any call that had run). The replies (errors in line) and
        the server waited for."""
        sha = self._script.sha
        commands: list[tuple[Any, ...]] = [
            ("EVALSHA", sha, len(keys), *keys, *args) for keys, args in scripts
        ]
        waits: list[str] = []
        if self.wait_replicas:
            commands.append(
                ("WAIT", self.wait_replicas, max(1, int(self.wait_timeout_seconds * 1000)))
            )
            waits.append(redact_url(self.url))
        replies = await self._roundtrip(commands)
        if any(_is_noscript(r) for r in replies[: len(scripts)]):
            await self.client.script_load(_PUBLISH_SCRIPT)
            replies = await self._roundtrip(commands)
        return replies, waits

    async def _roundtrip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``commands`` written at once on one pooled connection, their replies read in
        order; a reply error is returned in its place. A connection that failed or was
        cancelled mid-way (its replies unread) is closed, never reused."""
        pool = self.client.connection_pool
        conn = await pool.get_connection()
        try:
            if _pack_command is not None and _utf8(conn.encoder.encoding):
                packed: Any = b"".join([_pack_command(c) for c in commands])
            else:
                packed = conn.pack_commands(commands)
            await conn.send_packed_command(packed)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except _response_error() as exc:
                    replies.append(exc)
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
        return replies

    async def _publish_idmp(
        self, batch: Sequence[Envelope], by_stream: dict[str, list[int]], results: PublishResults
    ) -> None:
        order: list[int] = []
        async with self.client.pipeline(transaction=False) as pipe:
            for stream, indexes in by_stream.items():
                for i in indexes:
                    e = batch[i]
                    producer = f"fastapi-outbox-{uuid.UUID(e.id).int % self.idmp_producers}"
                    args: list[Any] = ["XADD", stream, "IDMP", producer, e.id]
                    if self.maxlen:
                        args += ["MAXLEN", "~", self.maxlen]
                    args.append("*")
                    args += entry_fields(e, self.envelope_format)
                    pipe.execute_command(*args)
                    order.append(i)
            waits = self._queue_waits(pipe, list(by_stream))
            replies = await pipe.execute(raise_on_error=False)
        self._check_waits(waits, replies[len(order) :], list(by_stream))
        for i, reply in zip(order, replies[: len(order)], strict=True):
            if isinstance(reply, BaseException):
                self._raise_if_unreachable(reply)
                results[i] = self._rejected(batch[i], reply)

    def _queue_waits(self, pipe: Any, streams: list[str]) -> list[str]:
        """``WAIT wait_replicas timeout`` after the writes, on the connection that carried
        them (Redis waits for the writes of the connection it is sent on): one for a single
        Redis, one per master of ``streams`` on a cluster (redis-py's cluster pipeline
        sends each master's commands on one connection). The names of the masters."""
        if not self.wait_replicas:
            return []
        args = ("WAIT", self.wait_replicas, max(1, int(self.wait_timeout_seconds * 1000)))
        if not self.connection.cluster:
            pipe.execute_command(*args)
            return [redact_url(self.url)]
        nodes = {}
        for stream in streams:
            node = self.client.get_node_from_key(stream)
            nodes[node.name] = node
        for node in nodes.values():
            pipe.execute_command(*args, target_nodes=node)
        return list(nodes)

    def _check_waits(self, waits: list[str], replies: list[Any], streams: list[str]) -> None:
        """BrokerUnavailable when a master had fewer than ``wait_replicas`` replicas take
        the writes in time, or (a cluster) a stream's slot moved to another master while
        the batch was written: the batch comes back later, and the de-duplication returns
        the entries already written."""
        for node, reply in zip(waits, replies, strict=True):
            if isinstance(reply, BaseException):
                self._raise_if_unreachable(reply)
                raise self.connection.unavailable(reply)
            if int(reply) < self.wait_replicas:
                raise exceptions.BrokerUnavailable(
                    f"Redis at {node}: {int(reply)} of wait_replicas={self.wait_replicas} "
                    f"replicas took the writes within {self.wait_timeout_seconds:g} s; "
                    "the batch will be published again"
                )
        if waits and self.connection.cluster:
            moved = [s for s in streams if self.client.get_node_from_key(s).name not in waits]
            if moved:
                raise exceptions.BrokerUnavailable(
                    f"Redis Cluster {redact_url(self.url)}: the slot of {moved[0]!r} moved "
                    "while the batch was written, its replication is unconfirmed; the batch "
                    "will be published again"
                )

    def _rejected(self, envelope: Envelope, error: BaseException | str) -> BaseException:
        """The result for a message Redis refused:
        [`MessageRejected`][fastapi_outbox.MessageRejected], or
        [`BrokerRefusing`][fastapi_outbox.BrokerRefusing] when the error's code says Redis refuses
        every write
        (``publish`` then raises it for the whole batch)."""
        code = refusal_code(error)
        if code is not None:
            return self.connection.refusing(code, error)
        return exceptions.MessageRejected(
            f"Redis refused message {envelope.id} on stream {envelope.stream!r}: {error}"
        )

    def _raise_if_unreachable(self, reply: BaseException) -> None:
        if is_unreachable(reply):
            raise self.connection.unavailable(reply)

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
