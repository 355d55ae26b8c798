"""MariaDB/MySQL without a server: the error classifier's verdicts by error number, the
statements compiled for the ``mysql`` dialect (no ``UPDATE … RETURNING``, ``SKIP LOCKED``,
derived tables for bounded changes), the DDL (``AUTO_INCREMENT`` ``seq``, microsecond
times, ``LONGTEXT``, the status-led claim index), the engine's defaults and the URL check."""

from __future__ import annotations

import asyncmy.errors
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import select
from sqlalchemy.dialects import mysql, postgresql, sqlite

from fastapi_outbox.exceptions import ConfigurationError
from fastapi_outbox.settings import check_database_url
from fastapi_outbox.storage import clock, schema
from fastapi_outbox.storage.db_outage import Verdict, classify, classify_mysql, describe
from fastapi_outbox.storage.engine import MYSQL_ISOLATION, engine_defaults
from fastapi_outbox.storage.mysql_claim import choose
from fastapi_outbox.storage.statements import claims as claims_sql
from fastapi_outbox.storage.statements import purge as purge_sql
from fastapi_outbox.storage.statements.parts import PUBLISHED, derived

MYSQL = mysql.dialect()


def my(code: int, cls: type[Exception] = asyncmy.errors.OperationalError) -> sa_exc.DBAPIError:
    """An asyncmy error with its error number, wrapped as SQLAlchemy raises it."""
    return sa_exc.OperationalError("SELECT 1", None, cls(code, "message"))


@pytest.mark.parametrize("code", [2002, 2003, 2006, 2013, 1053, 1927, 4031, 1040, 1049, 1021])
def test_a_server_that_is_gone_restarting_or_full_is_an_outage(code: int) -> None:
    assert classify(my(code), "mysql") is Verdict.OUTAGE


@pytest.mark.parametrize("code", [1290, 1836, 1792])
def test_a_read_only_server_is_an_outage(code: int) -> None:
    # --read-only, or a replica after a failover: every message's inbox row would fail.
    assert classify_mysql(my(code)) is Verdict.OUTAGE


@pytest.mark.parametrize("code", [1213, 1205])
def test_deadlocks_and_lock_wait_timeouts_are_retried_without_charge(code: int) -> None:
    verdict = classify_mysql(my(code))
    assert verdict is Verdict.CONTENTION
    assert "deadlock or lock wait timeout" in describe(my(code), "mysql")


def test_refused_credentials_missing_tables_and_other_errors() -> None:
    assert classify_mysql(my(1045)) is Verdict.AUTHENTICATION
    assert classify_mysql(my(1146, asyncmy.errors.ProgrammingError)) is Verdict.TABLE_MISSING
    assert classify_mysql(my(1064, asyncmy.errors.ProgrammingError)) is Verdict.FAILURE
    assert classify_mysql(my(1062, asyncmy.errors.IntegrityError)) is Verdict.FAILURE
    # No number: a socket error or a driver error, the ping decides.
    assert classify_mysql(ConnectionRefusedError()) is Verdict.UNKNOWN
    assert classify_mysql(ValueError("handler's own")) is Verdict.FAILURE


def test_a_group_of_contention_and_outage_is_an_outage() -> None:
    group = BaseExceptionGroup("both", [my(1213), my(2013)])
    assert classify_mysql(group) is Verdict.OUTAGE


def test_the_claim_is_a_locking_read_then_an_update_without_returning() -> None:
    table = schema.build_table("o")
    read = claims_sql.claim_candidates(table, "default", 100, False, "pending", MYSQL)
    sql = str(read.compile(dialect=MYSQL))
    assert "FOR UPDATE SKIP LOCKED" in sql
    assert "ORDER BY o.next_attempt_at, o.id" in sql
    assert "UTC_TIMESTAMP(6)" in sql
    mark = str(claims_sql.claim_rows(table, MYSQL).compile(dialect=MYSQL))
    assert mark.startswith("UPDATE o SET") and "RETURNING" not in mark
    assert "timestampadd(MICROSECOND" in mark


def test_a_suspect_row_is_claimed_alone_and_ends_a_batch() -> None:
    rows = [("a", False), ("b", False), ("c", True), ("d", False)]
    assert choose(rows, suspect_at=1) == rows[:2]
    assert choose([rows[2], rows[3]], suspect_at=1) == [rows[2]]
    assert choose(rows[:2], suspect_at=1) == rows[:2]


def test_bounded_deletes_pick_their_batch_in_a_derived_table() -> None:
    table = schema.build_table("o")
    stmt = purge_sql.purge(table, PUBLISHED, 60.0, 500, MYSQL)
    sql = str(stmt.compile(dialect=MYSQL))
    assert "IN (SELECT chosen.id \nFROM (SELECT" in sql  # MySQL refuses LIMIT in IN (…)
    chosen = select(table.c.id).limit(5)
    assert derived(chosen, postgresql.dialect()) is chosen
    assert derived(chosen, sqlite.dialect()) is chosen


def test_the_ddl_numbers_rows_in_insert_order_and_leads_the_claim_index_with_status() -> None:
    ddl = schema.ddl(schema.build_table("o", ordered=True), MYSQL)
    assert "seq BIGINT NOT NULL COMMENT 'insert order, for ordered dispatch' AUTO_INCREMENT" in ddl
    assert "next_attempt_at DATETIME(6) NOT NULL" in ddl
    assert "payload LONGTEXT NOT NULL" in ddl
    assert "CREATE INDEX ix_o_due_status ON o (broker, status, next_attempt_at, id)" in ddl
    assert "ix_o_due " not in ddl  # a partial index elsewhere; here it would hold every row
    assert "ix_o_ordered_mysql ON o (broker, status, seq)" in ddl
    pg = schema.ddl(schema.build_table("o", ordered=True), postgresql.dialect())
    assert "due_status" not in pg and "AUTO_INCREMENT" not in pg


def test_times_are_the_database_clock_in_microseconds() -> None:
    assert clock.offset_value("mysql", 1.5) == 1_500_000
    later = str(clock.db_later("mysql", "lease").compile(dialect=MYSQL))
    assert later == "timestampadd(MICROSECOND, %s, UTC_TIMESTAMP(6))"


def test_the_engine_is_read_committed_and_recycles_connections() -> None:
    opts = engine_defaults("mysql+asyncmy://root@127.0.0.1/test", {})
    assert opts["isolation_level"] == MYSQL_ISOLATION == "READ COMMITTED"
    assert opts["pool_recycle"] > 0 and opts["connect_args"]["connect_timeout"] > 0
    mine = engine_defaults("mysql+asyncmy://h/x", {"isolation_level": "SERIALIZABLE"})
    assert mine["isolation_level"] == "SERIALIZABLE"


def test_asyncmy_and_aiomysql_urls_are_accepted() -> None:
    check_database_url("mysql+asyncmy://root@127.0.0.1:3306/test")
    check_database_url("mysql+aiomysql://root@127.0.0.1:3306/test")
    with pytest.raises(ConfigurationError, match="mysql\\+asyncmy://"):
        check_database_url("mysql+pymysql://root@127.0.0.1:3306/test")
