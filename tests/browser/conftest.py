"""Browser tests: Playwright (Python) driving Debian's Chromium (``apt-get install
chromium``; never a browser downloaded by Playwright), against the app served by uvicorn on
a free loopback port in the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import REQUIRE

CHROMIUM = os.environ.get("OUTBOX_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def chromium() -> str:
    if not os.path.exists(CHROMIUM):
        message = f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)"
        if REQUIRE:
            pytest.fail(f"{message} and OUTBOX_REQUIRE_SERVICES=1")
        pytest.skip(message)
    return CHROMIUM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def live_server(app: Any, *, root_path: str = "") -> AsyncIterator[str]:
    """Serve ``app`` (its lifespan included) on 127.0.0.1; yields the base URL.
    ``root_path``: uvicorn's ``--root-path``, for an app behind a proxy that strips it."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            lifespan="on",
            log_level="warning",
            root_path=root_path,
        )
    )
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        async with asyncio.timeout(15):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(15):
            await task


@contextlib.asynccontextmanager
async def browser_page(
    executable: str, *, width: int = 1280, height: int = 900
) -> AsyncIterator[Any]:
    """A Chromium page of ``width`` by ``height`` CSS pixels that accepts every confirm()
    dialog."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=executable, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        try:
            page = await browser.new_page(viewport={"width": width, "height": height})
            page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
            yield page
        finally:
            await browser.close()
