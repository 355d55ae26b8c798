"""Clusters: drain and consume on a NATS JetStream cluster and on a Redis Cluster against a
single node of the same server, in one run.

Servers of the run's own on free loopback ports (never the shared ones), started from the
tests' helpers (``tests/servers.py``) and stopped at the end:

* **NATS**: a single nats-server with JetStream (``-js``, a file store) and a three-node
  cluster of the same binary (``tests.servers.PrivateNatsCluster``); on the cluster every
  stream has three replicas (``NatsJetStreamBroker(url, replicas=3)``, the URL listing the
  three nodes comma-separated);
* **Redis**: a single redis-server and a Redis Cluster of six (three masters with a replica
  each, ``tests.servers.PrivateRedisCluster``; ``RedisStreamsBroker("redis+cluster://…")``),
  no persistence on either (no RDB snapshots, no AOF).

Two measurements, each alternating single node and cluster round by round (A B, B A, …),
medians:

* **drain** — ``dispatch.py``'s drain (a backlog inserted in one ``INSERT … SELECT``,
  ``fastapi-outbox dispatch`` processes of ``benchmarks.bench_app`` with the default
  settings, rate = rows / (last ``published_at`` - commit), every message counted in the
  stream afterwards); one group of relay processes per target, all up for the whole
  stage, each draining the rows of its own broker name;
* **consume** — ``consume.py``'s library subscriber (a batch handler writing its effects in
  one array statement, and the per-message ORM handler), from a stream filled beforehand by
  the library's own ``publish``, into PostgreSQL, after a warm-up.

Beside the rates, CPU per message from ``/proc``: of the relay processes (``relay``) or
of this process (the consumer), of the PostgreSQL backends serving the run's database
(``pg``), and of the broker's server processes, summed over the nodes (``broker``).

    python benchmarks/cluster.py                 # drain 30,000 x 3, consume 20,000 x 3 per side
    python benchmarks/cluster.py --quick         # smoke run
    python benchmarks/cluster.py --only drain --processes 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    asyncpg_dsn,
    banner,
    bench_database,
    fmt,
    machine_note,
    median,
    pg_cpu,
    proc_cpu,
    processes,
    table,
    unique,
)
from benchmarks.dispatch import Brokers, Drain, Group, cpu_delta, drain, start_library

#: Loopback ports of this script's servers (the tests use 4330-4359 / 6630-6659).
NATS_PORTS = range(4460, 4490)
NATS_ROUTE_PORTS = range(6760, 6790)
REDIS_PORTS = range(6560, 6580)
#: Each node also needs its port + 10000 (the cluster bus); the tests use 7300-7399.
REDIS_CLUSTER_PORTS = range(7500, 7600)
CONSUME_SIDES = ("library_arrays", "library")
SIDE_LABELS = {
    "library_arrays": "batch handler, arrays",
    "library_insert": "batch handler, insert()",
    "library": "per-message handler, session.add",
}


@dataclass
class Target:
    """One broker deployment under test."""

    name: str  # "NATS 1 node", "NATS 3 nodes (R3)"
    kind: str  # nats | redis
    url: str
    options: dict[str, Any]
    pids: list[int]
    replicas: int = 1
    broker_name: str = field(default="")

    def broker_cpu(self) -> dict[int, float]:
        """CPU seconds used so far by each of the broker's server processes."""
        return {pid: proc_cpu(pid) for pid in self.pids}


def broker_us(
    before: dict[int, float], after: dict[int, float], messages: int
) -> tuple[float, float]:
    """CPU µs per message of the broker's servers: all nodes together, and the busiest node
    (on a single-threaded Redis master or a stream's leader, the one that limits)."""
    spent = [after[pid] - before[pid] for pid in before]
    return 1e6 * sum(spent) / messages, 1e6 * max(spent) / messages


# -- servers ----------------------------------------------------------------------------------


