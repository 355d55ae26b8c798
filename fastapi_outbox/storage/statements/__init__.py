"""The SQL statements, one module per job, each named by what its statements do.

Each module holds its statements as constants or pure functions that build them, each with
a comment saying why each part of the statement is there: ``claims`` (claiming rows and
marking them published, failed, released), ``inserts`` (the unit of work's INSERT),
``purge`` (retention's batched delete), ``messages`` (counts, listings, one message, an
operator's replay, cancel and abandon), ``notify`` (NOTIFY), ``archive`` (moving rows to
the archive table), ``wal`` (the WAL slot and capture), ``partitions`` (partition upkeep),
``schema_check`` (the catalogue reads of ``doctor`` and the fixes of ``db upgrade``) and
``session`` (SQLite's session settings, the outage ping); ``parts`` holds the pieces they
share. The storage job objects
(`fastapi_outbox.storage.claims`, ``inserts``, ``messages``, ``retention``,
``archive``), the partition maintainer, the doctor, the WAL slot and the engine run them;
the inbox table (`fastapi_outbox.storage.inbox`) keeps its own few statements beside
its layout; nothing outside ``storage/`` writes SQL.
"""
