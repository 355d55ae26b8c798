"""Write: the path from a route handler to committed outbox rows.

It owns the unit of work (``unit_of_work``: the FastAPI dependency and its transaction), the
SQLAlchemy session hooks that collect raised events (``session_events``) and the captures
that turn them into rows: the outbox table (``capture``) or the PostgreSQL WAL
(``wal_capture``). The unit of work sees its outbox through a small port (``context``:
``WriteContext``), never ``Outbox``. It imports the kernel, ``storage`` and ``brokers.base``.
"""
