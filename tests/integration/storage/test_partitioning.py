"""A partitioned outbox (PostgreSQL, ``OutboxSettings(partitioning="daily")``): layout,
claims served by every partition's partial index, partitions created ahead, retention by
dropping partitions that hold only finished rows, and a DEFAULT partition that keeps
producers going when maintenance did not run."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text, update
from sqlalchemy.ext.asyncio import create_async_engine

from fastapi_outbox import ConfigurationError, Message, Outbox, OutboxSettings, build_table
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.storage import partitions
from fastapi_outbox.storage.schema import ddl
from fastapi_outbox.storage.statements import claims as claims_sql
from fastapi_outbox.storage.statements import messages as messages_sql
from fastapi_outbox.storage.statements import partitions as part_sql
from fastapi_outbox.storage.statements.parts import batch_params
from fastapi_outbox.testing import drain
from tests.conftest import run_cli, unique

DAY = dt.timedelta(days=1)
#: A UUIDv7-like id made now by the database (PostgreSQL 15 has no uuidv7()): the Unix
#: milliseconds in the first 48 bits, random bits after, like the library's ids.
UUID7_SQL = (
    "(lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::bigint), 12, '0') "
    "|| substr(md5(random()::text), 1, 20))::uuid"
)


def partitioned(url: str, **overrides: Any) -> Outbox:
    settings = OutboxSettings(
        run_relays=False,
        partitioning="daily",
        published_retention_seconds=86400.0,
        abandoned_retention_seconds=86400.0,
        **overrides,
    )
    return Outbox(url, brokers={"default": MemoryBroker()}, settings=settings)


async def publish(outbox: Outbox, stream: str, n: int) -> list[uuid.UUID]:
    async with outbox.unit_of_work() as uow:
        return [
            uow.publish(Message(stream=stream, type="Thing", payload={"i": i})) for i in range(n)
        ]


async def where_rows(outbox: Outbox) -> dict[uuid.UUID, str]:
    """Row id → the partition holding it."""
    async with outbox.engine.connect() as conn:
        rows = await conn.execute(
            text(f"SELECT id, tableoid::regclass::text FROM {outbox.table.name}")
        )
        return {row[0]: row[1] for row in rows}


def midnight(at: dt.datetime) -> dt.datetime:
    return at.replace(hour=0, minute=0, second=0, microsecond=0)


async def test_partitioned_layout_created_ahead_with_the_partial_indexes(pg_url: str) -> None:
    outbox = partitioned(pg_url)
    try:
        await outbox.create_tables()
        await outbox.create_tables()  # idempotent
        found = await outbox.partitions.partitions()  # type: ignore[union-attr]
        table = outbox.table.name
        assert found[-1].is_default and found[-1].name == f"{table}_default"
        today = midnight(dt.datetime.now(dt.UTC))
        ranges = [(p.start, p.end) for p in found if not p.is_default]
        # Today and the next two days at least, one day each, contiguous.
        assert ranges[:3] == [(today + i * DAY, today + (i + 1) * DAY) for i in range(3)]
        async with outbox.engine.connect() as conn:
            pk = await conn.execute(
                text(
                    "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON "
                    "a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
                    f"WHERE i.indrelid = '{table}'::regclass AND i.indisprimary"
                )
            )
            assert sorted(r[0] for r in pk) == ["id"]
            key = await conn.execute(text(f"SELECT pg_get_partkeydef('{table}'::regclass)"))
            assert key.scalar_one() == "RANGE (id)"
            # Every partition (DEFAULT included) carries the claim's partial index.
            due = await conn.execute(
                text(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    f"WHERE i.inhparent = '{table}'::regclass AND NOT EXISTS ("
                    "SELECT 1 FROM pg_index x WHERE x.indrelid = c.oid AND "
                    "pg_get_expr(x.indpred, x.indrelid) LIKE '%pending%processing%failed%')"
                )
            )
            assert due.all() == []
            options = await conn.execute(
                text(f"SELECT reloptions FROM pg_class WHERE relname = '{table}_default'")
            )
            assert "autovacuum_vacuum_scale_factor=0.0" in options.scalar_one()
    finally:
        await outbox.aclose()


async def test_claims_are_index_served_across_partitions_and_messages_arrive(
    pg_url: str,
) -> None:
    outbox = partitioned(pg_url)
    table = outbox.table.name
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            # 20,000 published rows in today's partition, so the planner has a real choice.
            await conn.execute(
                text(
                    f"INSERT INTO {table} (id, broker, stream, type, payload, headers, status, "
                    f"next_attempt_at, created_at, published_at) SELECT {UUID7_SQL}, "
                    "'default', 's', 'T', '{}', '{}', 'published', now(), now(), now() "
                    "FROM generate_series(1, 20000)"
                )
            )
            await conn.execute(text(f"ANALYZE {table}"))
        ids = await publish(outbox, unique("orders"), 30)
        placed = await where_rows(outbox)
        today = midnight(dt.datetime.now(dt.UTC))
        assert {placed[i] for i in ids} == {partitions.partition_name(table, today)}

        store = outbox.store
        stmt = store.claims.claim_statement("default", 100, False)
        sql, args = store.connector.compile("explain", stmt, store.claims.claim_params("t", 30.0))
        async with store.connector.driver_connection() as driver:
            plan = "\n".join(r[0] for r in await driver.fetch("EXPLAIN " + sql, *args))
        # The partition holding rows is read through its partial claim index and its
        # primary key only (empty partitions may be scanned: they have no pages).
        part = partitions.partition_name(table, today)
        assert f"Seq Scan on {part}" not in plan, plan
        assert f"Index Scan using {part}_broker_next_attempt_at_id_idx on {part}" in plan, plan
        assert f"Index Scan using {part}_pkey on {part}" in plan, plan

        broker = outbox.brokers["default"]
        assert isinstance(broker, MemoryBroker)
        assert await drain(outbox) == 30
        got = {uuid.UUID(m.id) for m in broker.messages}
        assert got == set(ids)
        assert await outbox.store.messages.count("published") == 20030
    finally:
        await outbox.aclose()


def aged_id(row_id: uuid.UUID, at: dt.datetime) -> uuid.UUID:
    """``row_id`` as if made at ``at``: its first 48 bits (Unix ms) replaced."""
    ms = (at - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(milliseconds=1)
    return uuid.UUID(int=(ms << 80) | (row_id.int & ((1 << 80) - 1)))


async def age_rows(outbox: Outbox, ids: list[uuid.UUID], **values: Any) -> list[uuid.UUID]:
    """Give rows old times; with ``created_at``, an id of that time too (the row moves to
    that time's partition). Returns the rows' ids."""
    t = outbox.table
    out = []
    async with outbox.engine.begin() as conn:
        for row_id in ids:
            new_id = aged_id(row_id, values["created_at"]) if "created_at" in values else row_id
            await conn.execute(update(t).where(t.c.id == row_id).values(id=new_id, **values))
            out.append(new_id)
    return out


async def test_retention_drops_only_partitions_whose_rows_are_all_done(pg_url: str) -> None:
    outbox = partitioned(pg_url)
    table = outbox.table.name
    stream = unique("orders")
    now = dt.datetime.now(dt.UTC)
    today = midnight(now)
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            for days in (5, 4, 3):
                lo = today - days * DAY
                await conn.run_sync(partitions.create_partition_sync, table, lo, lo + DAY)
        done = dict(status="published", locked_by=None)
        # 5 days ago: everything published 5 days ago → the partition goes.
        expired = await publish(outbox, stream, 10)
        expired = await age_rows(
            outbox, expired, created_at=now - 5 * DAY, published_at=now - 5 * DAY, **done
        )
        # 4 days ago: published rows and one still pending → kept; the batched DELETE
        # takes its published rows, the pending one stays and is dispatched later.
        mixed_done = await publish(outbox, stream, 6)
        mixed_done = await age_rows(
            outbox, mixed_done, created_at=now - 4 * DAY, published_at=now - 4 * DAY, **done
        )
        [still_pending] = await publish(outbox, stream, 1)
        [still_pending] = await age_rows(outbox, [still_pending], created_at=now - 4 * DAY)
        # 3 days ago, published an hour ago: within retention → kept whole.
        recent = await publish(outbox, stream, 4)
        recent = await age_rows(
            outbox,
            recent,
            created_at=now - 3 * DAY,
            published_at=now - dt.timedelta(hours=1),
            **done,
        )
        # 30 days ago, no partition: in DEFAULT; the finished row is deleted by the batched
        # DELETE, the failed one stays.
        default_done = await publish(outbox, stream, 2)
        default_done = await age_rows(
            outbox,
            default_done,
            created_at=now - 30 * DAY,
            status="abandoned",
            abandoned_at=now - 30 * DAY,
        )
        [default_failed] = await publish(outbox, stream, 1)
        [default_failed] = await age_rows(
            outbox, [default_failed], created_at=now - 30 * DAY, status="failed"
        )
        placed = await where_rows(outbox)
        assert {placed[i] for i in default_done} == {f"{table}_default"}
        assert placed[expired[0]] == partitions.partition_name(table, today - 5 * DAY)

        await outbox.cleaner.run_once()

        assert outbox.cleaner.dropped_partitions == [
            partitions.partition_name(table, today - 5 * DAY)
        ]
        names = {p.name for p in await outbox.partitions.partitions()}  # type: ignore[union-attr]
        assert partitions.partition_name(table, today - 4 * DAY) in names
        assert partitions.partition_name(table, today - 3 * DAY) in names
        left = await where_rows(outbox)
        assert set(left) == {still_pending, default_failed, *recent}
        # The rows that still needed work are published after all.
        assert await drain(outbox) == 2
        broker = outbox.brokers["default"]
        assert isinstance(broker, MemoryBroker)
        assert {uuid.UUID(m.id) for m in broker.messages} == {still_pending, default_failed}
    finally:
        await outbox.aclose()


async def test_a_partition_whose_row_is_replayed_meanwhile_is_not_dropped(pg_url: str) -> None:
    """The re-check under the detach's lock: a candidate chosen while all its rows were done
    is kept when one of them needs work again by the time it is detached."""
    outbox = partitioned(pg_url)
    table = outbox.table.name
    now = dt.datetime.now(dt.UTC)
    lo = midnight(now) - 5 * DAY
    name = partitions.partition_name(table, lo)
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            await conn.run_sync(partitions.create_partition_sync, table, lo, lo + DAY)
        ids = await publish(outbox, unique("orders"), 3)
        ids = await age_rows(
            outbox, ids, created_at=now - 5 * DAY, status="abandoned", abandoned_at=now - 5 * DAY
        )
        maintainer = outbox.partitions
        assert maintainer is not None
        async with outbox.engine.begin() as conn:
            chosen = await conn.run_sync(partitions.expired_candidates, table, 86400.0, 86400.0)
        assert chosen == [name]
        await outbox.store.messages.replay([ids[0]])  # between the choice and the drop
        original = partitions.expired_candidates
        try:
            partitions.expired_candidates = lambda *a: chosen  # type: ignore[assignment]
            assert await maintainer.drop_expired(86400.0, 86400.0) == []
        finally:
            partitions.expired_candidates = original  # type: ignore[assignment]
        assert name in {p.name for p in await maintainer.partitions()}
        assert set(await where_rows(outbox)) == set(ids)
        assert await drain(outbox) == 1
    finally:
        await outbox.aclose()


async def test_default_partition_takes_rows_when_maintenance_is_late(pg_url: str) -> None:
    outbox = partitioned(pg_url)
    table = outbox.table.name
    today = midnight(dt.datetime.now(dt.UTC))
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:  # as if the job never ran: no partitions
            for p in await conn.run_sync(partitions.list_partitions, table):
                if not p.is_default:
                    await conn.execute(text(f"DROP TABLE {p.name}"))
        ids = await publish(outbox, unique("orders"), 5)  # the producer does not fail
        assert set((await where_rows(outbox)).values()) == {f"{table}_default"}
        created = await outbox.partitions.ensure_ahead()  # type: ignore[union-attr]
        # Today's range has rows in DEFAULT: left there; the coming days are created.
        assert partitions.partition_name(table, today) not in created
        assert partitions.partition_name(table, today + DAY) in created
        assert await drain(outbox) == 5
        assert set(await where_rows(outbox)) == set(ids)
    finally:
        await outbox.aclose()


async def test_build_table_create_makes_the_partitions_for_migrations(pg_url: str) -> None:
    """What a hand-written Alembic migration runs: ``build_table(...).create(bind)``."""
    outbox = partitioned(pg_url)
    table = build_table("events_outbox", partitioning="6h")
    try:
        async with outbox.engine.begin() as conn:
            await conn.run_sync(table.create)
            found = await conn.run_sync(partitions.list_partitions, "events_outbox")
        spans = {p.end - p.start for p in found if p.start and p.end}
        assert spans == {dt.timedelta(hours=6)}
        assert len(found) >= 9  # 2 days ahead in 6 h partitions, and DEFAULT
    finally:
        await outbox.aclose()


def test_partitioning_refused_on_sqlite_and_bad_intervals(tmp_path: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"partitioning.*PostgreSQL"):
        Outbox(
            f"sqlite+aiosqlite:///{tmp_path}/o.db",
            settings=OutboxSettings(partitioning="daily"),
        )
    with pytest.raises(ConfigurationError, match="partitioning"):
        OutboxSettings.from_env(partitioning="5h")
    with pytest.raises(ConfigurationError, match="partitioning"):
        OutboxSettings.from_env(partitioning="fortnightly")
    with pytest.raises(ConfigurationError, match="too long for partitioning"):
        OutboxSettings.from_env(partitioning="daily", table_name="x" * 60)


def test_cli_db_sql_and_create_with_partitioning(pg_url: str) -> None:
    env = {"OUTBOX_PARTITIONING": "daily"}
    sql = run_cli("db", "sql", env=env)
    assert sql.returncode == 0, sql.stderr
    assert "PARTITION BY RANGE (id)" in sql.stdout
    assert "PRIMARY KEY (id)" in sql.stdout
    today = midnight(dt.datetime.now(dt.UTC))
    assert f"FOR VALUES FROM ('{part_sql.id_bound(today)}')" in sql.stdout
    assert "outbox_messages_default PARTITION OF outbox_messages" in sql.stdout.replace('"', "")
    refused = run_cli("db", "sql", "--dialect", "sqlite", env=env)
    assert refused.returncode == 2 and "partitioning" in refused.stderr
    url = pg_url
    created = run_cli("db", "create", "--url", url, env=env)
    assert created.returncode == 0, created.stderr
    status = run_cli("status", "--url", url, "--json", env=env)
    assert status.returncode == 0, status.stderr
    json.loads(status.stdout)


async def test_the_readme_procedure_moves_a_plain_table_to_partitions(pg_url: str) -> None:
    """The docs' SQL (docs/how-to/partitions.md), as written (the cut-over moved to tomorrow):
    rows of the old table stay where they are and are still dispatched; new rows go to the
    new partitions."""
    import asyncpg

    readme = (Path(__file__).parents[3] / "docs" / "how-to" / "partitions.md").read_text()
    block = readme.split("```sql\n-- Move outbox_messages to daily partitions")[1]
    script = block.split("\n", 1)[1].split("```")[0]  # from the line after the title
    tomorrow = midnight(dt.datetime.now(dt.UTC)) + DAY
    script = script.replace(
        "01a21526-e400-0000-0000-000000000000", str(part_sql.id_bound(tomorrow))
    )
    step1, step2 = script.split("-- 2. The switch, one transaction:")

    plain = Outbox(
        pg_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(run_relays=False)
    )
    stream = unique("orders")
    try:
        await plain.create_tables()
        old_pending = await publish(plain, stream, 5)
        old_done = await publish(plain, stream, 3)
        await age_rows(plain, old_done, status="published", published_at=dt.datetime.now(dt.UTC))
    finally:
        await plain.aclose()

    conn = await asyncpg.connect(pg_url.replace("+asyncpg", ""))
    try:
        for statement in step1.split(";\n"):
            if statement.strip():
                await conn.execute(statement)
        await conn.execute(step2)  # BEGIN … COMMIT: one transaction
    finally:
        await conn.close()
    env = {"OUTBOX_PARTITIONING": "daily"}
    upgraded = run_cli("db", "upgrade", "--url", pg_url, env=env)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    doctor = run_cli("doctor", "--url", pg_url, env=env)
    assert doctor.returncode == 0, doctor.stdout

    outbox = partitioned(pg_url)
    try:
        new = await publish(outbox, stream, 4)
        placed = await where_rows(outbox)
        assert {placed[i] for i in [*old_pending, *old_done]} == {"outbox_messages_legacy"}
        # Today is before the cut-over: new rows still go to the old table, now a partition.
        assert {placed[i] for i in new} == {"outbox_messages_legacy"}
        seqs = {
            r["id"]: r["seq"]
            for r in [await outbox.store.messages.get(i) for i in [*old_pending, *new]]
            if r
        }
        assert min(seqs[i] for i in new) > max(seqs[i] for i in old_pending)
        assert await drain(outbox) == 9
        broker = outbox.brokers["default"]
        assert isinstance(broker, MemoryBroker)
        assert {uuid.UUID(m.id) for m in broker.messages} == {*old_pending, *new}
        names = [p.name for p in await outbox.partitions.partitions()]  # type: ignore[union-attr]
        assert names[0] == "outbox_messages_legacy"
        assert partitions.partition_name("outbox_messages", tomorrow) in names
    finally:
        await outbox.aclose()


async def test_relay_processes_maintaining_at_once_do_not_trip_over_each_other(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every relay process runs the maintenance: each partition is created or dropped
    by one of them, the others skip it quietly."""
    import asyncio

    one, two = partitioned(pg_url), partitioned(pg_url)
    table = one.table.name
    lo = midnight(dt.datetime.now(dt.UTC)) - 5 * DAY
    try:
        await one.create_tables()
        async with one.engine.begin() as conn:
            for p in await conn.run_sync(partitions.list_partitions, table):
                if not p.is_default:
                    await conn.execute(text(f"DROP TABLE {p.name}"))
            await conn.run_sync(partitions.create_partition_sync, table, lo, lo + DAY)
        assert one.partitions is not None and two.partitions is not None
        created = await asyncio.gather(one.partitions.ensure_ahead(), two.partitions.ensure_ahead())
        names = [*created[0], *created[1]]
        assert not [r.__dict__ for r in caplog.records if r.levelname == "WARNING"]
        assert len(names) == len(set(names)) >= 3
        dropped = await asyncio.gather(
            one.partitions.drop_expired(86400.0, 86400.0),
            two.partitions.drop_expired(86400.0, 86400.0),
        )
        assert [*dropped[0], *dropped[1]] == [partitions.partition_name(table, lo)]
        assert not [r.__dict__ for r in caplog.records if r.levelname == "WARNING"]
    finally:
        await one.aclose()
        await two.aclose()


async def test_relays_on_a_partitioned_table_deliver_to_redis(pg_url: str, redis_url: str) -> None:
    """The whole path on a partitioned table: the lifespan's cleaner keeps the partitions,
    the relay claims across them, messages reach a real Redis stream."""
    import redis.asyncio as aioredis

    from fastapi_outbox.brokers import RedisStreamsBroker
    from tests.conftest import wait_until

    stream = unique("orders")
    outbox = Outbox(
        pg_url,
        brokers={"default": RedisStreamsBroker(redis_url)},
        settings=OutboxSettings(partitioning="hourly"),
    )
    client = aioredis.Redis.from_url(redis_url)
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            ids = await publish(outbox, stream, 50)

            async def arrived() -> bool:
                return int(await client.xlen(stream)) == 50

            await wait_until(arrived, timeout=10)
        entries = await client.xrange(stream, "-", "+")
        assert {uuid.UUID(fields[b"id"].decode()) for _, fields in entries} == set(ids)
        found = await outbox.partitions.partitions()  # type: ignore[union-attr]
        assert len([p for p in found if not p.is_default]) >= 48  # two days of hours
        assert await outbox.store.messages.count("published") == 50
    finally:
        await client.aclose()
        await outbox.aclose()


def _literal(value: Any) -> str:
    """A bound value as an untyped SQL literal (``EXECUTE`` of a prepared statement)."""
    if value is None:
        return "NULL"
    if isinstance(value, list):
        value = "{" + ",".join(str(v) for v in value) + "}"
    elif isinstance(value, dt.timedelta):
        value = f"{value.total_seconds()} seconds"
    return "'" + str(value).replace("'", "''") + "'"


async def explain_generic(driver: Any, sql: str, args: list[Any]) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, FORMAT JSON) of ``sql`` as the relay runs it after five
    executions: a prepared statement's *generic* plan (forced here), executed and rolled
    back. The plan's root node."""
    name = f"p_{uuid.uuid4().hex}"
    await driver.execute(f"PREPARE {name} AS {sql}")
    transaction = driver.transaction()
    await transaction.start()
    try:
        await driver.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        params = ", ".join(_literal(a) for a in args)
        rows = await driver.fetch(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {name}({params})")
    finally:
        await transaction.rollback()
        await driver.execute(f"DEALLOCATE {name}")
    raw = rows[0][0]
    doc = json.loads(raw) if isinstance(raw, str | bytes) else raw
    plan: dict[str, Any] = doc[0]["Plan"]
    return plan


def executed(plan: dict[str, Any], index_suffix: str = "") -> dict[str, int]:
    """Partition → loops of the plan nodes that ran on it (``index_suffix``: index scans on
    an index whose name ends so only); the update's own node, on the parent, is left out."""
    out: dict[str, int] = {}
    nodes = [plan]
    while nodes:
        node = nodes.pop()
        nodes += node.get("Plans", [])
        relation = node.get("Relation Name")
        if relation is None or not node.get("Actual Loops") or "Operation" in node:
            continue
        if index_suffix and not str(node.get("Index Name", "")).endswith(index_suffix):
            continue
        out[relation] = out.get(relation, 0) + node["Actual Loops"]
    return out


async def test_claims_on_a_table_partitioned_by_id_run_the_generic_plan(pg_url: str) -> None:
    """The claim (plain and ordered) is planned once, not at every execution: left to
    ``plan_cache_mode = auto``, PostgreSQL plans the first five executions (and, on 34
    partitions, every later one) as custom plans of every partition (claims_sql.generic_plan)."""
    # One connection runs them all: its prepared statements are every claim's.
    engine = create_async_engine(pg_url, pool_size=1, max_overflow=0)
    outbox = Outbox(
        engine,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False, partitioning="daily"),
    )
    store = outbox.store
    try:
        await outbox.create_tables()
        await publish(outbox, unique("orders"), 3)
        claimed = 0
        for n in range(6):
            for ordered in (False, True):
                token = f"t{n}{ordered}"
                rows = await store.claims.claim("default", 2, token, 30.0, ordered=ordered)
                claimed += len(rows)
                await store.claims.release([r.id for r in rows], token)
        async with store.connector.driver_connection() as driver:
            plans = await driver.fetchrow(
                "SELECT coalesce(sum(generic_plans), 0) AS generic, "
                "coalesce(sum(custom_plans), 0) AS custom FROM pg_prepared_statements "
                "WHERE statement LIKE 'WITH locked%'"
            )
        assert claimed == 24
        assert (plans["generic"], plans["custom"]) == (12, 0), dict(plans)
    finally:
        await outbox.aclose()
        await engine.dispose()


