"""Destructive commands ask first: ``purge`` of abandoned rows, ``replay
--abandoned`` and a bulk ``cancel`` show the count and the redacted target, need ``--yes``
(or a ``y`` typed on a terminal), and ``--dry-run`` changes nothing. Id lists go in pages:
40,000 ids on PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.ops import operations

MODULE = [sys.executable, "-m", "fastapi_outbox"]
PASSWORD = "Pw-destructive-5e81"


def with_password(url: str) -> str:
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


async def cli(
    *args: str, database: str, stdin: Any = subprocess.DEVNULL
) -> subprocess.CompletedProcess[bytes]:
    """``python -m fastapi_outbox ARGS`` with the database from OUTBOX_DATABASE_URL (as an
    operator's shell has it: the output must say which database it is)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    environ["OUTBOX_DATABASE_URL"] = database
    with anyio.fail_after(120):
        return await anyio.run_process([*MODULE, *args], check=False, env=environ, stdin=stdin)


async def tty_cli(*args: str, database: str, answer: str) -> subprocess.CompletedProcess[bytes]:
    """The command with a terminal on stdin, on which the operator types ``answer``."""
    leader, follower = os.openpty()
    try:
        os.write(leader, answer.encode() + b"\n")
        return await cli(*args, database=database, stdin=follower)
    finally:
        os.close(follower)
        os.close(leader)


@pytest.fixture
async def outbox(pg_url: str) -> AsyncIterator[Outbox]:
    box = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    await box.create_tables()
    yield box
    await box.aclose()


async def insert(outbox: Outbox, n: int, status: str, stream: str = "orders") -> list[uuid.UUID]:
    t = outbox.table.name
    async with outbox.engine.begin() as conn:
        result = await conn.exec_driver_sql(
            f"INSERT INTO {t} (id, broker, stream, type, payload, headers, status, attempts, "
            "next_attempt_at, created_at, abandoned_at) "
            f"SELECT gen_random_uuid(), 'default', '{stream}', 'Thing', '{{}}'::jsonb, "
            f"'{{}}'::jsonb, '{status}', 1, now(), now() - interval '3 days', "
            f"CASE WHEN '{status}' = 'abandoned' THEN now() - interval '2 days' END "
            f"FROM generate_series(1, {n}) RETURNING id"
        )
        return list(result.scalars().all())


async def count(outbox: Outbox, status: str) -> int:
    t = outbox.table
    async with outbox.engine.connect() as conn:
        stmt = select(func.count()).select_from(t).where(t.c.status == status)
        return int((await conn.execute(stmt)).scalar_one())


def text(result: subprocess.CompletedProcess[bytes]) -> str:
    return result.stdout.decode() + result.stderr.decode()


async def test_purge_of_abandoned_rows_asks_first(outbox: Outbox, pg_url: str) -> None:
    await insert(outbox, 30, "abandoned")
    database = with_password(pg_url)
    where = pg_url.replace("postgres@", "postgres:***@", 1)
    purge = ("purge", "--abandoned-older-than", "0", "--no-progress")

    refused = await cli(*purge, database=database)  # stdin is not a terminal, no --yes
    assert refused.returncode == 2, text(refused)
    assert "30 abandoned message(s)" in refused.stdout.decode()
    assert f"table {outbox.table.name} on {where}" in refused.stdout.decode()
    assert "--yes" in refused.stderr.decode() and "nothing changed" in refused.stderr.decode()
    dry = await cli(*purge, "--dry-run", database=database)
    assert dry.returncode == 0, text(dry)
    assert "30 abandoned message(s)" in dry.stdout.decode()
    assert "dry run: nothing changed" in dry.stdout.decode()
    declined = await tty_cli(*purge, database=database, answer="n")
    assert declined.returncode == 1, text(declined)
    assert "not confirmed" in declined.stderr.decode()
    for result in (refused, dry, declined):
        assert PASSWORD not in text(result)
    assert await count(outbox, "abandoned") == 30

    typed = await tty_cli(*purge, database=database, answer="y")
    assert typed.returncode == 0, text(typed)
    assert "purged 30 message(s) (30 abandoned)" in typed.stdout.decode()
    assert await count(outbox, "abandoned") == 0
    await insert(outbox, 4, "abandoned")
    forced = await cli(*purge, "--yes", database=database)
    assert forced.returncode == 0 and "purged 4 message(s)" in forced.stdout.decode()
    assert PASSWORD not in text(typed) + text(forced)


async def test_replay_abandoned_and_bulk_cancel_ask_first(outbox: Outbox, pg_url: str) -> None:
    await insert(outbox, 12, "abandoned")
    pending = await insert(outbox, 3, "pending")
    database = with_password(pg_url)

    refused = await cli("replay", "--abandoned", database=database)
    assert refused.returncode == 2, text(refused)
    assert "12 abandoned message(s)" in refused.stdout.decode()
    dry = await cli("replay", "--abandoned", "--dry-run", database=database)
    assert dry.returncode == 0 and "dry run: nothing changed" in dry.stdout.decode()
    assert await count(outbox, "abandoned") == 12
    done = await cli("replay", "--abandoned", "--yes", "--no-progress", database=database)
    assert done.returncode == 0, text(done)
    assert "replayed 12 message(s)" in done.stdout.decode()
    assert await count(outbox, "abandoned") == 0

    ids = [str(i) for i in pending[:2]]
    refused = await cli("cancel", *ids, database=database)
    assert refused.returncode == 2, text(refused)
    assert "2 of 2 message(s) are pending and would be deleted" in refused.stdout.decode()
    dry = await cli("cancel", *ids, "--dry-run", database=database)
    assert dry.returncode == 0 and "2 of 2 message(s) would be cancelled" in dry.stdout.decode()
    assert await count(outbox, "pending") == 15
    cancelled = await cli("cancel", *ids, "--yes", database=database)
    assert cancelled.returncode == 0 and "cancelled 2 message(s)" in cancelled.stdout.decode()
    assert await count(outbox, "pending") == 13
    for result in (refused, dry, cancelled, done):
        assert PASSWORD not in text(result)

    # --dry-run of the commands that need no confirmation: nothing changes either.
    last, unknown = str(pending[2]), str(uuid.uuid4())
    abandon = await cli("abandon", last, "--dry-run", database=database)
    assert abandon.returncode == 0, text(abandon)
    assert "abandon: 1 of 1 message(s) would be abandoned" in abandon.stdout.decode()
    replay = await cli("replay", last, unknown, "--dry-run", database=database)
    assert replay.returncode == 0, text(replay)
    assert "replay: 0 of 2 message(s) would be replayed" in replay.stdout.decode()
    assert f"message {last} is pending" in replay.stdout.decode()
    assert f"no outbox message with id {unknown}" in replay.stdout.decode()
    assert await count(outbox, "pending") == 13


async def test_forty_thousand_ids_go_in_pages(outbox: Outbox, pg_url: str, tmp_path: Path) -> None:
    """asyncpg takes at most 32,767 bind parameters per statement: one IN list of 40,000
    ids failed, and the refusals cost one SELECT per id. Pages of ID_PAGE_SIZE now."""
    ids = await insert(outbox, 40_000, "abandoned")
    unknown = [uuid.uuid4() for _ in range(3)]
    dry = await operations.replay(outbox, ids + unknown, dry_run=True)
    assert (dry.count, len(dry.problems)) == (40_000, 3)
    assert await count(outbox, "abandoned") == 40_000

    listing = tmp_path / "ids.txt"
    listing.write_text("# to replay\n" + "\n".join(str(i) for i in ids + unknown) + "\n")
    replayed = await cli("replay", "--ids-from", str(listing), database=pg_url)
    assert replayed.returncode == 1, text(replayed)  # the three unknown ids
    assert "replayed 40000 message(s)" in replayed.stdout.decode()
    assert all(f"no outbox message with id {u}" in replayed.stderr.decode() for u in unknown)
    assert await count(outbox, "pending") == 40_000

    stopped = await operations.abandon(outbox, ids[:35_000], operator="test")
    assert stopped.count == 35_000 and not stopped.problems
    cancelled = await operations.cancel(outbox, ids, operator="test")
    assert cancelled.count == 5_000 and len(cancelled.problems) == 35_000
    assert "is abandoned" in cancelled.problems[0]
    with pytest.raises(operations.exceptions.OperationError, match="at most 100000"):
        await operations.replay(outbox, [uuid.uuid4() for _ in range(operations.MAX_IDS + 1)])
