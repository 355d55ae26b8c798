"""``KafkaConnection``: what a Kafka publisher and its consumers share — the bootstrap
servers and every client policy (timeouts, retries, keep-alive, group liveness), one
producer (``acks="all"``, idempotent where the cluster grants a producer id), one admin
client that creates the topics a stream and its dead letters need, and the translation of
a client failure into ``BrokerUnavailable``.

The publisher and the consumers each receive this object and never read each other
(faststream's ``redis/configs/state.py`` is the example). Every client's policy is set
here from named constants, never left to aiokafka's defaults:

* requests (produce, metadata, admin, offsets) wait ``REQUEST_TIMEOUT_SECONDS`` at most; a
  failed request is retried by aiokafka every ``RETRY_BACKOFF_SECONDS`` within that time,
  and what is still unanswered then is an outage (the relay pauses, no attempt is spent);
* an idle connection is closed after ``CONNECTIONS_MAX_IDLE_SECONDS`` and opened again on
  the next call; metadata is refreshed every ``METADATA_MAX_AGE_SECONDS`` (a moved leader
  or a new partition is seen within that, or at once on an error);
* a consumer heartbeats every ``HEARTBEAT_INTERVAL_SECONDS`` and the group coordinator
  drops a member silent for ``SESSION_TIMEOUT_SECONDS`` (a process killed, frozen or cut
  off): its partitions go to the others, from their last committed offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.kafka.wire import bootstrap_servers, outage
from fastapi_outbox.redaction import redact, redact_url

__all__ = [
    "CONNECTIONS_MAX_IDLE_SECONDS",
    "DEAD_LETTER_PARTITIONS",
    "HEARTBEAT_INTERVAL_SECONDS",
    "MAX_BATCH_BYTES",
    "MAX_REQUEST_BYTES",
    "METADATA_MAX_AGE_SECONDS",
    "REQUEST_TIMEOUT_SECONDS",
    "RETRY_BACKOFF_SECONDS",
    "SESSION_TIMEOUT_SECONDS",
    "TOPIC_PARTITIONS",
    "TOPIC_REPLICATION",
    "KafkaConnection",
]

logger = logging.getLogger("fastapi_outbox.brokers.kafka")

#: Longest wait for one request (a produce and its ``acks="all"``, metadata, an offset
#: commit, an admin call); aiokafka retries within it, an answer still missing then is an
#: outage.
REQUEST_TIMEOUT_SECONDS = 10.0
#: Pause between aiokafka's retries of a failed request (a leader moving, a broker down).
RETRY_BACKOFF_SECONDS = 0.2
#: Metadata (partitions, leaders) is refreshed at least this often.
METADATA_MAX_AGE_SECONDS = 30.0
#: An idle connection is closed after this long (a NAT or load balancer that forgets idle
#: flows never leaves a dead socket in the pool); the next call opens a new one.
CONNECTIONS_MAX_IDLE_SECONDS = 60.0
#: A consumer is dropped from its group when the coordinator hears nothing from it for this
#: long (a process killed or frozen): its partitions go to the group's other members.
SESSION_TIMEOUT_SECONDS = 10.0
#: A consumer's heartbeat to the group coordinator (a third of the session: two may be lost).
HEARTBEAT_INTERVAL_SECONDS = 3.0
#: The largest record the producer sends (Kafka's default ``message.max.bytes``, about
#: 1 MiB): a larger message fails alone with a ``last_error`` naming the claim check.
MAX_REQUEST_BYTES = 1_048_576
#: Records of one partition the producer gathers into one request.
MAX_BATCH_BYTES = 512 * 1024
#: Partitions and replication factor of a stream's topic the broker creates.
TOPIC_PARTITIONS = 3
TOPIC_REPLICATION = 1
#: A dead-letter topic has one partition: its letters are listed and replayed in order.
DEAD_LETTER_PARTITIONS = 1
#: Kafka's error code for "topic already exists" in a CreateTopics answer.
_TOPIC_EXISTS = 36


class KafkaConnection:
    """The Kafka cluster at ``url`` (``kafka://host:9092[,host:9092…]``): its producer, its
    admin client, the topics known to exist, and the client policies."""

    def __init__(
        self,
        url: str,
        *,
        client_id: str = "fastapi-outbox",
        topic_name: str = "{stream}",
        topic_partitions: int = TOPIC_PARTITIONS,
        topic_replication: int = TOPIC_REPLICATION,
        create_topics: bool = True,
        request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
        session_timeout_seconds: float = SESSION_TIMEOUT_SECONDS,
        heartbeat_interval_seconds: float = HEARTBEAT_INTERVAL_SECONDS,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        idempotence: bool | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.servers = bootstrap_servers(url)
        self.client_id = client_id
        self.topic_name = topic_name
        self.topic_partitions = topic_partitions
        self.topic_replication = topic_replication
        self.create_topics = create_topics
        self.request_timeout_seconds = request_timeout_seconds
        self.session_timeout_seconds = session_timeout_seconds
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.max_request_bytes = max_request_bytes
        #: None: detected at connect (the idempotent producer where the cluster grants a
        #: producer id); True/False: asked for (True fails the connect when refused).
        self.idempotence = idempotence
        self.client_options = dict(client_options or {})
        #: Whether the producer is idempotent: set by ``connect``.
        self.idempotent: bool | None = None
        self.producer: Any = None
        self._admin: Any = None
        self._lock = asyncio.Lock()
        #: Topics known to exist (created or found); forgotten after an outage, since a
        #: restarted cluster may have lost them.
        self._topics: set[str] = set()

    def __repr__(self) -> str:
        return f"KafkaConnection({redact_url(self.url)!r})"

    # -- policies ---------------------------------------------------------------------------

    def common_options(self) -> dict[str, Any]:
        """The options every aiokafka client of this connection gets."""
        return {
            "bootstrap_servers": self.servers,
            "client_id": self.client_id,
            "request_timeout_ms": int(self.request_timeout_seconds * 1000),
            "retry_backoff_ms": int(RETRY_BACKOFF_SECONDS * 1000),
            "metadata_max_age_ms": int(METADATA_MAX_AGE_SECONDS * 1000),
            "connections_max_idle_ms": int(CONNECTIONS_MAX_IDLE_SECONDS * 1000),
            **self.client_options,
        }

    def producer_options(self, *, idempotent: bool) -> dict[str, Any]:
        """``acks="all"``: a record is acknowledged once every in-sync replica has it."""
        return {
            **self.common_options(),
            "acks": "all",
            "enable_idempotence": idempotent,
            "max_request_size": self.max_request_bytes,
            "max_batch_size": MAX_BATCH_BYTES,
            "linger_ms": 0,
        }

    def consumer_options(self, group_id: str | None) -> dict[str, Any]:
        """A group consumer that commits by hand (after the inbox transaction committed),
        starting from the beginning of a partition the group has no offset for (the
        group's initial offsets are set by ``setup``)."""
        options = {
            **self.common_options(),
            "group_id": group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "max_partition_fetch_bytes": max(self.max_request_bytes, 1_048_576),
        }
        if group_id is not None:
            options |= {
                "session_timeout_ms": int(self.session_timeout_seconds * 1000),
                "heartbeat_interval_ms": int(self.heartbeat_interval_seconds * 1000),
                "rebalance_timeout_ms": int(self.session_timeout_seconds * 1000),
            }
        return options

    def topic(self, stream: str) -> str:
        """The topic of ``stream``: the ``topic_name`` template filled in."""
        return self.topic_name.format(stream=stream)

    def unavailable(self, error: BaseException) -> Exception:
        """The outage ``error`` is, or BrokerUnavailable wrapping it."""
        found = outage(error, self.url)
        if found is not None:
            return found
        return exceptions.BrokerUnavailable(
            f"Kafka at {redact_url(self.url)}: {type(error).__name__}: {redact(str(error))}"
        )

    # -- the producer and the admin client ----------------------------------------------------

    async def connect(self) -> None:
        """Start the admin client and the producer when not done: the idempotent producer
        where the cluster grants a producer id (``InitProducerId``), else a plain one (the
        consumers' inbox removes the copies a retried send may leave). BrokerUnavailable
        when no server of the URL answers."""
        if self.producer is not None and self._admin is not None:
            return
        async with self._lock:
            if self.producer is not None and self._admin is not None:
                return
            from aiokafka.admin import AIOKafkaAdminClient

            if self._admin is None:
                admin = AIOKafkaAdminClient(**self.common_options())
                try:
                    await admin.start()
                except Exception as exc:
                    with contextlib.suppress(Exception):
                        await admin.close()
                    raise self.unavailable(exc) from exc
                self._admin = admin
            if self.producer is None:
                self.producer = await self._start_producer()

    async def _grants_producer_id(self) -> bool:
        """Whether the cluster grants a producer id (``InitProducerId`` without a
        transactional id answers without error): asked once, on a client of its own, so
        a refusal costs no failed producer start (and no error logged by aiokafka)."""
        from aiokafka.client import AIOKafkaClient
        from aiokafka.protocol.transaction import InitProducerIdRequest

        client = AIOKafkaClient(**self.common_options())
        try:
            await asyncio.wait_for(client.bootstrap(), self.request_timeout_seconds)
            answer = await asyncio.wait_for(
                client.send(
                    client.get_random_node(),
                    InitProducerIdRequest(
                        transactional_id=None,
                        transaction_timeout_ms=int(self.request_timeout_seconds * 1000),
                    ),
                ),
                self.request_timeout_seconds,
            )
        except Exception as exc:
            if outage(exc, self.url) is not None:
                raise self.unavailable(exc) from exc
            return False
        finally:
            with contextlib.suppress(Exception):
                await client.close()
        granted = int(getattr(answer, "error_code", -1)) == 0
        if not granted:
            logger.info(
                "kafka grants no producer id, producing without idempotence",
                extra={
                    "action": "broker.idempotence_refused",
                    "broker_url": redact_url(self.url),
                    "error_code": getattr(answer, "error_code", None),
                },
            )
        return granted

    async def _start_producer(self) -> Any:
        from aiokafka import AIOKafkaProducer

        if self.idempotence is not None:
            tries = [self.idempotence]
        else:
            tries = [True, False] if await self._grants_producer_id() else [False]
        last: BaseException | None = None
        for idempotent in tries:
            producer = AIOKafkaProducer(**self.producer_options(idempotent=idempotent))
            try:
                await asyncio.wait_for(producer.start(), self.request_timeout_seconds)
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await producer.stop()
                if outage(exc, self.url) is not None:
                    raise self.unavailable(exc) from exc
                # The cluster refused the idempotent producer at its start after all:
                # produce without it.
                last = exc
                logger.info(
                    "kafka idempotent producer refused, producing without idempotence",
                    extra={
                        "action": "broker.idempotence_refused",
                        "broker_url": redact_url(self.url),
                        "error": f"{type(exc).__name__}: {exc}",
                    },
                )
                continue
            self.idempotent = idempotent
            logger.info(
                "kafka connected",
                extra={
                    "action": "broker.connect",
                    "broker_url": redact_url(self.url),
                    "idempotent": idempotent,
                },
            )
            return producer
        assert last is not None
        raise exceptions.ConfigurationError(
            f"Kafka at {redact_url(self.url)} refused the idempotent producer "
            f"({type(last).__name__}: {last}): pass idempotence=None to KafkaBroker to "
            "produce without it where the cluster refuses it"
        )

    async def aclose(self) -> None:
        producer, admin = self.producer, self._admin
        self.producer = self._admin = None
        self._topics.clear()
        if producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), self.request_timeout_seconds)
        if admin is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(admin.close(), self.request_timeout_seconds)

    async def ping(self) -> None:
        """A metadata round trip: BrokerUnavailable when no server answers in time."""
        await self.connect()
        try:
            await asyncio.wait_for(self._admin.list_topics(), self.request_timeout_seconds)
        except Exception as exc:
            raise self.unavailable(exc) from exc

    def forget_topics(self) -> None:
        """After an outage: check the topics again before the next send (a cluster
        restarted on memory storage lost them, and a send to a missing topic would have
        the server create it with its own defaults)."""
        self._topics.clear()

    async def ensure_topics(self, topics: Iterable[str], *, partitions: int | None = None) -> None:
        """Create the ``topics`` that do not exist yet (``topic_partitions`` partitions, or
        ``partitions``; ``topic_replication`` replicas); found ones are kept as they are."""
        missing = [t for t in topics if t not in self._topics]
        if not missing:
            return
        if not self.create_topics:
            self._topics.update(missing)
            return
        await self.connect()
        from aiokafka.admin import NewTopic

        count = partitions or self.topic_partitions
        try:
            answer = await asyncio.wait_for(
                self._admin.create_topics(
                    [NewTopic(t, count, self.topic_replication) for t in missing],
                    timeout_ms=int(self.request_timeout_seconds * 1000),
                ),
                self.request_timeout_seconds,
            )
        except Exception as exc:
            raise self.unavailable(exc) from exc
        for topic, code, message in _topic_errors(answer):
            if code not in (0, _TOPIC_EXISTS):
                raise exceptions.BrokerUnavailable(
                    f"Kafka at {redact_url(self.url)} did not create topic {topic!r} "
                    f"(error {code}: {message})"
                )
            if code == 0:
                logger.info(
                    "kafka topic created",
                    extra={
                        "action": "broker.topic_created",
                        "topic": topic,
                        "partitions": count,
                        "replication": self.topic_replication,
                    },
                )
        self._topics.update(missing)

    async def partitions(self, topic: str) -> list[int]:
        """The partition numbers of ``topic`` (from the cluster's metadata); [] when the
        topic does not exist."""
        await self.connect()
        try:
            described = await asyncio.wait_for(
                self._admin.describe_topics([topic]), self.request_timeout_seconds
            )
        except Exception as exc:
            raise self.unavailable(exc) from exc
        for entry in described:
            if entry.get("topic") == topic and not entry.get("error_code"):
                return sorted(p["partition"] for p in entry.get("partitions", []))
        return []

    async def send_and_wait(
        self, topic: str, value: bytes, *, key: bytes | None, headers: list[tuple[str, bytes]]
    ) -> None:
        """One record, acknowledged by every in-sync replica (dead letters, replays)."""
        await self.connect()
        await self.ensure_topics([topic])
        try:
            future = await self.producer.send(topic, value, key=key, headers=headers)
            await asyncio.wait_for(future, self.request_timeout_seconds)
        except Exception as exc:
            found = outage(exc, self.url)
            if found is not None:
                self.forget_topics()
                raise found from exc
            raise exceptions.MessageRejected(
                f"Kafka refused a record on topic {topic!r}: {type(exc).__name__}: {exc}"
            ) from exc


def _topic_errors(answer: Any) -> list[tuple[str, int, str | None]]:
    out = []
    for entry in getattr(answer, "topic_errors", []) or []:
        topic, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 else None
        out.append((str(topic), int(code), message))
    return out
