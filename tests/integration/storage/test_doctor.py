"""``fastapi-outbox doctor``: the live table against the expected layout, with the SQL that
fixes each difference; exit code 1 on a mismatch, 0 when the table is as expected."""

from __future__ import annotations

import asyncpg
import pytest

from tests.conftest import run_cli

PARTITIONED = {"OUTBOX_PARTITIONING": "daily"}


async def sql(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url.replace("+asyncpg", ""))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def doctor(url: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    done = run_cli("doctor", "--url", url, env=env)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout


def create(url: str, env: dict[str, str] | None = None) -> None:
    done = run_cli("db", "create", "--url", url, env=env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("env", [None, PARTITIONED], ids=["plain", "partitioned"])
def test_a_table_made_by_db_create_is_fine(pg_url: str, env: dict[str, str] | None) -> None:
    create(pg_url, env)
    code, out = doctor(pg_url, env)
    assert code == 0, out
    assert "matches the expected layout" in out and "MISMATCH" not in out


async def test_a_missing_index_is_reported_with_its_create_statement(pg_url: str) -> None:
    create(pg_url)
    await sql(pg_url, "DROP INDEX ix_outbox_messages_due")
    code, out = doctor(pg_url)
    assert code == 1
    assert "MISMATCH: index ix_outbox_messages_due is missing" in out
    assert (
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_outbox_messages_due ON outbox_messages "
        "(broker, next_attempt_at, id) WHERE status IN ('pending', 'processing', 'failed');"
    ) in out
    assert out.count("MISMATCH") == 1
    # The printed fix works, and the table is fine afterwards.
    upgraded = run_cli("db", "upgrade", "--url", pg_url)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert doctor(pg_url)[0] == 0


async def test_an_index_with_another_predicate_is_reported(pg_url: str) -> None:
    create(pg_url)
    await sql(
        pg_url,
        "DROP INDEX ix_outbox_messages_due",
        "CREATE INDEX ix_outbox_messages_due ON outbox_messages (broker, next_attempt_at, id) "
        "WHERE status = 'pending'",
    )
    code, out = doctor(pg_url)
    assert code == 1 and "MISMATCH: index ix_outbox_messages_due is USING btree" in out
    # The fix builds the right index under another name, then swaps it in.
    upgraded = run_cli("db", "upgrade", "--url", pg_url)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert doctor(pg_url)[0] == 0


async def test_a_wrong_column_type_is_reported_and_left_to_the_operator(pg_url: str) -> None:
    create(pg_url)
    await sql(pg_url, "ALTER TABLE outbox_messages ALTER COLUMN payload TYPE text")
    code, out = doctor(pg_url)
    assert code == 1
    assert "MISMATCH: column payload is text, expected jsonb" in out
    assert 'ALTER TABLE "outbox_messages" ALTER COLUMN "payload" TYPE jsonb' in out
    upgraded = run_cli("db", "upgrade", "--url", pg_url)
    assert upgraded.returncode == 1  # a rewrite of the table: not done behind your back
    assert "left for you: column payload is text" in upgraded.stdout
    assert doctor(pg_url)[0] == 1


async def test_missing_partitions_and_autovacuum_settings_are_reported(pg_url: str) -> None:
    create(pg_url, PARTITIONED)
    # As if the cleaner had not run for days: only the DEFAULT partition is left.
    await sql(
        pg_url,
        "DO $$ DECLARE p text; BEGIN FOR p IN SELECT c.relname FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox_messages'::regclass "
        "AND c.relname <> 'outbox_messages_default' LOOP EXECUTE 'DROP TABLE ' || p; "
        "END LOOP; END $$",
        "ALTER TABLE outbox_messages_default RESET (autovacuum_vacuum_scale_factor)",
    )
    code, out = doctor(pg_url, PARTITIONED)
    assert code == 1
    assert "partition(s) missing ahead of now" in out
    assert 'CREATE TABLE "outbox_messages_p' in out and "PARTITION OF" in out
    assert "outbox_messages_default: autovacuum settings autovacuum_vacuum_scale_factor" in out
    upgraded = run_cli("db", "upgrade", "--url", pg_url, env=PARTITIONED)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert doctor(pg_url, PARTITIONED)[0] == 0
    # A plain table where the settings ask for partitions: reported, never rewritten.
    plain = pg_url  # the same database, another table name
    env = {**PARTITIONED, "OUTBOX_TABLE_NAME": "plain_outbox"}
    assert run_cli("db", "create", "--url", plain, env={"OUTBOX_TABLE_NAME": "plain_outbox"})
    code, out = doctor(plain, env)
    assert code == 1 and "plain_outbox is not partitioned" in out


def test_sqlite_table_is_fine_and_a_missing_index_reported(tmp_path: object) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/doctor.db"
    create(url)
    assert doctor(url)[0] == 0
    import sqlite3

    with sqlite3.connect(f"{tmp_path}/doctor.db") as conn:
        conn.execute("DROP INDEX ix_outbox_messages_key")
    code, out = doctor(url)
    assert code == 1 and "index ix_outbox_messages_key is missing" in out


#: The partition lease table as the first release of ordered subscribers made it (580f9ae),
#: before the attempts of its partitions' first messages were counted there.
LEASES_BEFORE_ATTEMPTS = """
CREATE TABLE outbox_inbox_partitions (
    "group" VARCHAR(255) NOT NULL, stream VARCHAR(255) NOT NULL, partition INTEGER NOT NULL,
    partitions INTEGER NOT NULL, owner VARCHAR(255), token INTEGER NOT NULL,
    position VARCHAR(64) NOT NULL, expires_at TIMESTAMP WITH TIME ZONE NOT NULL,
    PRIMARY KEY ("group", stream, partition)
)
"""


@pytest.mark.parametrize("dialect", ["postgres", "sqlite"])
async def test_the_lease_table_of_an_earlier_release_gets_its_attempt_columns(
    pg_url: str, tmp_path: object, dialect: str
) -> None:
    """The ordered subscribers' lease table without ``started`` and ``attempts`` (and a
    group's rows in it): reported with each ``ADD COLUMN``, added by ``db upgrade``, the
    rows kept (no attempt counted)."""
    from fastapi_outbox import Outbox

    url = pg_url if dialect == "postgres" else f"sqlite+aiosqlite:///{tmp_path}/leases.db"
    outbox = Outbox(url)
    await outbox.create_tables()
    await outbox.aclose()
    if dialect == "postgres":
        await sql(
            url,
            "DROP TABLE outbox_inbox_partitions",
            LEASES_BEFORE_ATTEMPTS,
            "INSERT INTO outbox_inbox_partitions VALUES ('g', 's', 0, 1, NULL, 3, '5-0', now())",
        )
    else:
        import sqlite3

        with sqlite3.connect(f"{tmp_path}/leases.db") as conn:
            conn.execute("DROP TABLE outbox_inbox_partitions")
            conn.execute(LEASES_BEFORE_ATTEMPTS)
            conn.execute(
                "INSERT INTO outbox_inbox_partitions VALUES "
                "('g', 's', 0, 1, NULL, 3, '5-0', CURRENT_TIMESTAMP)"
            )
    code, out = doctor(url)
    assert code == 1, out
    assert "MISMATCH: table outbox_inbox_partitions: column started is missing" in out
    assert "MISMATCH: table outbox_inbox_partitions: column attempts is missing" in out
    assert 'ALTER TABLE "outbox_inbox_partitions" ADD COLUMN attempts INTEGER' in out
    assert out.count("MISMATCH") == 2
    upgraded = run_cli("db", "upgrade", "--url", url)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert "fixed: table outbox_inbox_partitions: column started is missing" in upgraded.stdout
    assert doctor(url)[0] == 0
    outbox = Outbox(url)
    try:
        [owned] = await outbox.inbox.leases("g", "s").acquire("m", 1, lease_seconds=30)
        assert (owned.position, owned.started, owned.attempts) == ("5-0", None, 0)
    finally:
        await outbox.aclose()
