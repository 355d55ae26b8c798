"""What operators and clients send never forges a log line nor answers 500: operator names
and reasons with line breaks, undecodable bytes in the headers the dashboard reads, the
docs' guard samples with a non-ASCII token; and the example prints only a token it made."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Request

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.log import JsonFormatter, TextFormatter
from fastapi_outbox.ops.dashboard import CSRF_HEADER

ROOT = Path(__file__).resolve().parents[3]
FORGED = "alice\n2026-01-01 00:00:00,000 INFO fastapi_outbox.ops operator purge"
#: A line of the text format starts with a date: nothing else may.
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d ")


def lines_of(records: list[logging.LogRecord]) -> tuple[list[str], list[str]]:
    text = "\n".join(TextFormatter().format(r) for r in records).splitlines()
    jsons = "\n".join(JsonFormatter().format(r) for r in records).splitlines()
    return text, jsons


def test_a_line_break_in_a_value_never_makes_a_record_of_its_own() -> None:
    record = logging.LogRecord("fastapi_outbox.ops", logging.INFO, "f", 1, "x", (), None)
    record.__dict__.update(operator=FORGED, reason="a\r\nb\u2028c", action="operator.abandon")
    text, jsons = lines_of([record])
    assert len(text) == 1 and len(jsons) == 1
    assert 'operator="alice\\n2026-01-01' in text[0]  # quoted, escaped, one field
    assert json.loads(jsons[0])["operator"] == FORGED  # JSON keeps it exactly


def test_a_traceback_never_passes_for_a_record() -> None:
    try:
        raise ValueError(FORGED)
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, "f", 1, "failed", (), sys.exc_info())
    text, _ = lines_of([record])
    assert sum(bool(RECORD_START.match(line)) for line in text) == 1


@pytest.mark.postgres(
    reason=(
        "hostile operator input is escaped by the dashboard, not the database: one server suffices"
    )
)
async def test_dashboard_actions_with_hostile_operator_names_and_headers(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    def guard(request: Request) -> None:
        request.state.outbox_operator = request.headers.get("x-user", "")

    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
        dashboard_dependencies=[Depends(guard)],
    )
    await outbox.create_tables()
    async with outbox.unit_of_work() as uow:
        mid = uow.publish(Message("s", "T", {}))
    app = FastAPI()
    app.include_router(outbox.dashboard_router)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            page = await client.get("/outbox/dashboard")
            token = re.search(r'name="outbox-csrf" content="([^"]+)"', page.text)
            assert token is not None
            url = "/outbox/dashboard/api/abandon"
            body = {"ids": [str(mid)], "reason": "because\nINFO forged reason"}
            # Bytes no ASCII token has: refused (403), never a 500.
            for bad in (b"\xc3\xa9" * 22, b"\xff" * 43, token.group(1).encode() + b"\xe9"):
                answer = await client.post(url, json=body, headers=[(CSRF_HEADER.encode(), bad)])
                assert answer.status_code == 403, answer.text
            cookie_jar = dict(client.cookies)
            client.cookies.clear()
            answer = await client.post(
                url,
                json=body,
                headers=[
                    (CSRF_HEADER.encode(), token.group(1).encode()),
                    (b"cookie", b"outbox_dashboard_csrf=\xe9\xe9\xe9"),
                ],
            )
            assert answer.status_code == 403
            client.cookies.update(cookie_jar)
            # A NUL in a filter or an action's text: refused (PostgreSQL stores none), no 500.
            for query in ("stream=a%00b", "key=%00", "type=x%00"):
                answer = await client.get(f"/outbox/dashboard/messages?{query}")
                assert answer.status_code == 400, query
            answer = await client.post(
                "/outbox/dashboard/api/replay",
                json={"all_abandoned": True, "stream": "a\x00b", "count": 1},
                headers={CSRF_HEADER: token.group(1)},
            )
            assert answer.status_code == 422
            with caplog.at_level(logging.INFO, logger="fastapi_outbox"):
                done = await client.post(
                    url,
                    json=body,
                    headers=[
                        (CSRF_HEADER.encode(), token.group(1).encode()),
                        (b"x-user", FORGED.replace("\n", "\r").encode()),
                    ],
                )
            assert done.status_code == 200 and done.json()["changed"] == 1
        audit = [r for r in caplog.records if getattr(r, "action", "") == "operator.abandon"]
        assert audit
        text, jsons = lines_of(audit)
        assert len(text) == len(audit) and len(jsons) == len(audit)
    finally:
        await outbox.aclose()


def _operations_sample() -> str:
    doc = (ROOT / "docs/how-to/operations.md").read_text()
    block = doc.split("<!-- sample: compile -->", 1)[1].split("```python", 1)[1]
    return block.split("```", 1)[0].split("outbox = Outbox(", 1)[0]


async def test_the_docs_guards_refuse_a_non_ascii_token_without_a_500() -> None:
    names: dict[str, Any] = {"ADMIN_PASSWORD": "s3cret", "DASHBOARD_TOKEN": "t0ken"}
    exec(compile(_operations_sample(), "operations.md", "exec"), names)
    app = FastAPI()

    @app.get("/basic", dependencies=[Depends(names["require_admin"])])
    async def basic() -> None: ...

    @app.get("/bearer", dependencies=[Depends(names["require_token"])])
    async def bearer() -> None: ...

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        answer = await client.get("/bearer", headers=[(b"authorization", b"Bearer t0k\xe9n")])
        assert answer.status_code in (401, 403)
        ok = await client.get("/bearer", headers={"authorization": "Bearer t0ken"})
        assert ok.status_code == 200
        answer = await client.get("/basic", auth=("admin", "s3cr\u00e9t"))
        assert answer.status_code in (401, 403)
        assert (await client.get("/basic", auth=("admin", "s3cret"))).status_code == 200


@pytest.mark.parametrize("chosen", [None, "my-own-secret-token-42"])
def test_the_example_prints_only_a_token_it_made(chosen: str | None, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DASHBOARD_TOKEN"}
    env["DATABASE_URL"] = f"sqlite+aiosqlite:///{tmp_path}/orders.db"
    if chosen:
        env["DASHBOARD_TOKEN"] = chosen
    code = (
        "import uvicorn; uvicorn.run = lambda *a, **k: None\n"
        "import runpy; runpy.run_module('examples.orders', run_name='__main__')\n"
        "from examples.orders.app import DASHBOARD_TOKEN; print('TOKEN=' + DASHBOARD_TOKEN)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    shown, _, token = run.stdout.rpartition("TOKEN=")
    if chosen:
        assert chosen not in shown + run.stderr
        assert "the DASHBOARD_TOKEN you set" in shown
    else:
        assert token.strip() in shown  # made up here: printed so the user can sign in
