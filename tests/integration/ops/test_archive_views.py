"""Archived messages (``OutboxSettings(archive=True)``) found by id and listed: ``show`` and
the dashboard's message page fall back to the archive, ``archive list``/``archive show``
read it, and bad ids or filters are refused with the problem named."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import update

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.cli.main import main
from tests.conftest import asgi_client

MARKER = "ARCHIVED-PAYLOAD-7d2e"


def make(url: str, **overrides: Any) -> Outbox:
    settings = OutboxSettings(
        run_relays=False,
        archive=True,
        published_retention_seconds=3600.0,
        **overrides,
    )
    return Outbox(url, brokers={"default": MemoryBroker()}, settings=settings)


async def archive_some(url: str) -> tuple[list[uuid.UUID], uuid.UUID]:
    """Three published messages moved to the archive (two on stream "orders", one on
    "audit"), and one pending message left in the outbox."""
    outbox = make(url)
    try:
        await outbox.create_tables()
        async with outbox.unit_of_work() as uow:
            moved = [
                uow.publish(Message(stream="orders", type="Paid", payload={"m": MARKER})),
                uow.publish(Message(stream="orders", type="Paid", payload={"m": MARKER})),
                uow.publish(Message(stream="audit", type="Seen", payload={"m": MARKER})),
            ]
            pending = uow.publish(Message(stream="orders", type="Paid", payload={"m": 1}))
        t = outbox.table
        old = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
        async with outbox.engine.begin() as conn:
            await conn.execute(
                update(t).where(t.c.id.in_(moved)).values(status="published", published_at=old)
            )
        assert await outbox.cleaner.run_once() == 3
        assert outbox.archive is not None and await outbox.archive.count() == 3
    finally:
        await outbox.aclose()
    return moved, pending


def dashboard_outbox(url: str) -> Outbox:
    """An outbox with an archive and an unguarded dashboard (the tests' app only)."""
    return Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False, archive=True),
        dashboard_dependencies=[],
    )


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_archive_list_show_and_the_show_fallback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/archive.db"
    moved, pending = asyncio.run(archive_some(url))
    monkeypatch.setenv("OUTBOX_ARCHIVE", "1")

    code, out, err = cli(capsys, "archive", "list", "--stream", "orders", "--json", "--url", url)
    assert code == 0, err
    assert {r["id"] for r in json.loads(out)} == {str(i) for i in moved[:2]}
    code, out, err = cli(capsys, "archive", "list", "--type", "Seen", "--since", "1d", "--url", url)
    assert code == 0, err
    assert str(moved[2]) in out and str(moved[0]) not in out

    code, out, err = cli(capsys, "archive", "show", str(moved[0]), "--url", url)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["archived"] is True and shown["payload"] == {"m": MARKER}
    # Plain `show` finds it too (not in the outbox table any more), and still the pending one.
    code, out, err = cli(capsys, "show", str(moved[1]), "--url", url)
    assert code == 0, err
    assert json.loads(out)["archived"] is True
    code, out, err = cli(capsys, "show", str(pending), "--url", url)
    assert code == 0, err
    assert json.loads(out)["archived"] is False

    # Refusals name the problem.
    missing = uuid.uuid4()
    code, _, err = cli(capsys, "archive", "show", str(missing), "--url", url)
    assert code != 0 and f"no archived message with id {missing}" in err
    code, _, err = cli(capsys, "archive", "show", str(pending), "--url", url)
    assert code != 0 and "no archived message" in err  # in the outbox, not the archive
    with pytest.raises(SystemExit):
        cli(capsys, "archive", "show", "not-a-uuid", "--url", url)
    assert "invalid message id 'not-a-uuid'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(capsys, "archive", "list", "--since", "yesterday", "--url", url)
    assert "invalid time 'yesterday'" in capsys.readouterr().err
    code, _, err = cli(capsys, "archive", "list", "--limit", "0", "--url", url)
    assert code != 0 and "--limit" in err
    monkeypatch.delenv("OUTBOX_ARCHIVE")
    code, _, err = cli(capsys, "archive", "list", "--url", url)
    assert code != 0 and "has no archive: set archive=True" in err


async def test_dashboard_message_page_finds_an_archived_message(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/archive.db"
    moved, pending = await archive_some(url)
    outbox = dashboard_outbox(url)
    app = FastAPI()
    app.include_router(outbox.dashboard_router)
    try:
        async with asgi_client(app) as client:
            page = await client.get(f"/outbox/dashboard/messages/{moved[0]}")
            live = await client.get(f"/outbox/dashboard/messages/{pending}")
            missing = await client.get(f"/outbox/dashboard/messages/{uuid.uuid4()}")
    finally:
        await outbox.aclose()
    assert page.status_code == 200
    assert 'class="badge archived">archived</span>' in page.text
    assert MARKER in page.text
    assert 'data-action="replay"' not in page.text  # read-only
    assert live.status_code == 200 and "badge archived" not in live.text
    assert missing.status_code == 404 and "nor in the archive" in missing.text


async def test_dashboard_lists_the_archive_read_only(tmp_path: Path) -> None:
    """``/outbox/dashboard/messages?archived=1``: the archive's messages, filtered and
    newest first, without the bulk actions; a status no archived message has is refused
    with the filter named; an outbox without an archive offers no choice of table."""
    url = f"sqlite+aiosqlite:///{tmp_path}/archive.db"
    moved, pending = await archive_some(url)
    outbox = dashboard_outbox(url)
    plain = Outbox(
        f"sqlite+aiosqlite:///{tmp_path}/plain.db",
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
        dashboard_dependencies=[],
    )
    app, other = FastAPI(), FastAPI()
    app.include_router(outbox.dashboard_router)
    other.include_router(plain.dashboard_router)
    try:
        await plain.create_tables()
        async with asgi_client(app) as client:
            archive = await client.get("/outbox/dashboard/messages", params={"archived": "1"})
            orders = await client.get(
                "/outbox/dashboard/messages", params={"archived": "1", "stream": "orders"}
            )
            live = await client.get("/outbox/dashboard/messages")
            wrong = await client.get(
                "/outbox/dashboard/messages", params={"archived": "1", "status": "pending"}
            )
        async with asgi_client(other) as client:
            without = await client.get("/outbox/dashboard/messages")
            refused = await client.get("/outbox/dashboard/messages", params={"archived": "1"})
    finally:
        await outbox.aclose()
        await plain.aclose()
    assert archive.status_code == 200
    for message_id in moved:
        assert f"/outbox/dashboard/messages/{message_id}" in archive.text
    assert str(pending) not in archive.text
    assert "data-action" not in archive.text  # read-only: no replay or abandon
    assert "<th>Archived</th>" in archive.text
    assert [str(i) in orders.text for i in moved] == [True, True, False]
    assert str(pending) in live.text and str(moved[0]) not in live.text
    assert 'name="archived"' in live.text  # the choice of table
    assert wrong.status_code == 400 and "archived messages are published or abandoned" in wrong.text
    assert 'name="archived"' not in without.text
    assert refused.status_code == 400 and "archive=True" in refused.text
