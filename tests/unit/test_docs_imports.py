"""What the README, the docs and the examples show a user importing comes from the four
public modules, and only names in their ``__all__``: every other module is internal and may
move."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = (
    "fastapi_outbox",
    "fastapi_outbox.brokers",
    "fastapi_outbox.testing",
    "fastapi_outbox.exceptions",
)
BLOCK = re.compile(r"^[ \t]*```python[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
FROM_LINE = re.compile(
    r"^\s*from\s+(fastapi_outbox[\w.]*)\s+import\b|^\s*import\s+(fastapi_outbox[\w.]*)", re.M
)


def _samples() -> list[tuple[str, str]]:
    found = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for n, block in enumerate(BLOCK.findall(md.read_text()), 1):
            found.append((f"{md.relative_to(ROOT)} block {n}", block))
    for py in sorted((ROOT / "examples").rglob("*.py")):
        found.append((str(py.relative_to(ROOT)), py.read_text()))
    return found


def _imports(source: str) -> list[tuple[str, list[str]]]:
    """(module, names) of each import of the library; names is empty for ``import m``."""
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:  # a fragment: its import lines still name their modules
        return [(a or b, []) for a, b in FROM_LINE.findall(source)]
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastapi_outbox"):
            out.append((node.module or "", [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("fastapi_outbox")]
    return out


def test_samples_are_found() -> None:
    samples = _samples()
    assert len(samples) > 30
    assert any(_imports(code) for _, code in samples)


@pytest.mark.parametrize(("where", "code"), _samples(), ids=lambda v: v if " " not in v else None)
def test_samples_import_only_from_the_public_modules(where: str, code: str) -> None:
    for module, names in _imports(code):
        assert module in PUBLIC, (
            f"{where} imports from the internal module {module}: import it from one of "
            f"{', '.join(PUBLIC)} (export the name there if a user needs it)"
        )
        public = importlib.import_module(module).__all__
        for name in names:
            sub = f"{module}.{name}"
            assert name in public or sub in PUBLIC, (
                f"{where} imports {name} from {module}, which does not list it in __all__"
            )


def test_an_internal_import_is_caught() -> None:
    assert _imports("from fastapi_outbox.consume.subscriber import BatchUnitOfWork\n") == [
        ("fastapi_outbox.consume.subscriber", ["BatchUnitOfWork"])
    ]
    assert _imports("x = (\nfrom fastapi_outbox.ops import y") == [("fastapi_outbox.ops", [])]
