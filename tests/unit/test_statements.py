"""The statement builders of ``storage/statements``, compiled without a database.

Each builder is pure (a table and a dialect in, a statement out), so the shape the relays
and operators depend on is checked here for both dialects: the claim's row locks, due and
lease conditions, ordered-key conditions and batch limit; the fence of every change after
the claim; retention's bounded DELETE; the literal statuses the partial indexes need.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect

from fastapi_outbox.exceptions import OperationError
from fastapi_outbox.storage.filters import MessageFilter
from fastapi_outbox.storage.schema import build_archive_table, build_table
from fastapi_outbox.storage.statements import claims, inserts, messages, parts, purge

PG = postgresql.dialect()
LITE = sqlite.dialect()
ACTIVE = "status IN ('pending', 'processing', 'failed')"


@pytest.fixture(scope="module")
def table() -> Table:
    return build_table("unit_stmt_outbox")


def compiled(stmt: Any, dialect: Dialect) -> tuple[str, dict[str, Any]]:
    """The SQL text (whitespace folded) and the values bound when the statement was built."""
    c = stmt.compile(dialect=dialect)
    return " ".join(c.string.split()), dict(c.params)


# -- the claim -------------------------------------------------------------------------------


def test_claim_on_postgresql_locks_with_skip_locked_due_rows_oldest_first(table: Table) -> None:
    sql, params = compiled(claims.claim(table, "rabbit", 25, False, PG), PG)
    locked = sql.split("ranked AS")[0]
    assert "FOR UPDATE SKIP LOCKED" in locked
    assert "o.broker = %(broker_1)s" in locked and params["broker_1"] == "rabbit"
    assert f"o.{ACTIVE}" in locked  # the partial due index's predicate, as literals
    assert "o.next_attempt_at <= now()" in locked  # due by the database's clock
    assert "ORDER BY o.next_attempt_at, o.id" in locked
    assert "LIMIT %(param_1)s" in locked and params["param_1"] == 25
    assert "EXISTS" not in locked  # no key conditions when unordered


def test_claim_sets_the_fence_the_lease_and_counts_the_attempt(table: Table) -> None:
    sql, params = compiled(claims.claim(table, "b", 10, False, PG), PG)
    update = sql.split(") UPDATE ")[1]
    assert "locked_by=%(token)s" in update
    assert "locked_until=(now() + %(lease)s)" in update
    assert "next_attempt_at=(now() + %(lease)s)" in update  # an expired lease is due again
    assert "attempts=(unit_stmt_outbox.attempts + %(attempts_1)s" in update
    assert params["attempts_1"] == 1 and params["status"] == "processing"
    assert "WHERE unit_stmt_outbox.id = chosen.id" in update
    returning = update.split("RETURNING")[1]
    assert "CAST(unit_stmt_outbox.payload AS TEXT)" in returning
    assert "EXTRACT(epoch FROM now() - unit_stmt_outbox.created_at)" in returning


def test_claim_isolates_a_suspect_row(table: Table) -> None:
    sql, params = compiled(claims.claim(table, "b", 10, False, PG), PG)
    assert "o.status = %(status_1)s" in sql and params["status_1"] == "processing"
    assert "o.attempts >= %(attempts_2)s" in sql and params["attempts_2"] == 2
    chosen = sql.split("chosen AS")[1].split(") UPDATE ")[0]
    assert "ranked.rn = %(rn_1)s" in chosen and params["rn_1"] == 1
    # No suspect: every locked row (limit + 1 is past the last position).
    assert "coalesce((SELECT min(ranked.rn)" in chosen and params["coalesce_1"] == 11


def test_claim_on_sqlite_has_no_row_locks(table: Table) -> None:
    sql, params = compiled(claims.claim(table, "b", 7, False, LITE), LITE)
    assert "FOR UPDATE" not in sql and "SKIP LOCKED" not in sql
    assert "o.next_attempt_at <= strftime(" in sql  # SQLite's 'now', the database's clock
    assert "LIMIT ?" in sql and 7 in params.values()


def test_ordered_claim_on_postgresql_holds_keys_behind_earlier_rows(table: Table) -> None:
    sql, _ = compiled(claims.claim(table, "b", 10, True, PG), PG)
    locked, ranked = sql.split("ranked AS")[0], sql.split("ranked AS")[1].split("chosen AS")[0]
    assert "ORDER BY o.seq" in locked  # insert order
    assert "o.key IS NULL OR" in locked  # keyless rows are never held
    # An earlier row of the key in flight or backing off…
    assert f"e.broker = o.broker AND e.key = o.key AND e.{ACTIVE}" in locked
    assert "e.next_attempt_at > now() AND (e.seq) < (o.seq)" in locked
    # …or abandoned holds the key.
    assert "a.status IN ('abandoned') AND (a.seq) < (o.seq)" in locked
    # An earlier row skipped as locked holds the key too (PostgreSQL only).
    assert "h.key = locked.key" in ranked and "h.id NOT IN (SELECT locked.id" in ranked
    assert sql.endswith("unit_stmt_outbox.seq")  # RETURNING the order, for sorting


def test_ordered_claim_on_sqlite_orders_by_rowid_without_the_skipped_check(table: Table) -> None:
    sql, _ = compiled(claims.claim(table, "b", 10, True, LITE), LITE)
    assert "ORDER BY o.rowid" in sql and "(e.rowid) < (o.rowid)" in sql
    assert "AS h " not in sql  # nothing is skipped where nothing is locked


def test_claim_quotes_a_keyword_table_name_on_sqlite() -> None:
    sql, _ = compiled(claims.claim(build_table("order"), "b", 10, True, LITE), LITE)
    assert sql.endswith('"order".rowid')


def test_ordered_turn_is_an_advisory_lock_after_the_local_bounds() -> None:
    sql, params = compiled(claims.ordered_turn("fastapi_outbox:t", "b", 5000, 1000), PG)
    assert sql.index("set_config") < sql.index("pg_advisory_xact_lock(hashtext(")
    assert "fastapi_outbox:t:b" in params.values()
    assert {"5000ms", "1000ms"} <= set(params.values())
    assert claims.local_timeouts(None, None) == []
    assert claims.transaction_bounds(None, 5) is None
    # A table partitioned by id: the claim's generic plan for this transaction too.
    sql, params = compiled(claims.ordered_turn("k", "b", None, None, generic=True), PG)
    assert sql.index("set_config") < sql.index("pg_advisory_xact_lock(")
    assert {"plan_cache_mode", "force_generic_plan"} <= set(params.values())
    plain = compiled(claims.ordered_turn("k", "b", None, None), PG)[1]
    assert "plan_cache_mode" not in plain.values()


# -- the changes after the claim: fenced ------------------------------------------------------


@pytest.mark.parametrize("delete_rows", [False, True])
def test_mark_published_is_fenced_by_the_token_over_an_id_array(
    table: Table, delete_rows: bool
) -> None:
    sql, params = compiled(claims.mark_published(table, PG, delete_rows=delete_rows), PG)
    assert sql.startswith("DELETE" if delete_rows else "UPDATE")
    assert sql.endswith(
        "WHERE unit_stmt_outbox.id = ANY (%(ids)s::UUID[]) "
        "AND unit_stmt_outbox.locked_by = %(token)s::VARCHAR"
    )
    if not delete_rows:
        assert params["status"] == "published" and "published_at=now()" in sql


def test_on_a_partitioned_table_the_marks_bound_the_batch_id_range() -> None:
    """Init plans of the ids and their range: pruned when the plan runs, never planned again
    for a new batch (see ``parts.ids_in``)."""
    parted = build_table("unit_parted_outbox", partitioning="daily")
    for stmt in (
        claims.mark_published(parted, PG),
        claims.release(parted, PG),
        claims.extend_lease(parted, PG),
    ):
        sql, _ = compiled(stmt, PG)
        assert (
            "id = ANY (CAST((SELECT %(ids)s::UUID[] AS anon_1) AS UUID[])) "
            "AND unit_parted_outbox.id >= (SELECT %(ids_lo)s::UUID AS anon_2) "
            "AND unit_parted_outbox.id <= (SELECT %(ids_hi)s::UUID AS anon_3)"
        ) in " ".join(sql.split())
    ids = [uuid.UUID(int=3), uuid.UUID(int=1), uuid.UUID(int=2)]
    assert parts.batch_params(ids) == {"ids": ids, "ids_lo": ids[1], "ids_hi": ids[0]}


def test_a_partitioned_claim_updates_the_chosen_ids_between_their_bounds() -> None:
    """No join on a table partitioned by id (see ``claims._chosen_rows``): an array of the
    chosen ids and their range, init plans that prune the update's partitions at run time."""
    parted = build_table("unit_parted_outbox", partitioning="daily")
    sql, _ = compiled(claims.claim(parted, "b", 10, False, PG), PG)
    sql = " ".join(sql.split())
    assert sql.count("unit_parted_outbox.id = ANY (CAST((SELECT array_agg(chosen.id)") == 1
    assert "unit_parted_outbox.id >= (SELECT chosen.id" in sql
    assert "unit_parted_outbox.id <= (SELECT chosen.id" in sql
    assert "ORDER BY chosen.id DESC" in sql
    plain, _ = compiled(claims.claim(build_table("unit_plain"), "b", 10, False, PG), PG)
    assert "WHERE unit_plain.id = chosen.id" in plain


