"""Every Python sample of the README and of docs/ runs, so a sample that stops working fails
the suite.

The convention, for whoever writes a page:

- A page's ```` ```python ```` blocks run in order, in one module per page (a later block sees
  what an earlier one defined), in a temporary working directory. Top-level ``await`` works.
  After the last block, every ``async def test_*`` the page defined is awaited: a page shows
  its own test (the README tests its example with ``OutboxHarness``).
- A page's module is importable as ``app`` while it runs: a test the README tells you to
  save next to its ``app.py`` imports from there (``from app import outbox``).
- A block right after the line ``<!-- sample: compile -->`` is only compiled: a fragment that
  needs names the page does not show, a server, or a file of another project (``env.py``).
- Other languages (``bash``, ``json``, ``sql``, ``text``) are not run.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import inspect
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(
    r"^(?P<marker><!-- sample: (?P<mode>\w+) -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S
)
MODES = {None, "compile"}


def blocks(page: Path) -> list[tuple[int, str | None, str]]:
    text = page.read_text()
    out = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code")) + 1
        out.append((line, match.group("mode"), match.group("code")))
    return out


def test_the_pages_have_samples_and_only_known_markers() -> None:
    found = {page.relative_to(ROOT).as_posix(): blocks(page) for page in PAGES}
    assert len(found["README.md"]) >= 2
    assert len(found["docs/tutorial.md"]) >= 5
    for page, page_blocks in found.items():
        for line, mode, _ in page_blocks:
            assert mode in MODES, f"{page}:{line}: unknown sample marker {mode!r}"
        text = (ROOT / page).read_text()
        stray = re.findall(r"<!-- sample: \w+ -->\n(?!```python)", text)
        assert not stray, f"{page}: a sample marker not followed by a python block"


def _with_samples() -> list[Path]:
    return [page for page in PAGES if blocks(page)]


@pytest.mark.parametrize("page", _with_samples(), ids=lambda p: p.relative_to(ROOT).as_posix())
async def test_samples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name = "docs_sample_" + re.sub(r"\W", "_", page.relative_to(ROOT).as_posix())
    module = types.ModuleType(name)
    module.__file__ = str(tmp_path / f"{name}.py")
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "app", module)
    where = page.relative_to(ROOT).as_posix()
    try:
        await _run_page(page, where, module)
    finally:
        # Engines the samples made are closed, and the page's module let go of, so no
        # connection or Outbox outlives the test.
        from fastapi_outbox import Outbox

        for value in list(vars(module).values()):
            if isinstance(value, Outbox):
                await value.aclose()
        vars(module).clear()
        gc.collect()


async def _run_page(page: Path, where: str, module: types.ModuleType) -> None:
    for line, mode, code in blocks(page):
        # Line numbers in tracebacks are the page's own.
        source = "\n" * (line - 1) + code
        compiled = compile(
            source, f"{where}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
        )
        if mode == "compile":
            continue
        result = eval(compiled, module.__dict__)
        if inspect.isawaitable(result):
            await result
    tests = [
        value
        for key, value in vars(module).items()
        if key.startswith("test_") and inspect.iscoroutinefunction(value)
    ]
    for test in tests:
        await asyncio.wait_for(test(), timeout=60)


def test_the_readme_is_a_front_door_whose_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    # The test command .ci/run runs, exactly as the README shows it.
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv"))
    assert command in readme.splitlines()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
