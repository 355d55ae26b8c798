"""Storage: everything that speaks SQL to the outbox's own tables.

It owns the engine factory (``engine``) and the dialect checks (``dialects``), the driver
plumbing (``connector``: the hot statements on asyncpg, and the connections the long
sessions — LISTEN, NOTIFY, the WAL reader — hold), every statement grouped by its caller
(``statements``: the relays, the unit of work, retention, operations, wake-ups, the WAL
slot, partition upkeep, the doctor, the engine's session settings), the facade that runs
them (``store``) and the read models it folds their rows into (``read_models``), the table
layouts (``schema``, with its column ``types``), time partitions, the inbox table, the
schema doctor, the PostgreSQL WAL slot, the database clock (``clock``: SQL expressions for
"now" on each dialect) and the one classifier of database outages per dialect
(``db_outage``). It imports only the kernel; relays, writers, consumers and operations call
it.
"""