@contextlib.contextmanager
def nats_targets(directory: Path) -> Iterator[list[Target]]:
    """A single JetStream node and a three-node cluster, both private."""
    from tests.servers import PrivateNatsCluster, free_ports, nats_argv

    cluster = PrivateNatsCluster(
        directory / "cluster",
        ports=NATS_PORTS,
        cluster_ports=NATS_ROUTE_PORTS,
        name="outbox_bench",
    )
    single_port = free_ports(NATS_PORTS, 4)[-1]  # the cluster took the first three
    (directory / "single").mkdir(parents=True)
    (directory / "cluster").mkdir(parents=True)
    log = (directory / "single.log").open("wb")
    single = subprocess.Popen(
        nats_argv(single_port, directory / "single"),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        cluster.start()
        asyncio.run(wait_for_jetstream(f"nats://127.0.0.1:{single_port}", 1))
        asyncio.run(wait_for_jetstream(cluster.url, 3))
        yield [
            Target("NATS 1 node", "nats", f"nats://127.0.0.1:{single_port}", {}, [single.pid]),
            Target(
                "NATS 3 nodes, R3",
                "nats",
                cluster.url,
                {"replicas": 3},
                [p.pid for p in cluster.procs.values() if p is not None],
                replicas=3,
            ),
        ]
    finally:
        cluster.stop()
        single.kill()
        single.wait(10)
        log.close()


def redis_cluster_supported() -> bool:
    """The Redis broker takes ``redis+cluster://`` and the tests' helper starts a cluster."""
    try:
        from fastapi_outbox.brokers import broker_from_url
        from tests.servers import PrivateRedisCluster  # noqa: F401

        broker_from_url("redis+cluster://127.0.0.1:1")
    except Exception:
        return False
    return True


@contextlib.contextmanager
def redis_targets(directory: Path) -> Iterator[list[Target]]:
    """A single redis-server and, when the broker supports it, a Redis Cluster of six nodes
    (three masters, a replica each), both private, no persistence (``--save ""``, no AOF)."""
    from tests.servers import free_port, redis_argv

    port = free_port(REDIS_PORTS)
    (directory / "single").mkdir(parents=True)
    log = (directory / "single.log").open("wb")
    single = subprocess.Popen(
        redis_argv(port, directory / "single"),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    cluster: Any = None
    try:
        deadline = time.monotonic() + 15
        from tests.servers import answers

        while not answers(port):
            if time.monotonic() > deadline or single.poll() is not None:
                raise RuntimeError("the private redis-server did not start")
            time.sleep(0.05)
        targets = [Target("Redis 1 node", "redis", f"redis://127.0.0.1:{port}/0", {}, [single.pid])]
        if redis_cluster_supported():
            from tests.servers import PrivateRedisCluster

            (directory / "cluster").mkdir(parents=True)
            cluster = PrivateRedisCluster(directory / "cluster", ports=REDIS_CLUSTER_PORTS)
            cluster.start()
            targets.append(
                Target(
                    "Redis 3+3 nodes",
                    "redis",
                    cluster.url,
                    {},
                    [p.pid for p in cluster.procs.values() if p is not None],
                )
            )
        else:
            print("  (no Redis Cluster: the Redis broker does not take redis+cluster:// here)")
        yield targets
    finally:
        if cluster is not None:
            cluster.stop()
        single.kill()
        single.wait(10)
        log.close()


async def wait_for_jetstream(url: str, replicas: int) -> None:
    """Until the server (cluster: its meta leader) places a stream of ``replicas``."""
    import nats

    deadline = time.monotonic() + 60
    while True:
        try:
            nc = await nats.connect(servers=url.split(","), connect_timeout=2)
            try:
                js = nc.jetstream(timeout=2)
                probe = unique("probe")
                await js.add_stream(name=probe, subjects=[probe], num_replicas=replicas)
                await js.delete_stream(probe)
                return
            finally:
                await nc.close()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


# -- drain ------------------------------------------------------------------------------------


@dataclass
class Row:
    target: str
    what: str  # "drain, 1 process" | consume side
    rate: float
    client_us: float
    pg_us: float
    broker_us: float
    busiest_us: float


async def drain_stage(
    conn: Any, targets: list[Target], nproc: int, args: argparse.Namespace, workdir: Path, db: str
) -> list[Row]:
    from benchmarks.dispatch import TABLE
    from fastapi_outbox.relay.wakeups import channel_name

    channel = channel_name(TABLE)
    rows: list[Row] = []
    brokers = {t.name: Brokers({t.kind: t.url}, replicas=t.replicas) for t in targets}
    try:
        with processes() as procs:
            groups: dict[str, Group] = {}
            for i, t in enumerate(targets):
                await brokers[t.name].connect([t.kind])
                name = f"t{i}"
                env = {"BENCH_BROKER_OPTIONS": json.dumps(t.options)}
                started = start_library(
                    procs, f"{name}_{nproc}p", db, t.url, name, workdir, count=nproc, settings=env
                )
                groups[t.name] = Group(t.name, "library", name, started)
            for t in targets:  # warm-up: connections, prepared statements, stream lookups
                await drain(
                    conn,
                    brokers[t.name],
                    t.kind,
                    groups[t.name],
                    2000,
                    channel,
                    streams=args.streams,
                )
            results: dict[str, list[tuple[Drain, float, float]]] = {t.name: [] for t in targets}
            for r in range(args.rounds):
                for t in targets if r % 2 == 0 else targets[::-1]:
                    before = t.broker_cpu()
                    res = await drain(
                        conn,
                        brokers[t.name],
                        t.kind,
                        groups[t.name],
                        args.backlog,
                        channel,
                        streams=args.streams,
                    )
                    total, busiest = broker_us(before, t.broker_cpu(), res.rows)
                    results[t.name].append((res, total, busiest))
                    print(
                        f"  drain {nproc}p round {r + 1} {t.name:18s} {res.rate:8,.0f} msg/s"
                        f"  relay {res.relay_us:5.1f}  pg {res.pg_us:5.1f}"
                        f"  broker {total:5.1f} (busiest node {busiest:5.1f}) us/msg  {res.check}",
                        flush=True,
                    )
                    if res.check != "ok":
                        raise SystemExit(f"{t.name}: {res.check}")
            for t in targets:
                got = results[t.name]
                rows.append(
                    Row(
                        t.name,
                        f"drain, {nproc} process{'es' if nproc > 1 else ''}",
                        median(d.rate for d, _, _ in got),
                        median(d.relay_us for d, _, _ in got),
                        median(d.pg_us for d, _, _ in got),
                        median(b for _, b, _ in got),
                        median(b for _, _, b in got),
                    )
                )
    finally:
        for b in brokers.values():
            await b.close()
    return rows


# -- consume ----------------------------------------------------------------------------------


async def consume_stage(
    conn: Any, targets: list[Target], args: argparse.Namespace, db: str
) -> list[Row]:
    from benchmarks.consume import cleanup, fill, run_library

    sides = [s for s in args.sides.split(",") if s]
    got: dict[tuple[str, str], list[tuple[float, float, float, float, float]]] = {}
    runs = [(t, side) for side in sides for t in targets]
    for r in range(args.rounds):
        for t, side in runs if r % 2 == 0 else runs[::-1]:
            stream = unique(f"cl_{side}")
            total = args.messages + args.warmup
            await fill(t.url, stream, total, t.options)
            samples: list[tuple[dict[int, float], float]] = []

            async def probe(target: Target = t, into: list[Any] = samples) -> None:
                into.append((await pg_cpu(conn), target.broker_cpu()))

            try:
                rate, cpu = await run_library(
                    db,
                    t.url,
                    stream,
                    total,
                    batch=side.removeprefix("library").strip("_"),
                    warmup=args.warmup,
                    options=t.options,
                    probe=probe,
                )
            finally:
                await cleanup(t.kind, t.url, stream)
            (pg0, b0), (pg1, b1) = samples[0], samples[-1]
            pg_us = 1e6 * cpu_delta(pg0, pg1) / args.messages
            total, busiest = broker_us(b0, b1, args.messages)
            got.setdefault((t.name, side), []).append((rate, cpu, pg_us, total, busiest))
            print(
                f"  consume round {r + 1} {t.name:18s} {side:15s} {rate:8,.0f} msg/s"
                f"  consumer {cpu:5.1f}  pg {pg_us:5.1f}  broker {total:5.1f}"
                f" (busiest node {busiest:5.1f}) us/msg",
                flush=True,
            )
    return [
        Row(
            name,
            f"consume, {SIDE_LABELS.get(side, side)}",
            median(x[0] for x in vals),
            median(x[1] for x in vals),
            median(x[2] for x in vals),
            median(x[3] for x in vals),
            median(x[4] for x in vals),
        )
        for (name, side), vals in got.items()
    ]


# -- main ---------------------------------------------------------------------------------------


def print_rows(rows: list[Row]) -> None:
    banner("medians (ratio: to the single node of the same broker, same row kind)")
    out = []
    for row in rows:
        kind = row.target.split()[0]
        single = next((x for x in rows if x.what == row.what and x.target.split()[0] == kind), row)
        out.append(
            [
                row.what,
                row.target,
                fmt(row.rate),
                f"{row.rate / single.rate:.2f}",
                fmt(row.client_us, 1),
                fmt(row.pg_us, 1),
                fmt(row.broker_us, 1),
                fmt(row.busiest_us, 1),
            ]
        )
    print(
        table(
            [
                *("measure", "broker", "msg/s", "vs 1 node"),
                *("relay/consumer us/msg", "PostgreSQL us/msg", "broker servers us/msg"),
                "busiest node us/msg",
            ],
            out,
        )
    )


async def run(
    by_kind: dict[str, list[Target]], args: argparse.Namespace, workdir: Path
) -> list[Row]:
    import asyncpg

    rows: list[Row] = []
    async with bench_database("bench_cluster") as db_url:
        os.environ["BENCH_DATABASE_URL"] = db_url
        from benchmarks import bench_app

        await bench_app.create_schema()
        await bench_app.outbox.engine.dispose()
        conn = await asyncpg.connect(asyncpg_dsn(db_url))
        try:
            await conn.execute(
                "CREATE TABLE effects (id bigserial PRIMARY KEY, n int NOT NULL, "
                "message_id text NOT NULL)"
            )
            for kind, targets in by_kind.items():
                if "drain" in args.only:
                    for nproc in args.processes:
                        banner(f"{kind}: drain, {nproc} relay process(es) per target")
                        rows += await drain_stage(conn, targets, nproc, args, workdir, db_url)
                if "consume" in args.only:
                    banner(f"{kind}: consume")
                    rows += await consume_stage(conn, targets, args, db_url)
        finally:
            await conn.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run with small sizes")
    p.add_argument("--brokers", nargs="+", choices=["nats", "redis"], default=["nats", "redis"])
    p.add_argument("--only", nargs="+", choices=["drain", "consume"], default=["drain", "consume"])
    p.add_argument("--backlog", type=int, help="drain backlog (default 30,000; quick 5,000)")
    p.add_argument(
        "--streams",
        type=int,
        default=8,
        help="drain: streams the backlog is spread over (default 8: several hash slots and"
        " stream leaders on a cluster)",
    )
    p.add_argument("--processes", type=int, nargs="+", default=[1], help="relays per target")
    p.add_argument("--messages", type=int, help="consume: measured messages (20,000; quick 3,000)")
    p.add_argument("--warmup", type=int, default=2000, help="consume: warm-up messages")
    p.add_argument("--rounds", type=int, help="rounds per target (default 3; quick 1)")
    p.add_argument(
        "--sides",
        default=",".join(CONSUME_SIDES),
        help="consume: library sides of benchmarks/consume.py (library_arrays, library_insert,"
        " library)",
    )
    args = p.parse_args(argv)
    args.backlog = args.backlog or (5_000 if args.quick else 30_000)
    args.messages = args.messages or (3_000 if args.quick else 20_000)
    args.rounds = args.rounds or (1 if args.quick else 3)
    print(f"cluster benchmark; {machine_note()}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench_cluster_"))
    started = time.monotonic()
    rows: list[Row] = []
    try:
        with contextlib.ExitStack() as stack:
            by_kind: dict[str, list[Target]] = {}
            for kind in args.brokers:
                banner(f"{kind}: starting private servers")
                servers = nats_targets if kind == "nats" else redis_targets
                by_kind[kind] = stack.enter_context(servers(workdir / kind))
                for t in by_kind[kind]:
                    print(f"  {t.name}: {t.url}", flush=True)
            rows = asyncio.run(run(by_kind, args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_rows(rows)
    print(f"\nfinished in {time.monotonic() - started:.0f} s; {machine_note()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
