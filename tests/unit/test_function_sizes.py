"""No function in the library is longer than 100 lines (decorators and docstring counted):
a longer one holds more than one step a reader has to keep in mind at once, and is split
into helpers named after those steps. Every module counts, nothing is exempt."""

from __future__ import annotations

import ast
from pathlib import Path

import fastapi_outbox

PACKAGE = Path(fastapi_outbox.__file__).parent
LIMIT = 100


def long_functions(root: Path, limit: int = LIMIT) -> list[str]:
    """``path:line name (N lines)`` of every function or method under ``root`` longer
    than ``limit`` lines, nested ones included."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - start + 1
            if length > limit:
                where = path.relative_to(root.parent)
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_100_lines() -> None:
    assert long_functions(PACKAGE) == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    # The check itself: a 101-line function (decorator included) is reported, a 100-line
    # one is not, and a method inside a class is seen as well as a nested function.
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(98))
    (package / "a.py").write_text(
        f"@decorator\ndef long():\n{body}\n    return x0\n\n"
        f"def fits():\n{body}\n    return x0\n\n"
        f"class C:\n    async def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
        f"        return 1\n        return 2\n"
    )
    lines = (package / "a.py").read_text().splitlines()
    method = lines.index("    async def method(self):") + 1
    assert long_functions(package) == [
        "pkg/a.py:2 long (101 lines)",
        f"pkg/a.py:{method} method (101 lines)",
    ]
