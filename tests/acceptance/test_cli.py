"""The ``fastapi-outbox`` command, run as users run it: the installed console script and
``python -m fastapi_outbox``, in subprocesses, against real databases."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process
from sqlalchemy import inspect, select, update
from sqlalchemy.ext.asyncio import create_async_engine

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import unique, wait_until

SCRIPT = [str(Path(sys.executable).parent / "fastapi-outbox")]
MODULE = [sys.executable, "-m", "fastapi_outbox"]
ENTRY_POINTS = pytest.mark.parametrize("cli", [SCRIPT, MODULE], ids=["script", "module"])
PASSWORD = "Pw-cli-93b1e0"


def env(**extra: str) -> dict[str, str]:
    """The environment without any OUTBOX_* variable of the caller."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return {**base, **extra}


async def run(
    cmd: Sequence[str],
    *args: str,
    environ: dict[str, str] | None = None,
    cwd: Path | None = None,
    stderr: Any = subprocess.PIPE,
) -> subprocess.CompletedProcess[bytes]:
    with anyio.fail_after(60):
        return await anyio.run_process(
            [*cmd, *args],
            check=False,
            env=environ if environ is not None else env(),
            cwd=cwd,
            stderr=stderr,
        )


def out(result: subprocess.CompletedProcess[bytes]) -> str:
    return result.stdout.decode() + result.stderr.decode()


async def run_all(*calls: tuple[Any, ...]) -> list[subprocess.CompletedProcess[bytes]]:
    """Run independent CLI invocations concurrently (each ~1 s of interpreter start-up)."""
    results: list[Any] = [None] * len(calls)

    async def one(i: int, call: tuple[Any, ...]) -> None:
        results[i] = await run(*call)

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(one, i, call)
    return results


@pytest.fixture
async def outbox(pg_url: str) -> AsyncIterator[Outbox]:
    box = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    await box.create_tables()
    yield box
    await box.aclose()


async def publish(box: Outbox, stream: str, n: int, *, broker: str | None = None) -> list[Any]:
    async with box.unit_of_work() as uow:
        return [
            uow.publish(
                Message(stream=stream, type="Thing", payload={"i": i, "note": f"n{i}"}),
                broker=broker,
            )
            for i in range(n)
        ]


async def set_status(box: Outbox, ids: list[Any], status: str, **values: Any) -> None:
    t = box.table
    async with box.engine.begin() as conn:
        await conn.execute(update(t).where(t.c.id.in_(ids)).values(status=status, **values))


async def row(box: Outbox, message_id: Any) -> Any:
    t = box.table
    async with box.engine.connect() as conn:
        return (await conn.execute(select(t).where(t.c.id == message_id))).mappings().one()


async def test_db_sql_and_create(pg_url: str, sqlite_url: str) -> None:
    pg_sql, sqlite_sql, created, created_env = await run_all(
        (SCRIPT, "db", "sql"),
        (MODULE, "db", "sql", "--dialect", "sqlite", "--table", "events_out"),
        (SCRIPT, "db", "create", "--url", pg_url),
        (MODULE, "db", "create"),
    )
    assert pg_sql.returncode == 0, out(pg_sql)
    assert "CREATE TABLE outbox_messages" in pg_sql.stdout.decode()
    assert "JSONB" in pg_sql.stdout.decode()
    assert sqlite_sql.returncode == 0, out(sqlite_sql)
    assert "CREATE TABLE events_out" in sqlite_sql.stdout.decode()
    assert created.returncode == 0, out(created)
    assert created_env.returncode == 2  # no database given: usage error
    assert "OUTBOX_DATABASE_URL" in created_env.stderr.decode()

    from_env = await run(MODULE, "db", "create", environ=env(OUTBOX_DATABASE_URL=sqlite_url))
    assert from_env.returncode == 0, out(from_env)
    for url in (pg_url, sqlite_url):
        engine = create_async_engine(url)
        async with engine.connect() as conn:
            names = await conn.run_sync(lambda c: inspect(c).get_table_names())
        await engine.dispose()
        assert "outbox_messages" in names


