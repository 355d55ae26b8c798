"""Admin commands of the CLI: ``status``, ``list``, ``show``, ``replay``, ``purge``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import uuid
from collections.abc import Callable
from typing import Any

from fastapi_outbox.events import MessageStatus

EXIT_OK = 0
EXIT_FAILED = 1

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``15m``, ``12h``, ``7d``, ``2w`` → seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 7d)"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid message id {text!r}: not a UUID") from None


def add_commands(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    status = sub.add_parser("status", help="counts by status and broker, oldest pending age")
    common(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    ls = sub.add_parser("list", help="list messages (no payloads)")
    common(ls)
    ls.add_argument("--status", choices=[s.value for s in MessageStatus])
    ls.add_argument("--stream")
    ls.add_argument("--broker")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--json", action="store_true")

    show = sub.add_parser("show", help="one message with its payload and headers")
    common(show)
    show.add_argument("id", type=parse_uuid)

    replay = sub.add_parser("replay", help="move abandoned messages back to pending")
    common(replay)
    replay.add_argument("ids", nargs="*", type=parse_uuid, metavar="ID")
    replay.add_argument("--abandoned", action="store_true", help="every abandoned message")
    replay.add_argument("--stream", help="with --abandoned: only this stream")

    purge = sub.add_parser("purge", help="delete finished messages in batches")
    common(purge)
    purge.add_argument("--published-older-than", type=parse_duration, metavar="AGE")
    purge.add_argument("--abandoned-older-than", type=parse_duration, metavar="AGE")
    purge.add_argument("--batch-size", type=int, default=5000)


async def run(args: argparse.Namespace, outbox: Any) -> int:
    from fastapi_outbox.cli import CliError, _guard

    command = args.command
    if command == "status":
        stats = await _guard(outbox.store.stats(outbox.all_brokers), outbox)
        rows = [dataclasses.asdict(s) for s in stats.values()]
        if args.json:
            print(json.dumps(rows, indent=2, default=str))
        else:
            print(
                _table(
                    rows,
                    [
                        "broker",
                        "pending",
                        "processing",
                        "failed",
                        "abandoned",
                        "oldest_pending_age_seconds",
                        "published_last_minute",
                    ],
                )
            )
        return EXIT_OK
    if command == "list":
        if args.limit < 1:
            raise CliError("--limit must be at least 1")
        rows = await _guard(
            outbox.store.list_messages(
                status=args.status, stream=args.stream, broker=args.broker, limit=args.limit
            ),
            outbox,
        )
        if args.json:
            print(json.dumps([dict(r) for r in rows], indent=2, default=str))
        else:
            print(
                _table(
                    [dict(r) for r in rows],
                    [
                        "id",
                        "broker",
                        "stream",
                        "type",
                        "key",
                        "status",
                        "attempts",
                        "created_at",
                        "last_error",
                    ],
                )
            )
        return EXIT_OK
    if command == "show":
        row = await _guard(outbox.store.get(args.id), outbox)
        if row is None:
            raise CliError(f"no outbox message with id {args.id}", EXIT_FAILED)
        data = {k: v for k, v in dict(row).items() if k not in ("payload", "headers")}
        data["headers"] = json.loads(row["headers"])
        data["payload"] = json.loads(row["payload"])
        print(json.dumps(data, indent=2, default=str))
        return EXIT_OK
    if command == "replay":
        if not args.ids and not args.abandoned:
            raise CliError("replay needs message ids or --abandoned")
        if args.ids and args.abandoned:
            raise CliError("give message ids or --abandoned, not both")
        if args.stream and not args.abandoned:
            raise CliError("--stream goes with --abandoned")
        if args.ids:
            moved = await _guard(outbox.store.replay(args.ids), outbox)
            missing = set(args.ids) - set(moved)
            for mid in sorted(missing, key=str):
                print(f"not replayed: {mid} (no such message, or not abandoned)", file=sys.stderr)
            print(f"replayed {len(moved)} message(s)")
            return EXIT_FAILED if missing else EXIT_OK
        total = 0
        while True:
            moved = await _guard(outbox.store.replay(stream=args.stream, limit=1000), outbox)
            total += len(moved)
            _progress("replayed", total)
            if len(moved) < 1000:
                break
        _progress_done()
        print(f"replayed {total} message(s)")
        return EXIT_OK
    if command == "purge":
        from fastapi_outbox import retention
        from fastapi_outbox.store import ABANDONED, PUBLISHED

        if args.published_older_than is None and args.abandoned_older_than is None:
            raise CliError("purge needs --published-older-than and/or --abandoned-older-than")
        if args.batch_size < 1:
            raise CliError("--batch-size must be at least 1")
        total = 0
        for status, age in (
            (PUBLISHED, args.published_older_than),
            (ABANDONED, args.abandoned_older_than),
        ):
            if age is None:
                continue
            done = 0

            def tick(n: int, status: str = status) -> None:
                nonlocal done
                done += n
                _progress(f"purged {status}", done)

            total += await _guard(
                retention.purge(
                    outbox.store, status, age, batch_size=args.batch_size, progress=tick
                ),
                outbox,
            )
            _progress_done()
        print(f"purged {total} message(s)")
        return EXIT_OK
    raise CliError(f"unknown command {command!r}")


def _progress(label: str, count: int) -> None:
    if sys.stderr.isatty():
        print(f"\r{label}: {count}", end="", file=sys.stderr, flush=True)


def _progress_done() -> None:
    if sys.stderr.isatty():
        print(file=sys.stderr)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "(none)"

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.1f}"
        text = str(value)
        return text if len(text) <= 60 else text[:57] + "..."

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)
