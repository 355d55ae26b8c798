"""The SQL statements, one module per caller.

Each module holds the statements of one part of the package as constants or pure functions
that build them, each with a comment naming its caller and why each part of the statement
is there: ``relay`` (the table relay's claim and marks), ``write`` (the unit of work's
INSERT), ``retention``, ``operations`` (operators, the dashboard, health, the CLI),
``wakeups`` (NOTIFY), ``wal`` (the WAL slot and capture), ``partitions`` (partition upkeep),
``doctor`` (``doctor`` and ``db upgrade``) and ``engine`` (SQLite's session settings, the
outage ping); ``parts`` holds the pieces they share. The store
(:class:`~fastapi_outbox.storage.store.Store`), the partition maintainer, the doctor, the
WAL slot and the engine run them; the
inbox table (:mod:`fastapi_outbox.storage.inbox`) keeps its own few statements beside its
layout; nothing outside ``storage/`` writes SQL.
"""
