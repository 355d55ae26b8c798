"""The schema on MariaDB: ``db create``, ``doctor``, ``db upgrade`` and ``db sql --dialect
mysql``. MySQL commits each DDL statement on its own: a table half made (a column and an
index missing, as an interrupted run leaves it) is found by ``doctor`` and completed by
``db upgrade``, statement by statement."""

from __future__ import annotations

from urllib.parse import urlparse

import asyncmy

from fastapi_outbox import Outbox
from tests.conftest import run_cli


async def sql(url: str, *statements: str) -> None:
    parsed = urlparse(url.replace("+asyncmy", ""))
    conn = await asyncmy.connect(
        host=parsed.hostname,
        port=parsed.port or 3306,
        user=parsed.username or "root",
        password=parsed.password or "",
        db=parsed.path.lstrip("/"),
    )
    try:
        async with conn.cursor() as cursor:
            for statement in statements:
                await cursor.execute(statement)
    finally:
        conn.close()


def doctor(url: str) -> tuple[int, str]:
    done = run_cli("doctor", "--url", url)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout


async def test_db_create_makes_every_table_and_doctor_finds_them_as_expected(
    mysql_url: str,
) -> None:
    done = run_cli("db", "create", "--url", mysql_url)
    assert done.returncode == 0, done.stdout + done.stderr
    code, out = doctor(mysql_url)
    assert code == 0, out
    assert "MISMATCH" not in out
    # create_tables() again on what db create made: nothing to do, nothing fails.
    outbox = Outbox(mysql_url)
    try:
        await outbox.create_tables()
    finally:
        await outbox.aclose()


async def test_a_half_made_table_is_reported_and_db_upgrade_completes_it(mysql_url: str) -> None:
    assert run_cli("db", "create", "--url", mysql_url).returncode == 0
    await sql(
        mysql_url,
        "DROP INDEX ix_outbox_messages_due_status ON outbox_messages",
        "ALTER TABLE outbox_messages DROP COLUMN abandoned_at",
    )
    code, out = doctor(mysql_url)
    assert code == 1, out
    assert "index ix_outbox_messages_due_status is missing" in out
    assert "column abandoned_at is missing" in out
    upgraded = run_cli("db", "upgrade", "--url", mysql_url)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert doctor(mysql_url)[0] == 0


def test_db_sql_prints_the_mysql_ddl() -> None:
    done = run_cli("db", "sql", "--dialect", "mysql")
    assert done.returncode == 0, done.stderr
    assert "AUTO_INCREMENT UNIQUE" in done.stdout
    assert "CREATE INDEX ix_outbox_messages_due_status" in done.stdout
    assert "WHERE status" not in done.stdout  # no partial index on MySQL
