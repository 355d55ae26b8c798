"""Storage: everything that speaks SQL to the outbox's own tables.

It owns the engine-facing statements (``store``), the table layouts (``schema``), time
partitions, the inbox table, the schema doctor, the PostgreSQL WAL slot, the database clock
(``clock``: SQL expressions for "now" on each dialect, kept here because they are column
expressions over ``schema`` types) and the one classifier of database outages per dialect
(``db_outage``). It imports only the kernel; relays, writers, consumers and operations call it.
"""
