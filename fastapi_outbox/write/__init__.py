"""Write: the path from a route handler to committed outbox rows.

It owns the unit of work (``unit_of_work``: the FastAPI dependency, its transaction, and the
handler's transaction that ``outbox.unit_of_work()`` joins inside a subscriber's handler),
the outbox's write side a unit of work publishes through (``producer``), the SQLAlchemy
session hooks that collect raised events (``session_events``) and the captures that turn
them into rows: the outbox table (``capture``) or the PostgreSQL WAL (``wal_capture``). A
request's unit of work goes down only: it imports the kernel, ``payloads``, ``storage``,
``brokers`` (names, setup) and ``relay`` (the relays a commit wakes).
"""
