"""A consumer process SIGKILLed repeatedly mid-handler, on the real brokers: every effect
exactly once.

``fastapi-outbox dispatch --app tests.acceptance.consumer_app:outbox`` consumes 600
messages (in the outbox's publish format) from a Redis stream or a JetStream subject into
PostgreSQL. On chosen messages the process kills itself with SIGKILL — inside the handler
after the effect is flushed (before the commit), or after the commit before the broker ack.
The test restarts it each time it dies, producing the second half of the messages while
the kills go on. At the end every message has exactly one effect row: a redelivery after a
kill before the commit is handled (nothing was committed), one after a kill between commit
and ack finds its inbox row and is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from fastapi_outbox import Outbox, OutboxSettings, uuid7
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.events import Envelope
from tests.conftest import unique

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
#: Three kills in the first half (consumed before the second half is produced), three in the
#: second (produced while the kills go on); each at least 70 messages (four batches of the
#: app's 16 handlers) from the next.
MESSAGES = 600
KILL_BEFORE_COMMIT = [45, 210, 390]
KILL_AFTER_COMMIT = [120, 300, 510]
BOUND_SECONDS = 55.0


def envelopes(stream: str, numbers: range, type_: str = "Tick") -> list[Envelope]:
    out = []
    for n in numbers:
        message_id = str(uuid7())
        out.append(
            Envelope(
                message_id,
                stream,
                type_,
                None,
                json.dumps({"n": n}).encode(),
                {"message-id": message_id, "type": type_, "correlation-id": "load"},
            )
        )
    return out


@pytest.fixture
def consumer_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


async def _cleanup(kind: str, url: str, stream: str) -> None:
    if kind == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        keys = [k async for k in client.scan_iter(match=f"{stream}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    else:
        import nats

        from fastapi_outbox.brokers.nats.wire import stream_name_for

        nc = await nats.connect(url)
        js = nc.jetstream()
        for info in await js.streams_info():
            if info.config.name.startswith(stream_name_for(stream)):
                await js.delete_stream(info.config.name)
        await nc.close()


@pytest.fixture(params=["redis", "nats"])
async def broker_url(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    kind = request.param
    url = str(request.getfixturevalue(f"{kind}_url"))
    stream = unique("ticks")
    yield kind, url, stream
    await _cleanup(kind, url, stream)


async def test_sigkill_mid_handler_every_effect_exactly_once(
    pg_url: str,
    broker_url: tuple[str, str, str],
    consumer_procs: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    kind, url, stream = broker_url
    outbox = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    await outbox.create_tables()
    pg = await asyncpg.connect(pg_url.replace("+asyncpg", ""))
    await pg.execute(
        "CREATE TABLE effects (id serial PRIMARY KEY, n int NOT NULL, message_id text NOT NULL)"
    )
    producer: Broker = broker_from_url(url)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "DATABASE_URL": pg_url,
        "BROKER_URL": url,
        "CONSUMER_STREAM": stream,
        "KILL_DIR": str(tmp_path),
        "KILL_BEFORE_COMMIT": ",".join(map(str, KILL_BEFORE_COMMIT)),
        "KILL_AFTER_COMMIT": ",".join(map(str, KILL_AFTER_COMMIT)),
        "OUTBOX_CONSUMER_CLAIM_IDLE_SECONDS": "1",
        "OUTBOX_CONSUMER_RETRY_BASE_DELAY_SECONDS": "0.05",
        "OUTBOX_CONSUMER_RETRY_MAX_DELAY_SECONDS": "0.5",
        "OUTBOX_CONSUMER_MAX_ATTEMPTS": "10",
        "OUTBOX_SHUTDOWN_TIMEOUT_SECONDS": "3",
        "PYTHONPATH": str(REPO),
    }
    argv = [
        sys.executable,
        "-m",
        "fastapi_outbox",
        "dispatch",
        "--app",
        "tests.acceptance.consumer_app:outbox",
    ]

    def start() -> subprocess.Popen[bytes]:
        with (tmp_path / f"consumer-{len(consumer_procs)}.log").open("wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        consumer_procs.append(proc)
        return proc

    async def effects() -> tuple[int, int]:
        row: Any = await pg.fetchrow("SELECT count(*), count(DISTINCT n) FROM effects")
        return int(row[0]), int(row[1])

    try:
        await producer.connect()
        half = MESSAGES // 2
        assert await producer.publish(envelopes(stream, range(half))) == [None] * half
        proc = start()
        kills = 0
        produced_rest = False
        with anyio.fail_after(BOUND_SECONDS):
            while True:
                rows, distinct = await effects()
                if distinct >= half and not produced_rest:
                    rest = envelopes(stream, range(half, MESSAGES))
                    assert await producer.publish(rest) == [None] * len(rest)
                    produced_rest = True
                if produced_rest and distinct == MESSAGES:
                    break
                if proc.poll() is not None:
                    assert proc.returncode == -signal.SIGKILL, tmp_path / "consumer-0.log"
                    kills += 1
                    proc = start()
                await anyio.sleep(0.05)
            # Let redeliveries of what was in flight at the last kill come and be skipped.
            # The last kill may come after the last commit (between commit and ack), even
            # after the loop saw every effect: a consumer is restarted whenever one died.

            def alive() -> None:
                nonlocal proc, kills
                if proc.poll() is not None:
                    assert proc.returncode == -signal.SIGKILL, tmp_path / "consumer-0.log"
                    kills += 1
                    proc = start()

            await _drained(kind, url, stream, alive)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert kills == len(KILL_BEFORE_COMMIT) + len(KILL_AFTER_COMMIT)
        done = {n for n in os.listdir(tmp_path) if n.startswith(("before-", "after-"))}
        assert done == {f"before-{n}" for n in KILL_BEFORE_COMMIT} | {
            f"after-{n}" for n in KILL_AFTER_COMMIT
        }
        rows, distinct = await effects()
        doubles = await pg.fetch(
            "SELECT n, count(*) FROM effects GROUP BY n HAVING count(*) > 1 ORDER BY n"
        )
        assert doubles == []
        assert (rows, distinct) == (MESSAGES, MESSAGES)
        inbox = await pg.fetchval("SELECT count(*) FROM outbox_inbox WHERE \"group\" = 'effects'")
        assert inbox == MESSAGES
    finally:
        await pg.close()
        await producer.aclose()
        await outbox.aclose()


async def _drained(kind: str, url: str, stream: str, alive: Callable[[], None]) -> None:
    """Until the group has nothing pending (every delivery acknowledged); ``alive`` keeps a
    consumer running meanwhile."""
    from fastapi_outbox.brokers.consumer import ConsumerConfig

    broker = broker_from_url(url)
    consumer = broker.consumer(  # type: ignore[attr-defined]
        ConsumerConfig(stream, "effects", "probe", f"{stream}.effects.dlq", 1.0, 10)
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            alive()
            lag = await consumer.lag()
            if lag.pending == 0 and lag.lag == 0:
                return
            await anyio.sleep(0.1)
        raise AssertionError(f"{kind} group still has pending messages: {lag}")
    finally:
        await broker.aclose()