async def test_lookups_by_id_read_one_partition_in_generic_plans(pg_url: str) -> None:
    """Partitioned by id, the claim's update, the marks and ``show`` touch the partition
    of the ids only, with the prepared statements' generic plans (asserted on the plan)."""
    outbox = partitioned(pg_url)
    table = outbox.table.name
    today = midnight(dt.datetime.now(dt.UTC))
    store = outbox.store
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            for days in (1, 2, 3, 4):  # older partitions the lookups must skip
                lo = today - days * DAY
                await conn.run_sync(partitions.create_partition_sync, table, lo, lo + DAY)
            await conn.execute(
                text(
                    f"INSERT INTO {table} (id, broker, stream, type, payload, headers, status, "
                    "next_attempt_at, created_at, published_at) SELECT "
                    f"{UUID7_SQL}, 'default', 's', 'T', '{{}}', '{{}}', 'published', now(), "
                    "now(), now() FROM generate_series(1, 5000)"
                )
            )
            await conn.execute(text(f"ANALYZE {table}"))
        ids = await publish(outbox, unique("orders"), 6)
        here = partitions.partition_name(table, today)
        assert set((await where_rows(outbox)).values()) >= {here}
        async with store.connector.driver_connection() as driver:
            claim = store.claims.claim_statement("default", 3, False)
            sql, args = store.connector.compile(
                "claim", claim, store.claims.claim_params("t", 30.0)
            )
            plan = await explain_generic(driver, sql, args)
            # The claimed rows are updated through one scan of their partition's primary
            # key; the other partitions' scans never run (pruned on the ids' range).
            assert executed(plan, "_pkey") == {here: 1}, plan

            rows = await store.claims.claim("default", 3, "tok", 30.0)
            claimed = [r.id for r in rows]
            mark = claims_sql.mark_published(outbox.table, outbox.engine.dialect)
            sql, args = store.connector.compile(
                "mark", mark, {**batch_params(claimed), "token": "tok"}
            )
            plan = await explain_generic(driver, sql, args)
            assert executed(plan) == {here: 1}, plan

            failed = claims_sql.mark_failed(outbox.table, outbox.engine.dialect)
            params = {"row_id": claimed[0], "token": "tok", "new_status": "failed"}
            params |= {"error": "e", "delay": dt.timedelta(seconds=1)}
            sql, args = store.connector.compile("failed", failed, params)
            plan = await explain_generic(driver, sql, args)
            assert executed(plan) == {here: 1}, plan

            dialect = outbox.engine.dialect
            for operation in (
                messages_sql.get(outbox.table, ids[-1]),  # show
                messages_sql.cancel_unclaimed(outbox.table, ids[-2:]),
                messages_sql.replay(outbox.table, dialect, ids[-2:], statuses=("pending",)),
            ):
                c = operation.compile(dialect=dialect, compile_kwargs={"render_postcompile": True})
                args = [c.params[k] for k in c.positiontup or ()]
                plan = await explain_generic(driver, c.string, args)
                assert set(executed(plan)) == {here}, plan
    finally:
        await outbox.aclose()