def test_mark_published_on_sqlite_expands_the_ids(table: Table) -> None:
    sql, _ = compiled(claims.mark_published(table, LITE), LITE)
    assert "id IN (__[POSTCOMPILE_ids]) AND unit_stmt_outbox.locked_by = ?" in sql


def test_mark_failed_backs_off_by_the_database_clock_and_stamps_only_abandoned(
    table: Table,
) -> None:
    sql, _ = compiled(claims.mark_failed(table, PG), PG)
    assert "next_attempt_at=(now() + %(delay)s)" in sql
    assert "WHERE unit_stmt_outbox.id = %(row_id)s AND unit_stmt_outbox.locked_by = %(token)s" in (
        sql.replace("::UUID", "").replace("::VARCHAR", "")
    )
    assert "abandoned_at=CASE WHEN (%(new_status)s" in sql


@pytest.mark.parametrize(("refund", "step"), [(True, 1), (False, 0)])
def test_release_gives_processing_rows_back_due_now(table: Table, refund: bool, step: int) -> None:
    sql, params = compiled(claims.release(table, PG, refund_attempt=refund), PG)
    assert "CASE WHEN (unit_stmt_outbox.status = %(status_1)s" in sql
    assert params["status_1"] == "processing" and params["param_1"] == "pending"
    assert "next_attempt_at=now()" in sql and "locked_by = %(token)s" in sql
    assert params["attempts_1"] == step


