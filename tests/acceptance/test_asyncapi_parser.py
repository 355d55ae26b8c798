"""The official AsyncAPI parser (``@asyncapi/parser``, installed from npm by ``npm ci`` in
``tools/asyncapi``) accepts the document of the zoo of events (``tests/asyncapi_zoo.py``) on
every broker and wire form, and the example app's document as the CLI prints it; and refuses
a broken one, so the check can fail. One node process parses every document."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fastapi_outbox.cli import main
from tests.asyncapi_documents import DOCUMENTS
from tests.conftest import REQUIRE, ROOT

TOOL = ROOT / "tools" / "asyncapi"
NODE = shutil.which("node")


def _require_parser() -> str:
    if NODE is None or not (TOOL / "node_modules" / "@asyncapi" / "parser").is_dir():
        message = "the AsyncAPI parser is not installed (cd tools/asyncapi && npm ci)"
        if REQUIRE:
            pytest.fail(f"{message} and OUTBOX_REQUIRE_SERVICES=1")
        pytest.skip(message)
    return NODE


def _cli_document() -> dict[str, Any]:
    """What ``fastapi-outbox asyncapi --app examples.orders.app:outbox`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["asyncapi", "--app", "examples.orders.app:outbox", "--title", "orders"])
    assert code == 0
    return dict(json.loads(out.getvalue()))


def _broken(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with what pydantic writes and AsyncAPI refuses: OpenAPI's discriminator
    object."""
    broken = json.loads(json.dumps(document))
    pet = broken["components"]["schemas"]["Everything"]["properties"]["pet"]
    pet["discriminator"] = {"propertyName": "kind"}
    return dict(broken)


@pytest.fixture(scope="module")
def parsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """name → the parser's verdict (``errors``, ``warnings``) on each document."""
    node = _require_parser()
    folder = tmp_path_factory.mktemp("asyncapi")
    documents = {name: build() for name, build in DOCUMENTS.items()}
    documents["broken"] = _broken(documents["redis-native"])
    documents["example"] = _cli_document()
    files = {}
    for name, document in documents.items():
        files[name] = folder / f"{name}.json"
        files[name].write_text(json.dumps(document))
    run = subprocess.run(
        [node, str(TOOL / "validate.mjs"), *map(str, files.values())],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    verdicts = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    assert len(verdicts) == len(files), run.stderr
    by_file = {Path(v["file"]).stem: v for v in verdicts}
    return {name: by_file[name] for name in documents}


def test_every_zoo_document_is_valid_under_the_official_parser(
    parsed: dict[str, dict[str, Any]],
) -> None:
    errors = {n: v["errors"] for n, v in parsed.items() if n != "broken" and v["errors"]}
    assert errors == {}
    assert set(parsed) >= {"redis-native", "nats-binary", "amqp-structured", "redis-sealed"}


def test_the_example_app_document_printed_by_the_cli_is_valid(
    parsed: dict[str, dict[str, Any]],
) -> None:
    assert parsed["example"]["errors"] == []


def test_the_parser_refuses_pydantic_s_own_discriminator(
    parsed: dict[str, dict[str, Any]],
) -> None:
    messages = " ".join(e["message"] for e in parsed["broken"]["errors"])
    assert '"discriminator" property type must be string' in messages
