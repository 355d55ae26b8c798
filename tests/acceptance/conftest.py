"""Helpers of the acceptance tests: private broker servers and relay subprocesses.

Crash tests kill processes, so they never touch the shared services' processes: every
broker killed here is a PRIVATE server started on a port of its own (Redis 6390-6399,
NATS 4230-4239) with its data in the test's temporary directory, and every process
started here is stopped in a fixture finalizer.

* :class:`Server`: a broker server we own (start, SIGKILL, restart on the same data).
* :class:`Relays`: ``fastapi-outbox dispatch --app tests.acceptance.crash_app:outbox``
  subprocesses (kill one, restart the dead, stop all).
* :func:`produce`, :func:`wait_drained`, :func:`redis_ids`, :func:`nats_ids`: commit
  messages through ``outbox.unit_of_work()`` and read back what reached the broker.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import pytest

from fastapi_outbox import Message, Outbox
from tests.conftest import wait_until
from tests.servers import answers, free_port, nats_argv, redis_argv

REPO = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.crash_app:outbox"
REDIS_PORTS = range(6390, 6400)
NATS_PORTS = range(4230, 4240)
#: A relay subprocess writes this (INFO log) once its table_relays run.
READY_LINE = b"outbox relays started"


# -- ports and servers ------------------------------------------------------------------------


def wait_for_port(port: int, *, up: bool = True, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while answers(port) != up:
        if time.monotonic() > deadline:
            raise TimeoutError(f"port {port} still {'down' if up else 'up'} after {timeout}s")
        time.sleep(0.02)


class Server:
    """A broker server process of this test: same port and data directory across restarts."""

    def __init__(self, name: str, argv: list[str], port: int, url: str, log: Path) -> None:
        self.name = name
        self.argv = argv
        self.port = port
        self.url = url
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.kills = 0

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for_port(self.port)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final flush."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.kills += 1
        wait_for_port(self.port, up=False)

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its sockets open and answers nothing."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a frozen server cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Server]:
    """A Redis of this test only: AOF with fsync on every write, so a SIGKILL loses
    nothing that was acknowledged."""
    port = free_port(REDIS_PORTS)
    data = tmp_path / "redis"
    data.mkdir()
    argv = redis_argv(port, data, persistent=True)
    server = Server("redis", argv, port, f"redis://127.0.0.1:{port}/0", tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[Server]:
    """A NATS server with JetStream on a file store in the test's directory."""
    port = free_port(NATS_PORTS)
    data = tmp_path / "jetstream"
    data.mkdir()
    argv = nats_argv(port, data)
    server = Server("nats", argv, port, f"nats://127.0.0.1:{port}", tmp_path / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- relay subprocesses ---------------------------------------------------------------


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("fastapi-outbox")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "fastapi_outbox"]


class Relays:
    """``count`` relay processes running ``app`` (default :data:`APP`) with ``env``."""

    def __init__(self, count: int, env: dict[str, str], log_dir: Path, app: str = APP) -> None:
        self.env = env
        self.app = app
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self.logs: list[Path | None] = [None] * count
        self.started = 0
        self.kills = 0
        self.exit_codes: list[int] = []  # of processes that died on their own

    def start(self, index: int) -> None:
        self.started += 1
        name = self.app.split(":")[0].rsplit(".", 1)[-1]
        log_path = self.log_dir / f"{name}-{id(self):x}-{index}-{self.started}.log"
        log: IO[bytes]
        with log_path.open("wb") as log:
            self.procs[index] = subprocess.Popen(
                [*_cli(), "dispatch", "--app", self.app],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.logs[index] = log_path

    def start_all(self) -> None:
        for index in range(len(self.procs)):
            self.start(index)

    def ready(self) -> list[int]:
        """Indexes of running processes whose table_relays have started."""
        out = []
        for index, proc in enumerate(self.procs):
            log = self.logs[index]
            running = proc is not None and proc.poll() is None
            if running and log is not None and READY_LINE in log.read_bytes():
                out.append(index)
        return out

    def wait_ready(self, n: int | None = None, timeout: float = 20.0) -> None:
        want = len(self.procs) if n is None else n
        deadline = time.monotonic() + timeout
        while len(self.ready()) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"relays not ready after {timeout}s: {self.tail()}")
            time.sleep(0.05)

    def kill(self, index: int) -> None:
        proc = self.procs[index]
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        self.kills += 1

    def terminate(self, index: int) -> int:
        """SIGTERM (a normal stop, as Kubernetes sends): the exit code."""
        proc = self.procs[index]
        assert proc is not None
        proc.terminate()
        return proc.wait(20)

    def restart_exited(self) -> None:
        """Start again every process that ended by itself (crash)."""
        for index, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is not None:
                self.exit_codes.append(proc.returncode)
                self.start(index)

    def stop(self) -> None:
        procs = [p for p in self.procs if p is not None and p.poll() is None]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs = [None] * len(self.procs)

    def tail(self, lines: int = 15) -> str:
        """The end of the newest logs, for failure messages."""
        out = []
        for log in self.logs:
            if log is not None and log.exists():
                text = log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)


