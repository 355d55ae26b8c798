"""The simplest app does not lose its first messages: its consumer group
exists before its own relay publishes, whatever ``start`` says.

``tests.acceptance.groups_app`` (one Outbox, one subscriber with default options, run by
``fastapi-outbox dispatch``) is started as a subprocess on a fresh stream. Right after each
start the test commits 100 events to the outbox table; four times it SIGKILLs the process
once it has published some of them and starts it again. At the end the 500 events were
handled exactly once: 500 effect rows in PostgreSQL, none twice.
"""

from __future__ import annotations

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

from fastapi_outbox import Message, Outbox, OutboxSettings
from tests.acceptance.test_consumer_kill import _cleanup
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 5
PER_ROUND = 100
BOUND_SECONDS = 100.0
FINAL_WAIT_SECONDS = 40.0


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


@pytest.fixture(params=["redis", "nats"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    kind = request.param
    url = str(request.getfixturevalue(f"{kind}_url"))
    stream = unique("orders")
    yield kind, url, stream
    await _cleanup(kind, url, stream)


async def test_no_message_committed_after_start_is_skipped_across_sigkills(
    pg_url: str,
    broker: tuple[str, str, str],
    procs: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    _kind, url, stream = broker
    producer = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    await producer.create_tables()
    pg = await asyncpg.connect(pg_url.replace("+asyncpg", ""))
    await pg.execute("CREATE TABLE effects (id serial PRIMARY KEY, n int NOT NULL)")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "DATABASE_URL": pg_url,
        "BROKER_URL": url,
        "GROUPS_STREAM": stream,
        # Deliveries and claims of a killed process come back within seconds, not 60/30.
        "OUTBOX_CONSUMER_CLAIM_IDLE_SECONDS": "2",
        "OUTBOX_CONSUMER_RETRY_MAX_DELAY_SECONDS": "0.5",
        "OUTBOX_LEASE_SECONDS": "3",
        "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "1",
        "OUTBOX_SHUTDOWN_TIMEOUT_SECONDS": "3",
        "PYTHONPATH": str(REPO),
    }
    argv = [sys.executable, "-m", "fastapi_outbox", "dispatch"]
    argv += ["--app", "tests.acceptance.groups_app:outbox"]

    def start() -> subprocess.Popen[bytes]:
        with (tmp_path / f"app-{len(procs)}.log").open("wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    async def commit(numbers: range) -> None:
        for chunk in range(numbers.start, numbers.stop, 10):
            async with producer.unit_of_work() as uow:
                for n in range(chunk, min(chunk + 10, numbers.stop)):
                    uow.publish(Message(stream=stream, type="OrderPlaced", payload={"n": n}))

    async def published() -> int:
        table = producer.table.name
        return int(await pg.fetchval(f"SELECT count(*) FROM {table} WHERE status = 'published'"))

    async def effects() -> tuple[int, int]:
        row: Any = await pg.fetchrow("SELECT count(*), count(DISTINCT n) FROM effects")
        return int(row[0]), int(row[1])

    try:
        with anyio.fail_after(BOUND_SECONDS):
            for r in range(ROUNDS):
                proc = start()
                await commit(range(r * PER_ROUND, (r + 1) * PER_ROUND))  # right after start
                if r == ROUNDS - 1:
                    break
                # Killed once this process has published some of its round (mid-flight).
                target = r * PER_ROUND + 1

                async def some_published(target: int = target) -> bool:
                    return await published() >= target

                await wait_until(some_published, timeout=BOUND_SECONDS)
                proc.send_signal(signal.SIGKILL)
                assert proc.wait(timeout=10) == -signal.SIGKILL
            total = ROUNDS * PER_ROUND

            async def all_handled() -> bool:
                assert proc.poll() is None, tmp_path / f"app-{len(procs) - 1}.log"
                return (await effects())[1] == total

            with anyio.move_on_after(FINAL_WAIT_SECONDS):  # then the counts say what is missing
                await wait_until(all_handled, timeout=FINAL_WAIT_SECONDS)
        missing = await pg.fetch(
            "SELECT n FROM generate_series(0, $1 - 1) AS n EXCEPT SELECT n FROM effects ORDER BY n",
            total,
        )
        assert [r["n"] for r in missing] == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        doubles = await pg.fetch("SELECT n, count(*) FROM effects GROUP BY n HAVING count(*) > 1")
        assert doubles == []
        assert await effects() == (total, total)
        inbox = await pg.fetchval(
            f"SELECT count(*) FROM {producer.inbox.table.name} WHERE \"group\" = 'fulfilment'"
        )
        assert inbox == total
    finally:
        await pg.close()
        await producer.aclose()
