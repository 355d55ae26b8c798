"""The CLI on a multi-tenant outbox: every command works on the tenant ``--tenant`` names
and sees no other tenant's messages; ``--tenant all`` for the schema commands."""

import uuid
from pathlib import Path

import anyio
import pytest

from fastapi_outbox import Message
from fastapi_outbox.cli.main import main
from tests.integration.ops.tenants_cli_app import make

APP = "tests.integration.ops.tenants_cli_app:make"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main([*args, "--app", APP])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def publish(tenant: str) -> uuid.UUID:
    outbox = make()
    try:
        async with outbox.unit_of_work(tenant=tenant) as uow:
            return uow.publish(Message("orders", "OrderPlaced", {"tenant": tenant}))
    finally:
        await outbox.aclose()


def test_each_command_sees_its_tenant_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANTS_DIR", str(tmp_path))
    code, out, _ = cli(capsys, "db", "create", "--tenant", "all")
    assert code == 0 and "== tenant acme" in out and "== tenant globex" in out
    acme, globex = anyio.run(publish, "acme"), anyio.run(publish, "globex")

    code, out, _ = cli(capsys, "list", "--tenant", "acme")
    assert code == 0 and str(acme) in out and str(globex) not in out
    code, _, err = cli(capsys, "show", str(acme), "--tenant", "globex")
    assert code == 1, err
    code, out, _ = cli(capsys, "abandon", str(acme), "--tenant", "acme", "--yes")
    assert code == 0, out
    code, out, err = cli(capsys, "replay", str(acme), "--tenant", "globex", "--yes")
    assert code == 1 and "replayed 0 message(s)" in out, (out, err)  # not globex's message
    code, out, _ = cli(capsys, "replay", str(acme), "--tenant", "acme", "--yes")
    assert code == 0 and "replayed 1 message(s)" in out, out
    code, out, _ = cli(capsys, "status", "--tenant", "globex", "--json")
    assert code == 0 and '"pending": 1' in out.replace('"pending":1', '"pending": 1')

    code, _, err = cli(capsys, "list")
    assert code == 2 and "--tenant ID" in err
    code, _, err = cli(capsys, "list", "--tenant", "all")
    assert code == 2 and "only for db create" in err
    code, _, err = cli(capsys, "list", "--tenant", "initech")
    assert code == 2 and "unknown tenant 'initech'" in err
    code, out, _ = cli(capsys, "doctor", "--tenant", "all")
    assert code == 0 and out.count("matches the expected layout") == 2
