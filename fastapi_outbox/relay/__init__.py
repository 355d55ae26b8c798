"""Relay: moving committed outbox rows to the brokers.

It owns the loop every relay shares (``loop``: supervision, pause on a database outage,
hooks), the table relay that claims rows and publishes them (``table``), the WAL relay that
reads the PostgreSQL replication slot (``wal``), the wake-ups that end a poll early
(``wakeups``) and the retention sweep of published rows (``retention``). It imports the
kernel, ``storage`` and ``brokers.base``.
"""
