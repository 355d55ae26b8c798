"""Docstrings cross-reference the way the API reference renders: mkdocstrings' autorefs
(``[`Outbox`][fastapi_outbox.Outbox]``) or plain backticks, never a Sphinx role
(``:class:`Outbox```), which the reference shows as raw text. The strict documentation build
checks the rendered pages too (``docs/hooks.py``, ``on_page_content``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(?:mod|meth|class|func|attr|data|exc|obj):`")


def test_no_docstring_of_the_package_holds_a_sphinx_role() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in sorted((ROOT / "fastapi_outbox").rglob("*.py"))
        for text in [path.read_text()]
        for m in ROLE.finditer(text)
    ]
    assert found == []


def test_the_docs_build_refuses_a_raw_role_in_a_rendered_page() -> None:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    rendered = "<p>See :class:<code>Outbox</code> and <code>:meth:</code></p>"
    assert hooks.RAW_ROLE.findall(rendered) == [":class:"]
    linked = '<p>See <a class="autorefs" href="#fastapi_outbox.Outbox"><code>Outbox</code></a></p>'
    assert hooks.RAW_ROLE.findall(linked) == []
