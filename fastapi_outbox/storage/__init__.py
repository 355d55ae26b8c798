"""Storage: everything that speaks SQL to the outbox's own tables.

It owns the engine factory and the dialect checks (``engine``), the driver plumbing that
runs the hot statements on asyncpg (``connector``), every statement grouped by its caller
(``statements``: the relays, the unit of work, retention, operations, wake-ups, the WAL
slot), the facade that runs them (``store``), the table layouts (``schema``), time
partitions, the inbox table, the schema doctor, the PostgreSQL WAL slot, the database clock
(``clock``: SQL expressions for "now" on each dialect, kept here because they are column
expressions over ``schema`` types) and the one classifier of database outages per dialect
(``db_outage``). It imports only the kernel; relays, writers, consumers and operations call it.
"""