async def test_a_table_partitioned_by_created_at_keeps_working_and_doctor_says_so(
    pg_url: str,
) -> None:
    """A table made by an earlier release (``PARTITION BY RANGE (created_at)``, primary key
    ``(id, created_at)``): the maintenance follows its key (timestamp bounds), dispatch
    and retention work, and ``doctor`` advises the move without failing."""
    table = unique("legacy_outbox")
    outbox = partitioned(pg_url, table_name=table)
    today = midnight(dt.datetime.now(dt.UTC))
    layout = ddl(outbox.table, outbox.engine.dialect).split(";\n\n")
    old = [
        s.replace("PRIMARY KEY (id)", "PRIMARY KEY (id, created_at)").replace(
            "PARTITION BY RANGE (id)", "PARTITION BY RANGE (created_at)"
        )
        for s in layout
        if s.startswith(("CREATE TABLE " + table + " ", "CREATE INDEX"))
    ]
    try:
        async with outbox.engine.begin() as conn:
            for statement in old:
                await conn.execute(text(statement.rstrip(";\n")))
        # The table exists: nothing rewritten; DEFAULT and the partitions ahead are made.
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            assert await conn.run_sync(partitions.partition_key, table) == "created_at"
            lo = today - 5 * DAY
            await conn.run_sync(partitions.create_partition_sync, table, lo, lo + DAY)
            found = await conn.run_sync(partitions.list_partitions, table)
        assert (found[0].start, found[0].end) == (lo, lo + DAY)
        assert (found[1].start, found[1].end) == (today, today + DAY)
        assert found[-1].is_default
        ids = await publish(outbox, unique("orders"), 3)
        placed = await where_rows(outbox)
        assert {placed[i] for i in ids} == {partitions.partition_name(table, today)}
        assert await drain(outbox) == 3
        # Retention drops the old created_at partition once its rows are done.
        [old_id] = await publish(outbox, unique("orders"), 1)
        t = outbox.table
        async with outbox.engine.begin() as conn:
            await conn.execute(
                update(t)
                .where(t.c.id == old_id)
                .values(created_at=lo, status="published", published_at=lo)
            )
        assert (await where_rows(outbox))[old_id] == partitions.partition_name(table, lo)
        await outbox.cleaner.run_once()
        assert outbox.cleaner.dropped_partitions == [partitions.partition_name(table, lo)]

        env = {"OUTBOX_PARTITIONING": "daily", "OUTBOX_TABLE_NAME": table}
        doctor = run_cli("doctor", "--url", pg_url, env=env)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert f"table {table} is partitioned by created_at" in doctor.stdout
        assert "primary key is" not in doctor.stdout
    finally:
        async with outbox.engine.begin() as conn:
            await conn.execute(text(f"DROP TABLE IF EXISTS {table} CASCADE"))
        await outbox.aclose()


