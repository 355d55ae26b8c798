"""``nox -s perf``: the short ratio benchmarks, each ratio printed against its floor.

Runs, one after the other, each with its library and its hand-written baseline alternating
in the same run (see each script):

* ``producer.py --quick``: a one-event ``unit_of_work()`` and ``Depends(unit_of_work)``
  against a bare ``AsyncSession`` (wall and CPU per transaction; at most 1.1x);
* ``dispatch.py --only drain``: drains of a 20,000-row backlog (``--backlog``) to Redis and
  NATS by the library's relay on default settings and by a hand-written batched
  relay, 1 and 2 processes, 3 alternating rounds (at least 1.2x with 1 process, 1.0x with
  2);
* ``consume.py``: 10,000 messages per round (``--messages``), 2 rounds, Redis, NATS and
  RabbitMQ: the batch handler writing arrays against a raw asyncpg consumer (at least
  0.9x, Redis and NATS) and the per-message ORM handler against a hand-written ORM
  consumer (at least 1.0x).

A few minutes on a quiet 2-core machine. Exit status 1 when a ratio misses its floor. On
a shared machine the figures are noisy: the ratios, not the rates, are what to compare.

    python benchmarks/perf.py
    python benchmarks/perf.py --only producer consume --brokers redis
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import banner, machine_note, table

HERE = Path(__file__).resolve().parent

STEPS = ("producer", "drain", "consume")


def commands(args: argparse.Namespace, ratios: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "producer": [py, str(HERE / "producer.py"), "--quick", "--ratios", ratios],
        "drain": [
            *(py, str(HERE / "dispatch.py"), "--only", "drain", "--rounds", "3"),
            *("--backlog", str(args.backlog), "--profile", "--workers1", "--ratios", ratios),
            *("--brokers", *[b for b in args.brokers if b != "rabbitmq"]),
        ],
        "consume": [
            *(py, str(HERE / "consume.py"), "--rounds", "2", "--messages", str(args.messages)),
            *("--warmup", "2000", "--brokers", ",".join(args.brokers), "--ratios", ratios),
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument(
        "--brokers", nargs="+", choices=["redis", "nats", "rabbitmq"],
        default=["redis", "nats", "rabbitmq"],
    )  # fmt: skip
    parser.add_argument("--backlog", type=int, default=20_000, help="drain backlog")
    parser.add_argument("--messages", type=int, default=10_000, help="consume: per round")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as ratios:
        failed = []
        for step, command in commands(args, ratios.name).items():
            if step not in args.only:
                continue
            banner(f"perf: {step}")
            print("$ " + " ".join(command[1:]), flush=True)
            if subprocess.run(command, check=False).returncode != 0:
                failed.append(step)
        measured = [json.loads(line) for line in Path(ratios.name).read_text().splitlines()]
    banner("perf: every ratio against its floor")
    rows, missed = [], 0
    for m in measured:
        ok = m["ratio"] <= m["floor"] if m["most"] else m["ratio"] >= m["floor"]
        missed += not ok
        bound = f"<= {m['floor']}" if m["most"] else f">= {m['floor']}"
        rows.append([m["what"], f"{m['ratio']:.2f}", bound, "ok" if ok else "MISSES"])
    print(table(["ratio (library / hand-written)", "measured", "floor", ""], rows))
    print(f"\n{len(measured)} ratios, {missed} missed; {time.monotonic() - started:.0f} s; "
          f"{machine_note()}")  # fmt: skip
    if failed:
        print(f"steps that failed: {', '.join(failed)}")
    return 1 if missed or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
