"""Ordered consumption across replicas: three consumer processes of one ordered group,
SIGKILLed and restarted during the run, on Redis and NATS with a PostgreSQL inbox.

20 keys x 100 steps are published interleaved by step, ten steps at a time (the next ten
once the consumers are near the end of what was published: they are at work whenever a kill
comes). Three ``fastapi-outbox dispatch --app
tests.acceptance.ordered_app:outbox`` processes share the group (partitions leased in the
database, :mod:`fastapi_outbox.consume.partitioned`); at three points of the run the test
SIGKILLs the process that recorded the latest step (an owner at work, mid-handler or between
messages) and starts a new one. Each handler records its step
as a row of ``steps`` (serial id) in its transaction. At the end every key's rows, in
commit order, are exactly its steps 0..99: each handled once, in stream order, whatever
process handled it.

A frozen owner (Redis): of two processes, the one at work is SIGSTOPped until the other has
taken its partitions over (after the lease), then SIGCONTed: it logs its partitions taken
over, and the steps are still each once, in order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from fastapi_outbox import Outbox, OutboxSettings, uuid7
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.events import Envelope
from tests.acceptance.test_consumer_kill import _cleanup
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KEYS = 20
STEPS = 100
#: Steps published at a time: the next chunk once the consumers are near the end of it.
CHUNK = 10
PROCESSES = 3
#: Rows recorded when a process is SIGKILLed (and a new one started).
KILL_AT = [500, 1000, 1500]
BOUND_SECONDS = 60.0


def envelopes(stream: str, steps: range) -> list[Envelope]:
    out = []
    for step in steps:
        for k in range(KEYS):
            key = f"key-{k}"
            message_id = str(uuid7())
            out.append(
                Envelope(
                    message_id,
                    stream,
                    "Step",
                    key,
                    json.dumps({"key": key, "step": step}).encode(),
                    {"message-id": message_id, "type": "Step", "correlation-id": "load"},
                )
            )
    return out


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


@pytest.fixture(params=["redis", "nats", "kafka"])
async def broker_url(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    kind = request.param
    url = str(request.getfixturevalue(f"{kind}_url"))
    stream = unique("steps")
    if kind == "kafka":  # a killed member leaves its group after 2 s
        yield kind, url + "?session_timeout_seconds=2&heartbeat_interval_seconds=0.5", stream
        from aiokafka.admin import AIOKafkaAdminClient

        from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers(url))
        await admin.start()
        try:
            await admin.delete_topics([stream, f"{stream}.ordered.dlq"])
        finally:
            await admin.close()
        return
    yield kind, url, stream
    await _cleanup(kind, url, stream)


class Run:
    """The group's consumer processes, the producer and the ``steps`` table of one test."""

    def __init__(
        self, pg_url: str, url: str, stream: str, procs: list[Any], tmp_path: Path
    ) -> None:
        self.pg_url, self.stream, self.procs, self.tmp_path = pg_url, stream, procs, tmp_path
        self.producer: Broker = broker_from_url(url)
        self.published = 0
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
            "DATABASE_URL": pg_url,
            "BROKER_URL": url,
            "CONSUMER_STREAM": stream,
            "CONSUMER_GROUP": "ordered",
            # The partition lease: a killed process's partitions move after it.
            "OUTBOX_CONSUMER_CLAIM_IDLE_SECONDS": "1",
            "OUTBOX_CONSUMER_RETRY_BASE_DELAY_SECONDS": "0.05",
            "OUTBOX_CONSUMER_RETRY_MAX_DELAY_SECONDS": "0.5",
            "OUTBOX_CONSUMER_ORDERED_PARTITIONS": "12",
            "OUTBOX_SHUTDOWN_TIMEOUT_SECONDS": "3",
            "PYTHONPATH": str(REPO),
        }
        self.pg: Any = None

    async def __aenter__(self) -> Run:
        outbox = Outbox(self.pg_url, settings=OutboxSettings(run_relays=False))
        await outbox.create_tables()
        await outbox.aclose()
        self.pg = await asyncpg.connect(self.pg_url.replace("+asyncpg", ""))
        await self.pg.execute(
            "CREATE TABLE steps (id serial PRIMARY KEY, key text NOT NULL, step int NOT NULL, "
            "member text NOT NULL)"
        )
        await self.producer.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.aclose()
        await self.pg.close()

    def start(self) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "fastapi_outbox", "dispatch", "--app"]
        argv.append("tests.acceptance.ordered_app:outbox")
        with self.log_path(len(self.procs)).open("wb") as log:
            proc = subprocess.Popen(
                argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)
        return proc

    def log_path(self, index: int) -> Path:
        return self.tmp_path / f"consumer-{index}.log"

    def log_of(self, proc: subprocess.Popen[bytes]) -> bytes:
        return self.log_path(self.procs.index(proc)).read_bytes()

    async def recorded(self) -> int:
        return int(await self.pg.fetchval("SELECT count(*) FROM steps"))

    async def latest_member(self) -> int:
        return int(await self.pg.fetchval("SELECT member FROM steps ORDER BY id DESC LIMIT 1"))

    async def publish_more(self, rows: int, steps: int) -> None:
        """The next CHUNK steps once the consumers are near the end of what was published."""
        if self.published < steps and rows >= (self.published - CHUNK // 2) * KEYS:
            chunk = envelopes(
                self.stream, range(self.published, min(steps, self.published + CHUNK))
            )
            assert await self.producer.publish(chunk) == [None] * len(chunk)
            self.published += CHUNK

    async def stop(self, running: list[subprocess.Popen[bytes]]) -> None:
        # A process started last may still be starting: SIGTERM once it runs.
        for p in running:
            log = self.log_path(self.procs.index(p))
            await wait_until(lambda: b"relays started" in log.read_bytes(), timeout=15)  # noqa: B023
            p.send_signal(signal.SIGTERM)
        for p in running:
            assert p.wait(timeout=15) == 0, self.tmp_path

    async def check_in_order_once(self, steps: int) -> set[str]:
        """Every key's steps 0..steps-1, once each, in commit order; the inbox holds each
        message once. Returns the pids that recorded steps."""
        rows: list[Any] = await self.pg.fetch("SELECT key, step, member FROM steps ORDER BY id")
        by_key: dict[str, list[int]] = {}
        for row in rows:
            by_key.setdefault(row["key"], []).append(row["step"])
        assert sorted(by_key) == sorted(f"key-{k}" for k in range(KEYS))
        for key, got in by_key.items():
            assert got == list(range(steps)), key
        inbox = await self.pg.fetchval(
            "SELECT count(*) FROM outbox_inbox WHERE \"group\" = 'ordered'"
        )
        assert inbox == KEYS * steps
        return {row["member"] for row in rows}


async def test_three_replicas_killed_and_restarted_keep_every_key_in_order_once(
    pg_url: str,
    broker_url: tuple[str, str, str],
    procs: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    kind, url, stream = broker_url
    async with Run(pg_url, url, stream, procs, tmp_path) as run:
        await run.publish_more(0, STEPS)
        running = [run.start() for _ in range(PROCESSES)]
        kills: list[int] = []
        with anyio.fail_after(BOUND_SECONDS):
            while True:
                rows = await run.recorded()
                await run.publish_more(rows, STEPS)
                if len(kills) < len(KILL_AT) and rows >= KILL_AT[len(kills)]:
                    # The process that recorded the latest step: an owner at work.
                    pid = await run.latest_member()
                    victim = next((p for p in running if p.pid == pid), running[0])
                    running.remove(victim)
                    victim.send_signal(signal.SIGKILL)
                    assert victim.wait(timeout=10) == -signal.SIGKILL
                    kills.append(rows)
                    running.append(run.start())
                if rows >= KEYS * STEPS:
                    break
                for p in running:
                    assert p.poll() is None, f"a consumer died on its own: {tmp_path}"
                await anyio.sleep(0.05)
        await run.stop(running)
        assert len(kills) == len(KILL_AT)
        members = await run.check_in_order_once(STEPS)
        assert len(members) >= PROCESSES
        # Partitions moved: processes started after a kill took some over (on Kafka, the
        # group's own partitions, assigned by a rebalance).
        logs = [run.log_path(i).read_bytes() for i in range(len(procs))]
        moved = b"partitions assigned" if kind == "kafka" else b"partitions taken"
        assert any(moved in log for log in logs[PROCESSES:]), tmp_path


async def test_a_frozen_owner_loses_its_partitions_and_commits_nothing_stale(
    pg_url: str, redis_url: str, procs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """Two processes; the one at work is frozen (SIGSTOP) until the other took its
    partitions over (after the lease), then thawed (SIGCONT): it finds its partitions gone
    (renewal or fence) and handles nothing twice or out of order."""
    stream = unique("steps")
    steps = 40
    try:
        async with Run(pg_url, redis_url, stream, procs, tmp_path) as run:
            await run.publish_more(0, steps)
            a, b = run.start(), run.start()
            with anyio.fail_after(BOUND_SECONDS):
                while await run.recorded() < 100:
                    await run.publish_more(await run.recorded(), steps)
                    await anyio.sleep(0.05)
                frozen = a if await run.latest_member() == a.pid else b
                other = b if frozen is a else a
                taken_before = run.log_of(other).count(b"partitions taken")
                frozen.send_signal(signal.SIGSTOP)
                try:
                    # The other process takes the frozen one's partitions after the lease.
                    while run.log_of(other).count(b"partitions taken") == taken_before:
                        await run.publish_more(await run.recorded(), steps)
                        await anyio.sleep(0.05)
                finally:
                    frozen.send_signal(signal.SIGCONT)
                while b"partition taken over by another process" not in run.log_of(frozen):
                    await run.publish_more(await run.recorded(), steps)
                    await anyio.sleep(0.05)
                while (rows := await run.recorded()) < KEYS * steps:
                    await run.publish_more(rows, steps)
                    await anyio.sleep(0.05)
            await run.stop([a, b])
            await run.check_in_order_once(steps)
    finally:
        await _cleanup("redis", redis_url, stream)