def single_connection_outbox(pg_url: str) -> tuple[Outbox, Any]:
    """A partitioned outbox on an engine of one connection: its prepared statements are
    every statement the store ran."""
    engine = create_async_engine(pg_url, pool_size=1, max_overflow=0)
    settings = OutboxSettings(run_relays=False, partitioning="daily", notify=False)
    return Outbox(engine, brokers={"default": MemoryBroker()}, settings=settings), engine


def removed(plan: dict[str, Any]) -> int:
    """Scans pruned before the plan's scans were set up ("Subplans Removed"), in all."""
    total, nodes = 0, [plan]
    while nodes:
        node = nodes.pop()
        nodes += node.get("Plans", [])
        total += int(node.get("Subplans Removed", 0))
    return total


async def test_a_drain_claims_from_its_floor_and_a_replayed_row_below_it_still_goes(
    pg_url: str,
) -> None:
    """The claim's floor (storage.partition_map): read after a full claim, the start of the
    oldest partition holding a row that needs work; the partitions below it are pruned
    before the claim's scans are set up; a row that needs work again below it (a replay)
    is claimed as soon as a claim comes back short."""
    outbox, engine = single_connection_outbox(pg_url)
    table = outbox.table.name
    today = midnight(dt.datetime.now(dt.UTC))
    store = outbox.store
    pmap = store.claims.partition_map
    assert pmap is not None
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            for days in (1, 2, 3):
                lo = today - days * DAY
                await conn.run_sync(partitions.create_partition_sync, table, lo, lo + DAY)
        stream = unique("orders")
        # A row backing off in the partition of three days ago: the floor stays there.
        (old,) = await age_rows(
            outbox,
            await publish(outbox, stream, 1),
            created_at=today - 3 * DAY + dt.timedelta(hours=1),
            status="failed",
        )
        # An abandoned one two days ago: replayed below the floor later.
        (done,) = await age_rows(
            outbox,
            await publish(outbox, stream, 1),
            created_at=today - 2 * DAY + dt.timedelta(hours=1),
            status="abandoned",
        )
        await publish(outbox, stream, 6)

        first = await store.claims.claim("default", 2, "t1", 30.0)  # full, without a floor
        assert old in {r.id for r in first}
        await store.claims.release([r.id for r in first if r.id != old], "t1")
        second = await store.claims.claim("default", 2, "t2", 30.0)  # reads the floor first
        assert len(second) == 2
        assert pmap.floor("default") == part_sql.id_bound(today - 3 * DAY)
        await store.claims.mark_published([old], "t1")

        # Read again (a new drain): the oldest partition with work is today's now.
        pmap.claimed("default", uuid.UUID(int=0), full=True)
        assert len(await store.claims.claim("default", 2, "t3", 30.0)) == 2
        assert pmap.floor("default") == part_sql.id_bound(today)
        # The floored claim's generic plan: the three partitions below are pruned before
        # its scans are set up, in its candidate scan and in its update.
        async with store.connector.driver_connection() as driver:
            sql, args = store.connector.compile(
                "explain",
                store.claims.claim_statement("default", 2, False),
                store.claims.claim_params("x", 30.0, pmap.floor("default")),
            )
            plan = await explain_generic(driver, sql, args)
        assert removed(plan) == 6, plan

        assert await store.messages.replay([done]) == [done]  # pending again, below the floor
        # The floored claims take today's last two rows, not it; the next one is short
        # (none left above the floor) and drops the floor; the one after takes it.
        sizes = []
        for n in range(3):
            batch = await store.claims.claim("default", 2, f"t{n + 4}", 30.0)
            sizes.append(len(batch))
            if done in {r.id for r in batch}:
                break
        assert sizes == [2, 0, 1]
        assert pmap.floor("default") == uuid.UUID(int=0)
    finally:
        await outbox.aclose()
        await engine.dispose()


