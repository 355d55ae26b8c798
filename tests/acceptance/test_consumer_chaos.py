"""Chaos for consumers: three consumer processes on Redis and on NATS, 3,000 messages,
consumers SIGKILLed, the broker killed and restarted, PostgreSQL restarted, all during the
run: every effect exactly once, nothing dead-lettered.

Everything that fails here is private to this module (started once, shared by its tests,
stopped at the end): a PostgreSQL cluster (``tests.servers.PrivatePostgres``), a Redis with
AOF (fsync on every write) and a NATS with JetStream on a store directory of its own, on
loopback ports of their own. The shared services on 5432 / 6379 / 4222 are not touched.

The producer is this test: it commits the messages through ``outbox.unit_of_work()`` into
the private PostgreSQL and its own relay (``outbox.relaying()``) publishes them. The
consumers are three ``fastapi-outbox dispatch --app tests.acceptance.consumer_app:outbox``
processes: one ``@outbox.subscriber`` (group ``effects``) adding one ``effects`` row per
message in the handler's transaction (no unique constraint: a double effect shows as two
rows). Their own outbox table is another one, so they consume and do not dispatch.

The run: six rounds of 500 messages. Each round is committed, then, once the consumers
are into it (50 more effect rows), one failure hits while the rest is in flight:

1. consumer 0 SIGKILLed (restarted at once, as a supervisor would);
2. the broker SIGKILLed and started again on its data;
3. consumer 1 SIGKILLed;
4. PostgreSQL stopped (``pg_ctl stop -m fast``: connections cut, new ones told "the
   database system is shutting down", then refused) for longer than the consumers' claim
   idle time (the messages in flight must be kept through it), then started again ("starting
   up", then stale connections in every pool);
5. consumer 2 SIGKILLed;
6. nothing: the last round drains.

Then, with the groups drained (nothing pending or unread): one effect row per committed
message id (none missing, none twice), one inbox row each, the dead-letter stream empty,
no consumer process ended on its own, and no handler failure logged: the handler never
fails on its own, so a failure is the outage charged as an attempt, which the
library forbids (after ``max_attempts`` of them a message is dead-lettered). A failure prints every
figure at once, the errors, and, for missing messages, whether they reached the broker.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import asyncpg
import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.brokers.consumer import ConsumerConfig
from tests.acceptance.conftest import (
    REPO,
    Relays,
    Server,
    dispatcher_env,
    nats_ids,
    redis_ids,
)
from tests.conftest import unique, wait_until
from tests.servers import PrivatePostgres, free_port, nats_argv, redis_argv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres(
        reason="a private PostgreSQL server stopped and started under the consumers"
    ),
]

MESSAGES = 3000
ROUNDS = 6
PER_ROUND = MESSAGES // ROUNDS
PER_TRANSACTION = 50
#: Effect rows of a round awaited before its failure hits (the rest is in flight).
INTO_ROUND = 50
CONSUMERS = 3
#: consumer_app's subscriber.
CONSUMER_APP = "tests.acceptance.consumer_app:outbox"
GROUP = "effects"
#: Outbox table of the consumer processes' own (empty) relays.
CONSUMER_TABLE = "consumer_outbox"
#: Waits on conditions: generous for a loaded 2-core machine, each cut to what is left of
#: ``BUDGET_SECONDS`` (from the test's start), so that a stuck run still ends in the report
#: below, inside pytest's 120 s.
ROUND_TIMEOUT = 30.0
ALL_EFFECTS_TIMEOUT = 45.0
DRAIN_TIMEOUT = 15.0
BUDGET_SECONDS = 95.0
#: PostgreSQL stays down until a consumer logged one of these (it met the outage).
OUTAGE_LINES = ("action=consumer.db_unavailable", "action=consumer.failed")
OUTAGE_NOTICED_TIMEOUT = 15.0
#: The least time PostgreSQL stays down: longer than consumer_claim_idle_seconds, so the
#: messages in flight must be kept (touched) by their consumer through the outage.
OUTAGE_SECONDS = 4.0
#: A consumer's handler failure: the handler here never fails on its own.
HANDLER_FAILED = ("action=consumer.failed",)

PG_PORTS = range(56700, 56800)
REDIS_PORTS = range(6500, 6510)
NATS_PORTS = range(4260, 4270)
PG_OPTIONS = "-c fsync=off -c full_page_writes=off -c max_connections=200"

#: The in-test relay (producer side): quick polls, short leases, short broker backoff.
DISPATCHER_SETTINGS: dict[str, Any] = {
    "lease_seconds": 3,
    "publish_timeout_seconds": 1,
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.5,
    "batch_size": 200,
    "shutdown_timeout_seconds": 3,
}
#: The consumer processes (OUTBOX_* variables): a killed consumer's messages go to another
#: one after 3 s; the other consumer settings are the library's defaults (max_attempts 5).
CONSUMER_SETTINGS: dict[str, Any] = {
    "consumer_claim_idle_seconds": 3,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.5,
    "shutdown_timeout_seconds": 3,
    "poll_interval_seconds": 0.5,
}


# -- private servers, one each for the module --------------------------------------------------


@pytest.fixture(scope="module")
def chaos_pg() -> Iterator[PrivatePostgres]:
    cluster = PrivatePostgres(PG_PORTS, options=PG_OPTIONS)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _server(kind: str, tmp: Path) -> Server:
    data = tmp / "data"
    data.mkdir()
    if kind == "redis":
        port = free_port(REDIS_PORTS)
        argv = redis_argv(port, data, persistent=True)
        url = f"redis://127.0.0.1:{port}/0"
    else:
        port = free_port(NATS_PORTS)
        argv = nats_argv(port, data)
        url = f"nats://127.0.0.1:{port}"
    return Server(kind, argv, port, url, tmp / f"{kind}.log")


@pytest.fixture(scope="module")
def chaos_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Redis with AOF, fsync on every write: a SIGKILL loses nothing acknowledged."""
    server = _server("redis", tmp_path_factory.mktemp("chaos-redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def chaos_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """NATS with JetStream on a file store of its own (``-sd``)."""
    server = _server("nats", tmp_path_factory.mktemp("chaos-nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- the consumer processes ----------------------------------------------------------------


class Consumers(Relays):
    """``fastapi-outbox dispatch --app tests.acceptance.consumer_app:outbox`` processes
    (ready, kill, restart and stop as :class:`Relays`)."""

    def start(self, index: int) -> None:
        self.started += 1
        log_path = self.log_dir / f"consumer-{index}-{self.started}.log"
        with log_path.open("wb") as log:
            self.procs[index] = subprocess.Popen(
                [sys.executable, "-m", "fastapi_outbox", "dispatch", "--app", CONSUMER_APP],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.logs[index] = log_path

    def lines(self, needles: tuple[str, ...]) -> list[str]:
        """Lines containing one of ``needles`` in the logs of every process started."""
        return [
            line
            for log in sorted(self.log_dir.glob("consumer-*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if any(n in line for n in needles)
        ]

    def log_lines(self, needles: tuple[str, ...]) -> int:
        return len(self.lines(needles))


def errors_of(lines: list[str]) -> dict[str, int]:
    """How many of ``lines`` carry each error (the ``error=`` field, ids cut)."""
    return dict(Counter(line.partition(" error=")[2][:120] for line in lines).most_common(5))


@pytest.fixture
def consumers(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Consumers]]:
    made: list[Consumers] = []

    def make(env: dict[str, str]) -> Consumers:
        group = Consumers(CONSUMERS, env, tmp_path)
        made.append(group)
        return group

    yield make
    for group in made:
        group.stop()


# -- the database, seen from the test ------------------------------------------------------


class Database:
    """Queries on the test's database that survive its restart: one connection, opened
    again after it was lost; ``None`` while the server does not answer."""

    def __init__(self, url: str) -> None:
        self.dsn = url.replace("+asyncpg", "")
        self._conn: asyncpg.Connection | None = None

    async def fetch(self, sql: str, *args: Any) -> list[Any] | None:
        try:
            if self._conn is None or self._conn.is_closed():
                with anyio.fail_after(5):
                    self._conn = await asyncpg.connect(self.dsn)
            with anyio.fail_after(10):
                return list(await self._conn.fetch(sql, *args))
        except (
            OSError,
            TimeoutError,
            asyncpg.InterfaceError,
            asyncpg.PostgresConnectionError,
            asyncpg.exceptions.OperatorInterventionError,  # shutting down, starting up
        ):
            await self.close()
            return None

    async def value(self, sql: str, *args: Any) -> Any:
        rows = await self.fetch(sql, *args)
        return None if rows is None else rows[0][0]

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.terminate()


async def new_database(cluster: PrivatePostgres) -> str:
    name = unique("chaos")
    admin = await asyncpg.connect(cluster.url.replace("+asyncpg", ""))
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    return cluster.url.rpartition("/")[0] + f"/{name}"


async def commit_round(outbox: Outbox, db: Database, stream: str, numbers: range) -> list[str]:
    """Commit ``numbers`` in transactions of ``PER_TRANSACTION``. A transaction that fails
    (a connection the PostgreSQL restart left in the pool) is looked up: committed after
    all, or made again."""
    ids: list[str] = []
    for start in range(numbers.start, numbers.stop, PER_TRANSACTION):
        batch = range(start, min(start + PER_TRANSACTION, numbers.stop))
        with anyio.fail_after(ROUND_TIMEOUT):
            while True:
                made: list[str] = []
                try:
                    async with outbox.unit_of_work() as uow:
                        made = [str(uow.publish(Message(stream, "Tick", {"n": n}))) for n in batch]
                    break
                except Exception as exc:
                    print(f"commit of messages {batch.start}-{batch.stop - 1} failed: {exc!r}")
                    found = await db.value(
                        f"SELECT count(*) FROM {outbox.settings.table_name} "
                        "WHERE id::text = ANY($1::text[])",
                        made,
                    )
                    if made and found == len(made):
                        break
                    await anyio.sleep(0.2)
        ids.extend(made)
    return ids


# -- the broker, seen from the test --------------------------------------------------------


class Probe:
    """The group as the library's own consumer sees it (lag, pending, dead letters)."""

    def __init__(self, url: str, stream: str) -> None:
        self.broker = broker_from_url(url)
        dead = f"{stream}.{GROUP}.dlq"
        self.consumer = self.broker.consumer(  # type: ignore[attr-defined]
            ConsumerConfig(stream, GROUP, "chaos-probe", dead, 3.0, 5)
        )

    async def lag(self) -> tuple[int | None, int | None]:
        try:
            with anyio.fail_after(5):
                lag = await self.consumer.lag()
        except Exception:
            return None, None
        return lag.lag, lag.pending

    async def dead_letters(self) -> list[Any]:
        with anyio.fail_after(20):
            return list(await self.consumer.dead_letters(limit=MESSAGES))

    async def aclose(self) -> None:
        await self.broker.aclose()


async def in_stream(kind: str, url: str, stream: str) -> set[str]:
    if kind == "redis":
        return set(await redis_ids(url, stream))
    with anyio.fail_after(30):
        return set(await nats_ids(url, stream))


# -- the test ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["redis", pytest.param("nats", marks=pytest.mark.nats)])
async def test_consumers_chaos_every_effect_exactly_once(
    kind: str,
    chaos_pg: PrivatePostgres,
    consumers: Callable[[dict[str, str]], Consumers],
    request: pytest.FixtureRequest,
) -> None:
    began = time.monotonic()
    broker_server: Server = request.getfixturevalue(f"chaos_{kind}")
    url = await new_database(chaos_pg)
    stream = unique("ticks")
    outbox = Outbox(
        url,
        brokers={"default": broker_from_url(broker_server.url)},
        settings=OutboxSettings(**DISPATCHER_SETTINGS),
    )
    await outbox.create_tables()
    consumer_side = Outbox(url, settings=OutboxSettings(table_name=CONSUMER_TABLE))
    await consumer_side.create_tables()
    await consumer_side.aclose()
    db = Database(url)
    created = await db.fetch(
        "CREATE TABLE effects (id serial PRIMARY KEY, n int NOT NULL, message_id text NOT NULL)"
    )
    assert created is not None
    env = dispatcher_env(url, broker_server.url, CONSUMER_TABLE, **CONSUMER_SETTINGS)
    env.update(CONSUMER_STREAM=stream, PYTHONPATH=str(REPO))
    procs = consumers(env)
    probe = Probe(broker_server.url, stream)

    async def effects() -> int | None:
        return await db.value("SELECT count(DISTINCT message_id) FROM effects")

    async def at_least(n: int) -> bool:
        procs.restart_exited()  # a consumer that died on its own is started again
        count = await effects()
        return count is not None and count >= n

    def kill_consumer(index: int) -> Callable[[], Awaitable[None]]:
        async def act() -> None:
            procs.kill(index)
            procs.start(index)

        return act

    async def restart_broker() -> None:
        await anyio.to_thread.run_sync(broker_server.kill)
        await anyio.to_thread.run_sync(broker_server.start)

    async def restart_postgres() -> None:
        """Down for ``OUTAGE_SECONDS`` at least, and until a consumer has met the outage
        (at most ``OUTAGE_NOTICED_TIMEOUT``)."""
        seen = procs.log_lines(OUTAGE_LINES)
        await anyio.to_thread.run_sync(chaos_pg.shut_down)
        up_at = time.monotonic() + OUTAGE_SECONDS
        try:
            await wait_until(
                lambda: procs.log_lines(OUTAGE_LINES) > seen and time.monotonic() >= up_at,
                timeout=OUTAGE_NOTICED_TIMEOUT,
                interval=0.1,
            )
        except TimeoutError:
            note(f"no consumer met the outage in {OUTAGE_NOTICED_TIMEOUT}s")
        await anyio.to_thread.run_sync(chaos_pg.start_again)

    failures: list[tuple[str, Callable[[], Awaitable[None]] | None]] = [
        ("SIGKILL consumer 0", kill_consumer(0)),
        (f"SIGKILL {kind}, start it again", restart_broker),
        ("SIGKILL consumer 1", kill_consumer(1)),
        ("stop PostgreSQL, start it again", restart_postgres),
        ("SIGKILL consumer 2", kill_consumer(2)),
        ("nothing", None),
    ]
    committed: list[str] = []
    timeline: list[str] = []

    def note(what: str) -> None:
        timeline.append(f"{time.monotonic() - began:6.1f}s {what}")

    def left(timeout: float) -> float:
        return max(1.0, min(timeout, began + BUDGET_SECONDS - time.monotonic()))

    try:
        async with outbox.relaying():
            procs.start_all()
            await anyio.to_thread.run_sync(lambda: procs.wait_ready(timeout=60))
            note("3 consumers ready")
            run_began = time.monotonic()
            for number, (what, act) in enumerate(failures):
                before = await effects() or 0
                numbers = range(number * PER_ROUND, (number + 1) * PER_ROUND)
                committed += await commit_round(outbox, db, stream, numbers)
                try:
                    await wait_until(
                        lambda b=before: at_least(b + INTO_ROUND), timeout=left(ROUND_TIMEOUT)
                    )
                except TimeoutError:
                    note(f"round {number}: consumers not into it after {ROUND_TIMEOUT}s")
                note(f"round {number}: {await effects()} effects; {what}")
                if act is not None:
                    await act()
                    note(f"round {number}: {what} done")
            try:
                await wait_until(lambda: at_least(MESSAGES), timeout=left(ALL_EFFECTS_TIMEOUT))
            except TimeoutError:
                note(f"effects still incomplete after {ALL_EFFECTS_TIMEOUT}s")
            handled_in = time.monotonic() - run_began
            note(f"{await effects()} effects")

            async def drained() -> bool:
                procs.restart_exited()
                return await probe.lag() == (0, 0)

            try:
                await wait_until(drained, timeout=left(DRAIN_TIMEOUT), interval=0.2)
            except TimeoutError:
                note(f"group not drained after {DRAIN_TIMEOUT}s: lag, pending {await probe.lag()}")
            note("drained")

        rows = await db.fetch("SELECT message_id, count(*) FROM effects GROUP BY message_id")
        assert rows is not None
        counts = {r[0]: r[1] for r in rows}
        inbox = await db.value(
            'SELECT count(*) FROM outbox_inbox WHERE "group" = $1 AND message_id = ANY($2)',
            GROUP,
            committed,
        )
        unpublished = await db.value(
            f"SELECT count(*) FROM {outbox.settings.table_name} WHERE status <> 'published'"
        )
        dead = await probe.dead_letters()
        missing = [i for i in committed if i not in counts]
        reached = await in_stream(kind, broker_server.url, stream) if missing else set()
        result = {
            "committed": len(committed),
            "with an effect": sum(1 for i in committed if i in counts),
            "effect twice or more": sum(1 for c in counts.values() if c > 1),
            "effects of unknown ids": len(set(counts) - set(committed)),
            "missing": len(missing),
            "missing, never reached the broker": len([i for i in missing if i not in reached]),
            "inbox rows": inbox,
            "dead letters": len(dead),
            "outbox rows not published": unpublished,
            "consumers ended on their own": len(procs.exit_codes),
            "handler failures logged": procs.log_lines(HANDLER_FAILED),
        }
        expected = {
            "committed": MESSAGES,
            "with an effect": MESSAGES,
            "effect twice or more": 0,
            "effects of unknown ids": 0,
            "missing": 0,
            "missing, never reached the broker": 0,
            "inbox rows": MESSAGES,
            "dead letters": 0,
            "outbox rows not published": 0,
            "consumers ended on their own": 0,
            "handler failures logged": 0,
        }
        errors = sorted({d.error[:160] for d in dead})
        failed = errors_of(procs.lines(HANDLER_FAILED))
        print(f"{kind}: all effects {handled_in:.1f}s after the first commit")
        print("\n".join(timeline))
        print(json.dumps(result, indent=1))
        assert result == expected, (
            f"{kind}: {json.dumps(result)}\ndead-letter errors: {errors[:5]}\n"
            f"consumer exit codes: {procs.exit_codes}\n"
            f"handler failures by error: {failed}\n" + "\n".join(timeline) + "\n" + procs.tail(8)
        )
        assert all(p is None or p.poll() is None for p in procs.procs), (
            "a consumer is not running at the end"
        )
        # A consumer started again in the last round may still be importing (no signal
        # handler yet: SIGTERM would end it with -15); the clean stop is asked of running
        # consumers.
        await anyio.to_thread.run_sync(lambda: procs.wait_ready(timeout=60))
        for proc in procs.procs:
            assert proc is not None
            proc.send_signal(signal.SIGTERM)
        for proc in procs.procs:
            assert proc is not None
            assert proc.wait(15) == 0, procs.tail()
    finally:
        print(f"{kind}: test took {time.monotonic() - began:.1f}s")
        await probe.aclose()
        await db.close()
        await outbox.aclose()