def test_extend_lease_moves_the_due_time_with_the_lease(table: Table) -> None:
    sql, _ = compiled(claims.extend_lease(table, LITE), LITE)
    assert "locked_until=strftime(?, ?, ?)" in sql and "next_attempt_at=strftime(?, ?, ?)" in sql
    assert sql.endswith("AND unit_stmt_outbox.locked_by = ?")


def test_next_due_reads_only_future_active_rows(table: Table) -> None:
    sql, params = compiled(claims.next_due(table, "b", PG), PG)
    assert f"unit_stmt_outbox.{ACTIVE}" in sql and "next_attempt_at > now()" in sql
    assert params == {"broker_1": "b"}


# -- retention ------------------------------------------------------------------------------


def test_purge_on_postgresql_deletes_a_bounded_batch_skipping_locked_rows(table: Table) -> None:
    sql, params = compiled(purge.purge(table, "published", 60.0, 500, PG), PG)
    assert sql.startswith("DELETE FROM unit_stmt_outbox WHERE unit_stmt_outbox.id IN (SELECT")
    assert "published_at < now() + %(param_1)s" in sql
    assert params["param_1"] == dt.timedelta(seconds=-60)
    assert params["status_1"] == "published"
    assert "LIMIT %(param_2)s::INTEGER FOR UPDATE SKIP LOCKED)" in sql
    assert params["param_2"] == 500
    assert "EXISTS" not in sql