async def test_marks_run_on_the_batch_partition_and_survive_its_drop(pg_url: str) -> None:
    """A batch in one partition is marked by a statement on that partition (a plain
    table's); a batch across partitions by the partitioned table's; a partition dropped
    under the known ranges makes the mark fall back, count what it finds, and forget."""
    outbox, engine = single_connection_outbox(pg_url)
    table = outbox.table.name
    today = midnight(dt.datetime.now(dt.UTC))
    here = partitions.partition_name(table, today)
    gone = partitions.partition_name(table, today - DAY)
    store = outbox.store
    pmap = store.claims.partition_map
    assert pmap is not None
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            lo = today - DAY
            await conn.run_sync(partitions.create_partition_sync, table, lo, lo + DAY)
        stream = unique("orders")
        yesterday = await age_rows(
            outbox,
            await publish(outbox, stream, 2),
            created_at=today - DAY + dt.timedelta(hours=1),
            next_attempt_at=today - dt.timedelta(hours=1),
        )
        fresh = await publish(outbox, stream, 4)
        await pmap.refresh("default")

        rows = await store.claims.claim("default", 10, "tok", 30.0)
        assert {r.id for r in rows} == set(yesterday) | set(fresh)
        assert await store.claims.mark_published(fresh[:2], "tok") == 2  # today's partition
        assert await store.claims.mark_published([yesterday[0], fresh[2]], "tok") == 2  # across
        async with store.connector.driver_connection() as driver:
            prepared = {
                r[0].split(" SET ")[0]
                for r in await driver.fetch(
                    "SELECT statement FROM pg_prepared_statements WHERE statement LIKE 'UPDATE %'"
                )
            }
        assert {f"UPDATE {here}", f"UPDATE {table}"} <= prepared, prepared

        async with outbox.engine.begin() as conn:  # gone meanwhile (an operator's DROP)
            await conn.execute(text(f"ALTER TABLE {table} DETACH PARTITION {gone}"))
            await conn.execute(text(f"DROP TABLE {gone}"))
        assert await store.claims.mark_published([yesterday[1]], "tok") == 0
        assert pmap.partition_of(fresh) is None  # forgotten: read again at the next drain
        assert await store.claims.mark_published([fresh[3]], "tok") == 1
        assert await store.messages.count("published") == 4
    finally:
        await outbox.aclose()
        await engine.dispose()
