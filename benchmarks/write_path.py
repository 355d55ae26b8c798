"""Write path: requests/s of the example endpoint with the outbox vs the same endpoint
committing only the business row.

One uvicorn process (1 worker, no access log) serves ``benchmarks.bench_app:app`` on a
database of its own, with relays off (``OUTBOX_RUN_RELAYS=false``) so only the
write path is measured. ``wrk`` (or, without it, an httpx client in another process) loads
``POST /orders`` (outbox: INSERT order, INSERT outbox row, COMMIT) and ``POST /orders-plain``
(INSERT order, COMMIT) in alternating rounds (A B A B …); the tables are truncated before
every round. Medians and the outbox/plain ratio are printed; the goal is a ratio of at least
0.85 (the outbox costs at most 15 % of throughput). Then one more outbox round runs with the
relays on (memory broker, in the API process), for information.

When the ratio is under 0.85 (or with ``--profile always``), the API process is profiled
with py-spy during one more round of each endpoint and the hot spots are printed.

    python benchmarks/write_path.py            # full: 5 rounds of 10 s per endpoint
    python benchmarks/write_path.py --quick    # smoke run: 2 rounds of 3 s
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    Proc,
    asyncpg_dsn,
    banner,
    bench_database,
    fmt,
    load_profile,
    machine_note,
    median,
    package_table,
    percentile,
    proc_cpu,
    processes,
    py_spy,
    start_profile,
    summarize_profile,
    table,
)
from benchmarks._common import (
    pg_cpu as pg_backend_cpu,
)

GOAL_RATIO = 0.85
BODY = {"customer": "ada lovelace", "total": 42.5}


@dataclass
class LoadResult:
    endpoint: str
    rps: float
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    orders: int = 0
    outbox_rows: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# -- load generators ------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text.strip())
    return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")


def run_wrk(url: str, seconds: float, connections: int, workdir: Path) -> dict[str, Any]:
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{json.dumps(BODY)}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    out = subprocess.run(
        [
            *("wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency"),
            *("-s", str(script), url),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
        check=True,
    ).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    p50 = re.search(r"50%\s+(\S+)", out)
    p99 = re.search(r"99%\s+(\S+)", out)
    if not rps or not total:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    errors = int(non2xx.group(1)) if non2xx else 0
    if sock:
        errors += sum(int(g) for g in sock.groups())
    return {
        "rps": float(rps.group(1)),
        "requests": int(total.group(1)),
        "errors": errors,
        "p50_ms": _ms(p50.group(1)) if p50 else float("nan"),
        "p99_ms": _ms(p99.group(1)) if p99 else float("nan"),
    }


def run_httpx_loader(url: str, seconds: float, connections: int, workdir: Path) -> dict[str, Any]:
    """Fallback load generator: this script in ``--_load`` mode, in a process of its own."""
    out = subprocess.run(
        [sys.executable, __file__, "--_load", url, str(seconds), str(connections)],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


async def _httpx_load(url: str, seconds: float, connections: int) -> dict[str, Any]:
    import httpx

    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        start = time.perf_counter()
        deadline = start + seconds

        async def user() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                try:
                    r = await client.post(url, json=BODY)
                    ok = r.status_code == 201
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append((time.perf_counter() - t) * 1000)
                else:
                    errors += 1

        await asyncio.gather(*(user() for _ in range(connections)))
        elapsed = time.perf_counter() - start
    return {
        "rps": len(latencies) / elapsed,
        "requests": len(latencies) + errors,
        "errors": errors,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
    }


# -- the API process ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Variant:
    """One endpoint of one API process."""

    name: str
    proc: Proc
    url: str
    outbox: bool  # the endpoint writes one outbox row per order


def start_api(
    procs: list[Proc], name: str, db_url: str, workdir: Path, env: dict[str, str]
) -> tuple[Proc, str]:
    port = free_port()
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    proc = Proc(
        name,
        [
            *(sys.executable, "-m", "uvicorn", "benchmarks.bench_app:app"),
            *("--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--no-access-log"),
            *("--loop", loop, "--http", http, "--log-level", "info"),
        ],
        env={"BENCH_DATABASE_URL": db_url, "BENCH_BROKER_URL": "memory://", **env},
        logdir=workdir,
    )
    procs.append(proc)
    proc.wait_for("Application startup complete", timeout=60)
    return proc, f"http://127.0.0.1:{port}"


async def reset_tables(conn: Any) -> None:
    await conn.execute("TRUNCATE orders, outbox_messages RESTART IDENTITY")


async def counts(conn: Any) -> tuple[int, int]:
    """Orders and outbox rows, from one statement (one snapshot): a request still in
    flight cannot commit between the two counts."""
    row = await conn.fetchrow(
        "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox_messages)"
    )
    return int(row[0]), int(row[1])


async def settle(conn: Any) -> tuple[int, int]:
    """Wait until the requests still in flight after the load generator stopped have
    committed (the counts stop moving); bounded to 15 s."""
    last = await counts(conn)
    for _ in range(50):
        await asyncio.sleep(0.3)
        now = await counts(conn)
        if now == last:
            return now
        last = now
    return last


async def one_round(
    conn: Any,
    variant: Variant,
    seconds: float,
    args: argparse.Namespace,
    workdir: Path,
    loader: Any,
) -> LoadResult:
    await settle(conn)
    await reset_tables(conn)
    api_cpu = proc_cpu(variant.proc.pid)
    pg_cpu = await pg_backend_cpu(conn)
    raw = await asyncio.to_thread(loader, variant.url, seconds, args.connections, workdir)
    orders, outbox_rows = await settle(conn)
    api_cpu = proc_cpu(variant.proc.pid) - api_cpu
    pg_after = await pg_backend_cpu(conn)
    pg_used = sum(cpu - pg_cpu.get(pid, 0.0) for pid, cpu in pg_after.items())
    res = LoadResult(endpoint=variant.name, **raw, orders=orders, outbox_rows=outbox_rows)
    res.extra["outbox"] = variant.outbox
    res.extra["api_us"] = 1e6 * api_cpu / max(1, orders)
    res.extra["pg_us"] = 1e6 * pg_used / max(1, orders)
    return res


def check(result: LoadResult) -> str:
    """The invariant of each endpoint: one outbox row per order, or none at all."""
    expected = result.orders if result.extra["outbox"] else 0
    ok = result.outbox_rows == expected and result.errors == 0
    return "ok" if ok else f"MISMATCH ({result.outbox_rows} outbox rows, {result.errors} errors)"


async def main(args: argparse.Namespace) -> int:
    import asyncpg

    loader_name = args.loader
    if loader_name == "auto":
        loader_name = "wrk" if shutil.which("wrk") else "httpx"
    loader = run_wrk if loader_name == "wrk" else run_httpx_loader
    print("write path benchmark: outbox endpoint vs plain endpoint (noisy if the machine is busy)")
    print(
        f"  {args.rounds} rounds x {args.seconds:g} s per variant, {args.connections} connections,"
        f" load generator {loader_name}, {machine_note()}"
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench_write_"))
    results: list[LoadResult] = []
    info: list[LoadResult] = []
    profiles: dict[str, tuple[Path, LoadResult]] = {}
    async with bench_database("bench_write") as db_url:
        os.environ["BENCH_DATABASE_URL"] = db_url
        from benchmarks import bench_app

        await bench_app.create_schema()
        await bench_app.outbox.engine.dispose()
        conn = await asyncpg.connect(asyncpg_dsn(db_url))
        try:
            with processes() as procs:
                off = {"OUTBOX_RUN_RELAYS": "false"}
                api, base = start_api(procs, "api", db_url, workdir, off)
                variants = [
                    Variant("outbox", api, base + "/orders", True),
                    Variant("plain", api, base + "/orders-plain", False),
                ]
                if args.notify_variant:
                    # The same outbox endpoint without the after-commit NOTIFY (settings
                    # notify=False): isolates what waking other processes costs.
                    api_nn, base_nn = start_api(
                        procs, "api_nonotify", db_url, workdir, {**off, "OUTBOX_NOTIFY": "false"}
                    )
                    variants.append(
                        Variant("outbox, notify off", api_nn, base_nn + "/orders", True)
                    )
                # Warm-up: imports, pools, statement caches.
                for v in variants:
                    await one_round(conn, v, args.warmup, args, workdir, loader)
                for r in range(args.rounds):
                    for v in variants:
                        res = await one_round(conn, v, args.seconds, args, workdir, loader)
                        results.append(res)
                        print(
                            f"  round {r + 1} {v.name:18s} {res.rps:8,.0f} req/s"
                            f"  p50 {res.p50_ms:6.1f} ms  p99 {res.p99_ms:6.1f} ms"
                            f"  cpu/req api {res.extra['api_us']:5,.0f} us"
                            f" pg {res.extra['pg_us']:5,.0f} us  {check(res)}",
                            flush=True,
                        )
                ratio = ratio_of(results, "outbox", "plain")
                want_profile = args.profile == "always" or (
                    args.profile == "auto" and ratio < GOAL_RATIO
                )
                if want_profile and py_spy() is None:
                    print("  (py-spy not installed: no profile; pip install py-spy)")
                elif want_profile:
                    for v in variants[:2]:
                        out = workdir / f"profile_{v.name}.txt"
                        spy = start_profile(api.pid, args.seconds, out)
                        res = await one_round(conn, v, args.seconds, args, workdir, loader)
                        if spy is not None:
                            spy.wait(args.seconds + 30)
                        res.extra["note"] = "profiled (py-spy attached)"
                        info.append(res)
                        profiles[v.name] = (out, res)
                for v in variants:
                    v.proc.stop()
                # For information: the same endpoint with the relays running in the API
                # process (memory broker): the write path now shares the CPU with the relay.
                api_on, base_on = start_api(
                    procs, "api_on", db_url, workdir, {"OUTBOX_RUN_RELAYS": "true"}
                )
                on = Variant("outbox, relays on", api_on, base_on + "/orders", True)
                await one_round(conn, on, args.warmup, args, workdir, loader)
                res = await one_round(conn, on, args.seconds, args, workdir, loader)
                pending = await conn.fetchval(
                    "SELECT count(*) FROM outbox_messages WHERE status <> 'published'"
                )
                res.extra["note"] = f"memory broker; {pending} rows not yet published at the end"
                info.append(res)
                api_on.stop()
        finally:
            await conn.close()

    names = list(dict.fromkeys(r.endpoint for r in results))
    banner("write path: requests/s per round (A B A B ...)")
    rows = []
    for i, res in enumerate(results):
        rows.append(
            [
                i // len(names) + 1,
                res.endpoint,
                fmt(res.rps),
                fmt(res.p50_ms, 1),
                fmt(res.p99_ms, 1),
                fmt(res.extra["api_us"]),
                fmt(res.extra["pg_us"]),
                fmt(res.orders),
                fmt(res.outbox_rows),
                check(res),
            ]
        )
    headers = ["round", "variant", "req/s", "p50 ms", "p99 ms", "api us/req", "pg us/req"]
    print(table([*headers, "orders", "outbox rows", "check"], rows))
    banner("write path: medians")
    med_rows = []
    for name in names:
        mine = [x for x in results if x.endpoint == name]
        med_rows.append(
            [
                name,
                fmt(median(x.rps for x in mine)),
                fmt(median(x.p50_ms for x in mine), 1),
                fmt(median(x.extra["api_us"] for x in mine)),
                fmt(median(x.extra["pg_us"] for x in mine)),
                f"{ratio_of(results, name, 'plain'):.3f}",
            ]
        )
    print(
        table(
            ["variant", "req/s", "p50 ms", "api cpu us/req", "pg cpu us/req", "vs plain"],
            med_rows,
        )
    )
    ratio = ratio_of(results, "outbox", "plain")
    per_round = [
        a.rps / b.rps
        for a, b in zip(
            [x for x in results if x.endpoint == "outbox"],
            [x for x in results if x.endpoint == "plain"],
            strict=True,
        )
    ]
    verdict = "meets" if ratio >= GOAL_RATIO else "MISSES"
    print(
        f"\noutbox/plain ratio of medians: {ratio:.3f}  ({verdict} the goal >= {GOAL_RATIO}); "
        f"per-round ratios: {', '.join(f'{x:.2f}' for x in per_round)}"
    )
    print(f"outbox cost: {100 * (1 - ratio):.1f} % of throughput")
    if info:
        banner("for information (not in the medians)")
        print(
            table(
                ["variant", "req/s", "p50 ms", "p99 ms", "api us/req", "note"],
                [
                    [
                        x.endpoint,
                        fmt(x.rps),
                        fmt(x.p50_ms, 1),
                        fmt(x.p99_ms, 1),
                        fmt(x.extra["api_us"]),
                        x.extra["note"],
                    ]
                    for x in info
                ],
            )
        )
    if profiles:
        print_profiles(profiles)
    failed = [r for r in results + info if check(r) != "ok"]
    if failed:
        print(f"\n{len(failed)} round(s) failed their check: figures are not trustworthy")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def ratio_of(results: list[LoadResult], a: str, b: str) -> float:
    return median(x.rps for x in results if x.endpoint == a) / median(
        x.rps for x in results if x.endpoint == b
    )


def print_profiles(profiles: dict[str, tuple[Path, LoadResult]]) -> None:
    """API-process CPU per request by package (py-spy shares scaled to the /proc CPU of
    the profiled round), outbox vs plain; then each profile's hot spots."""
    profs = {e: load_profile(p) for e, (p, _) in profiles.items()}
    banner("API-process CPU per request (us) by package: py-spy shares x /proc CPU")
    print(package_table({e: (profs[e], r.extra["api_us"]) for e, (_, r) in profiles.items()}))
    for endpoint, prof in profs.items():
        banner(f"py-spy profile of the API process, {endpoint} endpoint")
        print(summarize_profile(prof))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 3 s")
    p.add_argument("--rounds", type=int, help="rounds per endpoint (default 5, quick 2)")
    p.add_argument("--seconds", type=float, help="seconds per round (default 10, quick 3)")
    p.add_argument("--warmup", type=float, help="warm-up seconds per endpoint (default 3)")
    p.add_argument("--connections", type=int, default=32, help="concurrent HTTP connections")
    p.add_argument("--loader", choices=["auto", "wrk", "httpx"], default="auto")
    p.add_argument(
        "--no-notify-variant",
        dest="notify_variant",
        action="store_false",
        help="skip the third variant (outbox endpoint with OUTBOX_NOTIFY=false)",
    )
    p.add_argument(
        "--profile",
        choices=["auto", "always", "never"],
        default="auto",
        help="py-spy the API process (auto: when the ratio misses the goal)",
    )
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.seconds = args.seconds or (3.0 if args.quick else 10.0)
    args.warmup = args.warmup or (1.0 if args.quick else 3.0)
    return args


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_load":
        result = asyncio.run(_httpx_load(sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
        print(json.dumps(result))
        raise SystemExit(0)
    raise SystemExit(asyncio.run(main(parse_args())))
