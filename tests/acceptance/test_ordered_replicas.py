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


@pytest.fixture(params=["redis", "nats"])
async def broker_url(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    kind = request.param
    url = str(request.getfixturevalue(f"{kind}_url"))
    stream = unique("steps")
    yield kind, url, stream
    await _cleanup(kind, url, stream)


async def test_three_replicas_killed_and_restarted_keep_every_key_in_order_once(
    pg_url: str,
    broker_url: tuple[str, str, str],
    procs: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    _kind, url, stream = broker_url
    outbox = Outbox(pg_url, settings=OutboxSettings(run_dispatchers=False))
    await outbox.create_tables()
    await outbox.aclose()
    pg = await asyncpg.connect(pg_url.replace("+asyncpg", ""))
    await pg.execute(
        "CREATE TABLE steps (id serial PRIMARY KEY, key text NOT NULL, step int NOT NULL, "
        "member text NOT NULL)"
    )
    producer: Broker = broker_from_url(url)
    env = {
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
    argv = [sys.executable, "-m", "fastapi_outbox", "dispatch", "--app"]
    argv.append("tests.acceptance.ordered_app:outbox")

    def start() -> subprocess.Popen[bytes]:
        with (tmp_path / f"consumer-{len(procs)}.log").open("wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    async def recorded() -> int:
        return int(await pg.fetchval("SELECT count(*) FROM steps"))

    try:
        await producer.connect()
        published = 0

        async def publish_next() -> None:
            nonlocal published
            chunk = envelopes(stream, range(published, min(STEPS, published + CHUNK)))
            assert await producer.publish(chunk) == [None] * len(chunk)
            published += CHUNK

        await publish_next()
        running = [start() for _ in range(PROCESSES)]
        kills: list[int] = []
        with anyio.fail_after(BOUND_SECONDS):
            while True:
                rows = await recorded()
                if published < STEPS and rows >= (published - CHUNK // 2) * KEYS:
                    await publish_next()
                if len(kills) < len(KILL_AT) and rows >= KILL_AT[len(kills)]:
                    # The process that recorded the latest step: an owner at work.
                    pid = int(
                        await pg.fetchval("SELECT member FROM steps ORDER BY id DESC LIMIT 1")
                    )
                    victim = next((p for p in running if p.pid == pid), running[0])
                    running.remove(victim)
                    victim.send_signal(signal.SIGKILL)
                    assert victim.wait(timeout=10) == -signal.SIGKILL
                    kills.append(rows)
                    running.append(start())
                if rows >= KEYS * STEPS:
                    break
                for p in running:
                    assert p.poll() is None, f"a consumer died on its own: {tmp_path}"
                await anyio.sleep(0.05)
        # A process started last may still be starting: SIGTERM once it runs.
        for p in running:
            log = tmp_path / f"consumer-{procs.index(p)}.log"
            await wait_until(lambda: b"dispatchers started" in log.read_bytes(), timeout=15)  # noqa: B023
            p.send_signal(signal.SIGTERM)
        for p in running:
            assert p.wait(timeout=15) == 0, tmp_path
        assert len(kills) == len(KILL_AT)
        rows_: list[Any] = await pg.fetch("SELECT key, step, member FROM steps ORDER BY id")
        by_key: dict[str, list[int]] = {}
        members: set[str] = set()
        for row in rows_:
            by_key.setdefault(row["key"], []).append(row["step"])
            members.add(row["member"])
        assert sorted(by_key) == sorted(f"key-{k}" for k in range(KEYS))
        for key, steps in by_key.items():
            assert steps == list(range(STEPS)), key
        assert len(members) >= PROCESSES
        # Partitions moved: processes started after a kill took some over.
        logs = [(tmp_path / f"consumer-{i}.log").read_bytes() for i in range(len(procs))]
        assert any(b"partitions taken" in log for log in logs[PROCESSES:]), tmp_path
        inbox = await pg.fetchval("SELECT count(*) FROM outbox_inbox WHERE \"group\" = 'ordered'")
        assert inbox == KEYS * STEPS
    finally:
        await producer.aclose()
        await pg.close()
