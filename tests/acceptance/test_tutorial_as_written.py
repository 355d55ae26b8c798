"""The tutorial as a reader follows it, outside the suite: its blocks saved as ``orders.py``,
``uvicorn orders:app`` started (it prints the dashboard's password, which signs in), an order
placed, the server stopped, then ``pytest orders.py`` under pytest-asyncio's default mode —
which passes although ``orders.db`` now holds the server's rows (the harness's own database)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import anyio
import httpx

from tests.acceptance.test_example_app import free_port
from tests.conftest import wait_until

ROOT = Path(__file__).parents[2]
BLOCK = re.compile(r"^(<!-- sample: \w+ -->\n)?```python\n(.*?)^```$", re.M | re.S)


def _orders_py() -> str:
    text = (ROOT / "docs" / "tutorial.md").read_text()
    return "\n".join(m.group(2) for m in BLOCK.finditer(text) if m.group(1) is None)


async def test_the_tutorial_runs_prints_its_password_and_its_test_passes_after(
    tmp_path: Path,
) -> None:
    (tmp_path / "orders.py").write_text(_orders_py())
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        server = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "uvicorn", "orders:app", "--port", str(port)),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
        )
    try:
        await wait_until(lambda: "Application startup complete" in log.read_text(), timeout=30)
        printed = re.search(r"\(user admin, password (\S+)\)", log.read_text())
        assert printed is not None, log.read_text()
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base) as client:
            placed = await client.post("/orders", json={"customer": "ada", "total": 42})
            assert placed.status_code == 201
            assert (await client.get("/outbox/dashboard")).status_code == 401
            signed_in = await client.get("/outbox/dashboard", auth=("admin", printed.group(1)))
            assert signed_in.status_code == 200
    finally:
        server.terminate()
        async with asyncio.timeout(30):
            await server.wait()
    assert (tmp_path / "orders.db").exists()

    # pytest-asyncio's defaults (strict mode): not this project's pyproject settings.
    run = await anyio.run_process(
        [sys.executable, "-m", "pytest", "orders.py", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTEST_ADDOPTS": "--rootdir=."},
        check=False,
    )
    out = run.stdout.decode(errors="replace")
    assert "1 passed" in out, out[-3000:] + run.stderr.decode(errors="replace")[-2000:]