def dispatcher_env(
    database_url: str, broker_url: str, table: str, **settings: float | str
) -> dict[str, str]:
    """The subprocess environment: this one without OUTBOX_* variables, plus the app's
    URLs and ``settings`` as OUTBOX_<NAME> variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(DATABASE_URL=database_url, BROKER_URL=broker_url, OUTBOX_TABLE_NAME=table)
    for name, value in settings.items():
        env[f"OUTBOX_{name.upper()}"] = str(value)
    return env


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[Callable[..., Relays]]:
    """``relays(count, env, app=APP)`` → :class:`Relays`, all stopped at teardown."""
    made: list[Relays] = []

    def make(count: int, env: dict[str, str], app: str = APP) -> Relays:
        group = Relays(count, env, tmp_path, app)
        made.append(group)
        return group

    yield make
    for group in made:
        group.stop()


# -- producing and checking -------------------------------------------------------------------


async def produce(
    outbox: Outbox,
    stream: str,
    total: int,
    *,
    per_transaction: int = 5,
    producers: int = 3,
    pause: float = 0.0,
    poison_at: int | None = None,
) -> list[str]:
    """Commit ``total`` messages through ``outbox.unit_of_work()`` from ``producers``
    concurrent tasks; returns the committed message ids. Message number ``poison_at``
    carries ``"poison": true``. ``pause`` spreads the commits over time."""
    ids: list[str] = []
    numbers = iter(range(total))

    async def producer() -> None:
        while True:
            batch = [n for _, n in zip(range(per_transaction), numbers, strict=False)]
            if not batch:
                return
            async with outbox.unit_of_work() as uow:
                made = [
                    uow.publish(
                        Message(stream, "Numbered", {"n": n, "poison": n == poison_at}),
                        key=f"k{n % 7}",
                    )
                    for n in batch
                ]
            ids.extend(str(i) for i in made)
            if pause:
                await anyio.sleep(pause)

    async with anyio.create_task_group() as tg:
        for _ in range(producers):
            tg.start_soon(producer)
    assert len(ids) == total
    return ids


async def unfinished(outbox: Outbox) -> int:
    """Rows that still need work: pending, processing or failed."""
    return sum([await outbox.store.messages.count(s) for s in ("pending", "processing", "failed")])


async def wait_drained(outbox: Outbox, timeout: float, describe: Callable[[], str]) -> None:
    async def done() -> bool:
        return await unfinished(outbox) == 0

    try:
        await wait_until(done, timeout=timeout, interval=0.1)
    except TimeoutError:
        pytest.fail(f"{await unfinished(outbox)} rows still unfinished\n{describe()}")


async def redis_ids(url: str, stream: str) -> list[str]:
    """The message ids in a Redis stream, in stream order."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    out: list[str] = []
    try:
        start = "-"
        while True:
            entries = await client.xrange(stream, min=start, count=1000)
            for _entry_id, fields in entries:
                out.append(fields[b"id"].decode())
            if len(entries) < 1000:
                return out
            start = "(" + entries[-1][0].decode()
    finally:
        await client.aclose()


async def nats_ids(url: str, subject: str) -> list[str]:
    """The message ids in the JetStream stream capturing ``subject``, in stream order."""
    import nats
    from nats.js.errors import NotFoundError

    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=5)
    try:
        js = nc.jetstream()
        try:
            name = await js.find_stream_name_by_subject(subject)
        except NotFoundError:  # no stream captures it (yet): nothing was published there
            return []
        info = await js.stream_info(name)
        expected = info.state.messages
        sub = await js.pull_subscribe(subject, stream=name)
        out: list[str] = []
        with anyio.fail_after(20):
            while len(out) < expected:
                for msg in await sub.fetch(batch=500, timeout=5):
                    out.append((msg.headers or {})["message-id"])
                    await msg.ack()
        await sub.unsubscribe()
        return out
    finally:
        await nc.close()


def exactly_once(committed: list[str], delivered: list[str]) -> None:
    """Every committed id delivered once, nothing else delivered."""
    counts = Counter(delivered)
    missing = [i for i in committed if i not in counts]
    duplicated = {i: c for i, c in counts.items() if c > 1}
    unknown = set(counts) - set(committed)
    assert not missing, f"{len(missing)} committed messages missing, e.g. {missing[:3]}"
    assert not duplicated, f"{len(duplicated)} messages duplicated, e.g. {list(duplicated)[:3]}"
    assert not unknown, f"{len(unknown)} unknown messages delivered"
    assert len(delivered) == len(committed)


def new_table() -> str:
    return f"crash_{uuid.uuid4().hex[:8]}"


def chaos_rng() -> random.Random:
    seed = random.randrange(1 << 30)
    print(f"chaos seed {seed}")
    return random.Random(seed)


def tail_of(*parts: Any) -> Callable[[], str]:
    return lambda: "\n".join(p.tail() if hasattr(p, "tail") else str(p) for p in parts)
