"""An ordered subscriber whose handler kills its process on one message, every time: the
attempts are counted in the partition's lease row (they survive the process), so after
``consumer_max_attempts`` restarts the message is dead-lettered and the messages behind
it in its partition go on — a poison message does not hold its partition back forever.

A ``fastapi-outbox dispatch`` subprocess consumes a Redis stream into PostgreSQL, every
key in one partition; the handler calls ``os._exit(1)`` on message 3. The test restarts the
process each time it dies (at most ``max_attempts + 2`` runs) until the dead letter is
written and every other message is recorded. With ``batch=False`` the handler dies on the
message's first attempt, recorded by the fence of the message before it; with batches the
first death comes in a batch (which costs its messages no attempt: the next owner handles
them one by one), so there is one death more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import asyncpg
import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings, uuid7
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.events import Envelope
from tests.conftest import unique

REPO = Path(__file__).resolve().parents[3]
APP = "tests.integration.consume.ordered_crash_app:outbox"
MAX_ATTEMPTS = 2
MESSAGES = 10
POISON = 3
#: Whole test, process start-ups included.
BOUND_SECONDS = 40.0


def steps(stream: str) -> list[Envelope]:
    """Ten steps of two keys, interleaved (a0 b0 a1 b1 …): one partition holds both."""
    out = []
    for n in range(MESSAGES):
        message_id = str(uuid7())
        key = "ab"[n % 2]
        body = json.dumps({"key": key, "n": n}).encode()
        headers = {"message-id": message_id, "type": "Step"}
        out.append(Envelope(message_id, stream, "Step", key, body, headers))
    return out


@pytest.mark.parametrize("batch", [False, True], ids=["message", "batch"])
async def test_a_handler_that_kills_its_process_is_dead_lettered_after_max_attempts(
    pg_url: str, redis_url: str, tmp_path: Path, batch: bool
) -> None:
    stream, group = unique("ordcrash"), unique("g")
    outbox = Outbox(
        pg_url,
        brokers={"default": broker_from_url(redis_url)},
        settings=OutboxSettings(run_relays=False),
    )

    @outbox.subscriber(stream, group=group, start="all", ordered=True)
    async def record(message: Message) -> None:  # the subprocess's, for its dead letters
        pass

    await outbox.create_tables()
    consumer = outbox.subscribers[0].make_consumer()
    pg = await asyncpg.connect(pg_url.replace("+asyncpg", ""))
    producer = broker_from_url(redis_url)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await pg.execute(
            "CREATE TABLE crash_steps (id serial PRIMARY KEY, key varchar(64) NOT NULL, "
            "n int NOT NULL)"
        )
        await producer.connect()
        assert all(r is None for r in await producer.publish(steps(stream)))
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
            "DATABASE_URL": pg_url,
            "BROKER_URL": redis_url,
            "CONSUMER_STREAM": stream,
            "CONSUMER_GROUP": group,
            "POISON": str(POISON),
            "CONSUMER_BATCH": "1" if batch else "0",
            "OUTBOX_CONSUMER_ORDERED_PARTITIONS": "1",
            "OUTBOX_CONSUMER_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
            "OUTBOX_CONSUMER_CLAIM_IDLE_SECONDS": "1",
            "OUTBOX_CONSUMER_RETRY_BASE_DELAY_SECONDS": "0.05",
            "OUTBOX_CONSUMER_RETRY_MAX_DELAY_SECONDS": "0.2",
            "OUTBOX_SHUTDOWN_TIMEOUT_SECONDS": "3",
            "PYTHONPATH": str(REPO),
        }
        argv = [sys.executable, "-m", "fastapi_outbox", "dispatch", "--app", APP]
        others = [n for n in range(MESSAGES) if n != POISON]

        async def recorded() -> list[tuple[str, int]]:
            rows = await pg.fetch("SELECT key, n FROM crash_steps ORDER BY id")
            return [(r["key"], r["n"]) for r in rows]

        async def finished() -> bool:
            return await consumer.count_dead_letters() >= 1 and len(await recorded()) >= len(others)

        deadline = time.monotonic() + BOUND_SECONDS
        deaths = 0
        done = False
        log = tmp_path / "consumer.log"

        def start() -> subprocess.Popen[bytes]:
            with log.open("ab") as out:
                proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=out)
            procs.append(proc)
            return proc

        for _run in range(MAX_ATTEMPTS + 2):
            proc = start()
            while time.monotonic() < deadline:
                if await finished():
                    done = True
                    break
                if proc.poll() is not None:
                    break
                await anyio.sleep(0.05)
            if done or time.monotonic() >= deadline:
                break
            assert proc.returncode == 1, (proc.returncode, _tail(tmp_path))  # os._exit(1)
            deaths += 1
        assert done, (deaths, await recorded(), _tail(tmp_path))

        # The handler started on the poison message MAX_ATTEMPTS times on its own (once
        # more in the first batch): it is dead-lettered once, without a row.
        assert deaths == (MAX_ATTEMPTS + 1 if batch else MAX_ATTEMPTS)
        [dead] = await consumer.dead_letters()
        assert dead.type == "Step" and dead.attempts == MAX_ATTEMPTS + 1
        assert f"max_attempts={MAX_ATTEMPTS}" in dead.error and "crashed" in dead.error
        # Every other message of the partition exactly once and in stream order, both keys.
        assert await recorded() == [("ab"[n % 2], n) for n in others]
        # The process that dead-lettered it lives on and handled the rest.
        assert procs[-1].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        await pg.close()
        await consumer.aclose()
        await producer.aclose()
        await outbox.aclose()
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        keys = [k async for k in client.scan_iter(match=f"*{stream}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def _tail(tmp_path: Path) -> str:
    return (tmp_path / "consumer.log").read_text(errors="replace")[-3000:]
