"""CloudEvents (``envelope="cloudevents"``): CPU µs per message of writing and reading the
envelope, native against binary and structured mode in the same run, alternating rounds
(native, binary, structured, structured, binary, native, …), medians.

What is measured is the wire code each side runs per message — the part the envelope
changes; the broker's and the database's work are the same bytes give or take the
attributes:

* **publish**: the Redis publisher's entry for one envelope (``redis.wire.entry_values``:
  the CloudEvent's attributes, its headers as JSON, and in structured mode the whole event
  as one JSON document with the payload inside);
* **consume**: the Redis consumer's delivery from that entry (``redis.wire.decode_entry``:
  recognising a CloudEvent, mapping its attributes back to the outbox headers).

    python benchmarks/cloudevents.py            # 7 rounds, 20,000 messages each
    python benchmarks/cloudevents.py --quick

No server is needed. The machine is shared: compare the columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from benchmarks._common import banner, fmt, machine_note, median, table
from fastapi_outbox.brokers.base import Envelope
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions
from fastapi_outbox.brokers.redis import wire
from fastapi_outbox.events import uuid7

MODES: dict[str, CloudEventsOptions | None] = {
    "native": None,
    "binary": CloudEventsOptions("cloudevents", "binary", "/bench"),
    "structured": CloudEventsOptions("cloudevents", "structured", "/bench"),
}


def batch(n: int, size: int) -> list[Envelope]:
    """``n`` envelopes with a JSON payload of about ``size`` bytes and the headers the unit
    of work writes."""
    out = []
    filler = "x" * max(0, size - 40)
    for i in range(n):
        mid = str(uuid7())
        headers = {
            "message-id": mid,
            "type": "OrderPlaced",
            "occurred-at": "2026-11-28T08:00:00+00:00",
            "correlation-id": mid,
        }
        payload = json.dumps({"order_id": i, "note": filler}).encode()
        out.append(Envelope(mid, "orders", "OrderPlaced", str(i % 20), payload, headers))
    return out


def cpu_us_per(n: int, work: Callable[[], Any]) -> float:
    started = time.process_time()
    work()
    return (time.process_time() - started) / n * 1e6


def round_once(mode: str, envelopes: list[Envelope]) -> tuple[float, float]:
    options = MODES[mode]
    entries: list[list[Any]] = []

    def publish() -> None:
        entries.extend(wire.entry_values(e, options) for e in envelopes)

    published = cpu_us_per(len(envelopes), publish)
    # What XREADGROUP hands the consumer: the flat [field, value, …] reply, as bytes.
    replies = [
        [
            b if isinstance(b, bytes) else str(b).encode()
            for pair in zip(wire.PUBLISHED_FIELDS, v, strict=True)
            for b in pair
        ]
        for v in entries
    ]

    def consume() -> None:
        for n, fields in enumerate(replies):
            wire.decode_entry("orders", f"{n}-0".encode(), fields, 1)

    return published, cpu_us_per(len(envelopes), consume)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 5,000 messages")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.messages = 3, 5_000
    banner("CloudEvents envelope: CPU µs per message (Redis wire code)")
    print(machine_note())
    rows = []
    for size in (135, 7_300):
        envelopes = batch(args.messages, size)
        got: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        order = list(MODES)
        for r in range(args.rounds):
            for mode in order if r % 2 == 0 else reversed(order):
                got[mode].append(round_once(mode, envelopes))
        native_pub = median(p for p, _ in got["native"])
        native_con = median(c for _, c in got["native"])
        for mode in MODES:
            pub = median(p for p, _ in got[mode])
            con = median(c for _, c in got[mode])
            rows.append(
                [
                    f"{size:,} B",
                    mode,
                    fmt(pub, 2),
                    f"{pub / native_pub:.2f}",
                    fmt(con, 2),
                    f"{con / native_con:.2f}",
                ]
            )
    print(
        table(
            ["payload", "envelope", "publish µs", "vs native", "consume µs", "vs native"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
