"""Storage: everything that speaks SQL to the outbox's own tables.

It owns the engine factory (``engine``) and the dialect checks (``dialects``), the driver
plumbing (``connector``: the hot statements on asyncpg, and the connections the long
sessions — LISTEN, NOTIFY, the WAL reader — hold), the outbox table's storage split by job
(``claims``: the relay's claims and marks; ``inserts``: rows written; ``messages``: operator
reads and actions, filtered by one ``filters.MessageFilter``; ``retention`` and ``archive``;
``store`` hands each job its object and runs the schema), every statement grouped by what
it does (``statements``), the read models the counts are folded into (``read_models``), the table
layouts (``schema``, with its column ``types``), time partitions, the inbox table, the
schema doctor, the PostgreSQL WAL slot, the database clock (``clock``: SQL expressions for
"now" on each dialect) and the one classifier of database outages per dialect
(``db_outage``). It imports only the kernel; relays, writers, consumers and operations call
it.
"""