async def test_status_list_and_show(outbox: Outbox, pg_url: str) -> None:
    orders, audit = unique("orders"), unique("audit")
    box = Outbox(
        pg_url,
        brokers={"default": MemoryBroker(), "audit": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
    )
    try:
        pending = await publish(box, orders, 3)
        abandoned = await publish(box, orders, 2)
        published = await publish(box, audit, 4, broker="audit")
    finally:
        await box.aclose()
    await set_status(outbox, abandoned, "abandoned", attempts=10, last_error="Refused: too big")
    await set_status(outbox, published, "published")

    status_text, status_json, listed, limited, shown = await run_all(
        (SCRIPT, "status", "--url", pg_url),
        (MODULE, "status", "--json", "--url", pg_url),
        (SCRIPT, "list", "--status", "abandoned", "--url", pg_url),
        (MODULE, "list", "--stream", orders, "--limit", "2", "--url", pg_url),
        (SCRIPT, "show", str(pending[0]), "--url", pg_url),
    )
    for result in (status_text, status_json, listed, limited, shown):
        assert result.returncode == 0, out(result)

    counts = {s["broker"]: s for s in json.loads(status_json.stdout)}
    assert counts["default"]["pending"] == 3
    assert counts["default"]["abandoned"] == 2
    assert counts["default"]["oldest_pending_age_seconds"] is not None
    assert counts["audit"]["published"] == 4
    assert counts["audit"]["pending"] == 0

    lines = status_text.stdout.decode().splitlines()
    assert lines[0].split()[:6] == [
        "broker",
        "pending",
        "processing",
        "failed",
        "abandoned",
        "published",
    ]
    default_line = next(line for line in lines if line.startswith("default"))
    assert default_line.split()[1:6] == ["3", "0", "0", "2", "0"]

    text = listed.stdout.decode()
    assert text.splitlines()[0].split()[:6] == [
        "id",
        "broker",
        "stream",
        "type",
        "key",
        "status",
    ]
    assert {str(i) for i in abandoned} <= set(text.split())
    assert not {str(i) for i in pending} & set(text.split())
    assert "Refused: too big" in text
    assert len(limited.stdout.decode().splitlines()) == 1 + 2  # header + limit

    message = json.loads(shown.stdout)
    assert message["id"] == str(pending[0])
    assert message["payload"] == {"i": 0, "note": "n0"}
    assert message["headers"]["message-id"] == str(pending[0])


async def test_replay(outbox: Outbox, pg_url: str) -> None:
    a, b = unique("a"), unique("b")
    one = await publish(outbox, a, 1)
    in_a = await publish(outbox, a, 3)
    in_b = await publish(outbox, b, 2)
    done = await publish(outbox, a, 1)
    await set_status(outbox, one + in_a + in_b, "abandoned", attempts=10, last_error="x")
    await set_status(outbox, done, "published")
    unknown = uuid.uuid4()

    by_id, unknown_id, wrong_status = await run_all(
        (SCRIPT, "replay", str(one[0]), "--url", pg_url),
        (MODULE, "replay", str(unknown), "--url", pg_url),
        (SCRIPT, "replay", str(done[0]), "--url", pg_url),
    )
    assert by_id.returncode == 0, out(by_id)
    assert "replayed 1 message(s)" in by_id.stdout.decode()
    replayed = await row(outbox, one[0])
    assert (replayed["status"], replayed["attempts"], replayed["abandoned_at"]) == (
        "pending",
        0,
        None,
    )
    assert unknown_id.returncode == 1
    assert str(unknown) in unknown_id.stderr.decode()
    assert wrong_status.returncode == 1
    assert f"message {done[0]} is published" in wrong_status.stderr.decode()

    by_stream = await run(MODULE, "replay", "--abandoned", "--stream", a, "--url", pg_url, "--yes")
    assert by_stream.returncode == 0, out(by_stream)
    assert "replayed 3 message(s)" in by_stream.stdout.decode()
    for mid in in_a:
        r = await row(outbox, mid)
        assert (r["status"], r["attempts"]) == ("pending", 0)
    for mid in in_b:
        assert (await row(outbox, mid))["status"] == "abandoned"

    # The rest, with the progress shown as on a terminal (stderr is a pty).
    leader, follower = os.openpty()
    try:
        rest = await run(SCRIPT, "replay", "--abandoned", "--url", pg_url, "--yes", stderr=follower)
        os.close(follower)
        follower = -1
        tty = _read_all(leader)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert rest.returncode == 0
    assert "replayed 2 message(s)" in rest.stdout.decode()
    assert "\rreplayed abandoned: 2/2 (100%)" in tty
    for mid in in_b:
        assert (await row(outbox, mid))["status"] == "pending"


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side is closed and drained
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


async def test_purge_with_progress(outbox: Outbox, pg_url: str) -> None:
    t = outbox.table.name
    async with outbox.engine.begin() as conn:
        await conn.exec_driver_sql(
            f"INSERT INTO {t} (id, broker, stream, type, payload, headers, status, attempts, "
            "next_attempt_at, created_at, published_at, abandoned_at) "
            "SELECT gen_random_uuid(), 'default', 'old', 'Thing', '{}'::jsonb, '{}'::jsonb, "
            "s, 1, now(), now() - interval '9 days', "
            "CASE WHEN s = 'published' THEN now() - interval '8 days' END, "
            "CASE WHEN s = 'abandoned' THEN now() - interval '2 days' END "
            "FROM generate_series(1, 2500), (VALUES ('published'), ('abandoned')) v(s)"
        )
    kept = await publish(outbox, unique("new"), 3)
    a_day_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    await set_status(outbox, kept[:2], "published", published_at=a_day_ago)

    forced, silent = await run_all(
        (
            SCRIPT,
            "purge",
            "--published-older-than",
            "7d",
            "--batch-size",
            "500",
            "--progress",
            "--url",
            pg_url,
        ),
        (
            MODULE,
            "purge",
            "--abandoned-older-than",
            "36h",
            "--batch-size",
            "1000",
            "--no-progress",
            "--url",
            pg_url,
            "--yes",
        ),
    )
    assert forced.returncode == 0, out(forced)
    assert "purged 2500 message(s) (2500 published)" in forced.stdout.decode()
    progress = forced.stderr.decode()
    assert "purged published: 500/2500 (20%)" in progress
    assert "purged published: 2500/2500 (100%)" in progress
    assert silent.returncode == 0, out(silent)
    assert "purged 2500 message(s) (2500 abandoned)" in silent.stdout.decode()
    assert "purged abandoned" not in silent.stderr.decode()

    async with outbox.engine.connect() as conn:
        left = (await conn.exec_driver_sql(f"SELECT id FROM {t}")).scalars().all()
    assert set(left) == set(kept)


async def test_errors_and_exit_codes(outbox: Outbox, pg_url: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    unreachable = f"postgresql+asyncpg://app:{PASSWORD}@127.0.0.1:{port}/app"
    missing = uuid.uuid4()
    bad_duration, unknown_id, down, no_table = await run_all(
        (SCRIPT, "purge", "--published-older-than", "7x", "--url", pg_url),
        (MODULE, "show", str(missing), "--url", pg_url),
        (SCRIPT, "status", "--url", unreachable),
        (MODULE, "list", "--url", pg_url, "--table", "no_such_outbox"),
    )
    assert bad_duration.returncode == 2
    assert "--published-older-than" in bad_duration.stderr.decode()
    assert "'7x'" in bad_duration.stderr.decode()
    assert unknown_id.returncode == 1
    assert f"no outbox message with id {missing}" in unknown_id.stderr.decode()
    assert down.returncode == 3
    assert "unreachable" in down.stderr.decode()
    assert PASSWORD not in out(down)
    assert no_table.returncode == 1
    assert "no_such_outbox" in no_table.stderr.decode()
    assert "table missing" in no_table.stderr.decode()
    assert "db create" in no_table.stderr.decode()
    # (No database at all: exit 2, in test_db_sql_and_create.)


APP_MODULE = """
import os
from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import RedisStreamsBroker

outbox = Outbox(
    os.environ["CLI_TEST_DATABASE_URL"],
    brokers={"default": RedisStreamsBroker(os.environ["CLI_TEST_REDIS_URL"])},
    settings=OutboxSettings(poll_interval_seconds=0.2),
)
"""


class Output:
    """Collects a subprocess's stderr while it runs (so the pipe never fills up)."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self.data = b""

    async def until(self, marker: bytes, timeout: float = 30) -> None:
        assert self.proc.stderr is not None
        with anyio.fail_after(timeout):
            while marker not in self.data:
                self.data += await self.proc.stderr.receive()

    async def rest(self) -> str:
        assert self.proc.stderr is not None
        self.data += b"".join([chunk async for chunk in self.proc.stderr])
        return self.data.decode()


@pytest.mark.redis
async def test_dispatch_publishes_and_exits_on_sigterm(
    outbox: Outbox, pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    """One relay from ``--app`` (console script, JSON logs), one from ``--url`` and
    ``--broker-url`` (``python -m``, its own table): each publishes its rows to Redis and
    exits 0 on SIGTERM."""
    import redis.asyncio as aioredis

    (tmp_path / "cli_app.py").write_text(APP_MODULE)
    by_app, by_url = unique("by_app"), unique("by_url")
    other = Outbox(pg_url, settings=OutboxSettings(table_name="outbox_b", run_relays=False))
    await other.create_tables()
    ids = await publish(outbox, by_app, 3)
    other_ids = await publish(other, by_url, 2)
    client = aioredis.Redis.from_url(redis_url)
    procs: list[Process] = []
    try:
        procs.append(
            await anyio.open_process(
                [*SCRIPT, "--log-format", "json", "dispatch", "--app", "cli_app:outbox"],
                env=env(CLI_TEST_DATABASE_URL=pg_url, CLI_TEST_REDIS_URL=redis_url),
                cwd=tmp_path,
            )
        )
        procs.append(
            await anyio.open_process(
                [*MODULE, "dispatch", "--url", pg_url, "--table", "outbox_b"],
                env=env(OUTBOX_BROKER_URL=redis_url),
                cwd=tmp_path,
            )
        )
        outputs = [Output(p) for p in procs]
        for output in outputs:  # SIGTERM before the handlers exist would kill, not stop
            await output.until(b"outbox relays started")

        async def delivered() -> bool:
            rows = [await row(outbox, i) for i in ids] + [await row(other, i) for i in other_ids]
            return bool(
                await client.xlen(by_app) == 3
                and await client.xlen(by_url) == 2
                and all(r["status"] == "published" for r in rows)
            )

        await wait_until(delivered, timeout=30)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(20):
            codes = [await proc.wait() for proc in procs]
        logs = [await output.rest() for output in outputs]
        assert codes == [0, 0], logs
        records = [json.loads(line) for line in logs[0].splitlines() if line.startswith("{")]
        actions = {r.get("action") for r in records}
        assert {"dispatch.start", "outbox.start", "dispatch.stop"} <= actions
        assert all("ts" in r and "level" in r for r in records)
        assert "action=dispatch.start" in logs[1]  # text format: key=value extras
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await proc.aclose()
        await client.delete(by_app, by_url)
        await client.aclose()
        await other.aclose()


async def test_dispatch_serves_health_for_probes_and_stops_on_sigterm(
    outbox: Outbox, pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    """``dispatch --http HOST:PORT``: a relay-only process answers GET /outbox/health
    (for liveness/readiness probes) while it dispatches, and still exits 0 on SIGTERM."""
    import httpx

    from tests.servers import answers, free_port

    port = free_port(range(18100, 18120))
    stream = unique("probed")
    await publish(outbox, stream, 2)
    proc = await anyio.open_process(
        [*MODULE, "dispatch", "--url", pg_url, "--http", f"127.0.0.1:{port}"],
        env=env(OUTBOX_BROKER_URL=redis_url),
        cwd=tmp_path,
    )
    output = Output(proc)
    try:
        await output.until(b"serving health")
        await wait_until(lambda: answers(port), timeout=10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:

            async def drained() -> bool:
                body = (await http.get("/outbox/health")).json()
                return bool(body["relays"][0]["pending"] == 0)

            await wait_until(drained, timeout=20)
            response = await http.get("/outbox/health")
        assert response.status_code == 200
        body = response.json()
        assert body["relays_running"] is True
        assert body["relays"][0]["running"] is True
        assert await outbox.store.messages.count("published") == 2
        proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(20):
            code = await proc.wait()
        assert code == 0, await output.rest()
        assert not answers(port)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await proc.aclose()


def test_dispatch_http_option_is_validated() -> None:
    result = subprocess.run(
        [*MODULE, "dispatch", "--url", "sqlite+aiosqlite:///x.db", "--http", "nowhere"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--http takes HOST:PORT" in result.stderr


async def test_abandon(outbox: Outbox, pg_url: str) -> None:
    stream = unique("a")
    pending = await publish(outbox, stream, 2)
    done = await publish(outbox, stream, 1)
    await set_status(outbox, done, "published")

    ok, refused = await run_all(
        (SCRIPT, "abandon", str(pending[0]), "--reason", "obsolete", "--url", pg_url),
        (MODULE, "abandon", str(done[0]), str(pending[1]), "--url", pg_url),
    )
    assert ok.returncode == 0, out(ok)
    assert "abandoned 1 message(s)" in ok.stdout.decode()
    first = await row(outbox, pending[0])
    assert first["status"] == "abandoned" and "obsolete" in first["last_error"]
    assert "by cli:" in first["last_error"]  # the operator, as the CLI knows it
    # One published (refused, named), one pending (abandoned): exit 1 for the refusal.
    assert refused.returncode == 1
    assert f"message {done[0]} is published" in refused.stderr.decode()
    assert (await row(outbox, pending[1]))["status"] == "abandoned"
    assert (await row(outbox, done[0]))["status"] == "published"