def test_purge_keeps_abandoned_rows_a_later_row_of_their_key_waits_for(table: Table) -> None:
    sql, params = compiled(purge.purge(table, "abandoned", 1.0, 10, LITE, keep_blocking=True), LITE)
    assert "abandoned_at < strftime(" in sql
    assert "FOR UPDATE" not in sql
    assert f"e.{ACTIVE} AND (e.rowid) > (unit_stmt_outbox.rowid)" in sql
    assert 'unit_stmt_outbox."key" IS NULL OR NOT (EXISTS' in sql
    assert params["status_1"] == "abandoned"


# -- the write path and the operators' statements ------------------------------------------------


def test_insert_takes_every_time_from_the_database(table: Table) -> None:
    keys = [*inserts.INSERT_KEYS, "delay", "deliver_at"]  # what the unit of work supplies
    sql = " ".join(
        inserts.insert_rows(table, PG).compile(dialect=PG, column_keys=keys).string.split()
    )
    assert "created_at" in sql and "now()" in sql
    assert "greatest(statement_timestamp(), coalesce(%(deliver_at)s" in sql
    assert "statement_timestamp() + %(delay)s" in sql
    lite = inserts.insert_rows(table, LITE).compile(dialect=LITE, column_keys=keys).string
    assert "max(strftime(" in lite


def test_row_params_on_sqlite_turn_the_delay_into_a_modifier() -> None:
    rows = [{"id": 1, "delay": dt.timedelta(seconds=1.5)}]
    assert inserts.row_params(rows, LITE) == [
        {"deliver_at": None, "id": 1, "delay": "+1.500000 seconds", "seq": 0}
    ]
    assert inserts.row_params(rows, PG)[0]["delay"] == dt.timedelta(seconds=1.5)


def test_counts_use_literal_statuses_for_the_partial_indexes(table: Table) -> None:
    for name, stmt in messages.stats(table, PG).items():
        sql, params = compiled(stmt, PG)
        outer = sql.split("EXISTS")[0]  # the WHERE an index must serve
        assert "status IN ('" in outer, name
        if "EXISTS" not in sql:
            assert not set(params.values()) & {"pending", "failed", "abandoned", "published"}


def test_list_messages_pages_by_key_never_by_offset(table: Table) -> None:
    import uuid

    where = MessageFilter(stream="orders")
    stmt = messages.list_messages(table, PG, where, before_id=uuid.UUID(int=5), limit=3)
    sql, params = compiled(stmt, PG)
    assert "unit_stmt_outbox.id < %(id_1)s" in sql and "OFFSET" not in sql
    assert "ORDER BY unit_stmt_outbox.id DESC" in sql and params["param_1"] == 3
    assert "payload" not in sql.split("FROM")[0]


def test_one_filter_lists_the_outbox_and_its_archive_alike(table: Table) -> None:
    """The operator's filter is handed down whole: each field becomes one condition, and
    ``scheduled`` is pending rows not yet due (not a stored status)."""
    since = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    where = MessageFilter(status="scheduled", broker="b", type="T", key="k", since=since)
    sql, params = compiled(messages.list_messages(table, PG, where), PG)
    assert "status IN ('pending')" in sql and "next_attempt_at > now()" in sql
    assert {"b", "T", "k", since} <= set(params.values())
    archive = build_archive_table(table, "unit_stmt_archive")
    sql, params = compiled(messages.list_messages(archive, PG, MessageFilter(stream="s")), PG)
    assert "unit_stmt_archive.stream = %(stream_1)s" in sql and params["stream_1"] == "s"
    with pytest.raises(OperationError, match="status: 'nope' is not one of"):
        MessageFilter(status="nope")


def test_replay_skips_rows_another_operator_holds(table: Table) -> None:
    sql, _ = compiled(messages.replay(table, PG, limit=100), PG)
    assert "ORDER BY unit_stmt_outbox.id LIMIT %(param_1)s::INTEGER FOR UPDATE SKIP LOCKED" in sql
    assert "RETURNING unit_stmt_outbox.id" in sql
    lite, _ = compiled(messages.replay(table, LITE, limit=100), LITE)
    assert "FOR UPDATE" not in lite
