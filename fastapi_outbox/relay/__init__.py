"""Relay: moving committed outbox rows to the brokers.

It owns the loop every relay shares (``loop``: pause on a broker or database outage, hooks,
the envelope of a row), the one supervision loop that starts and stops every relay,
subscriber, listener and retention task (``supervisor``), the table relay that claims rows
and publishes them (``table``), the WAL relay that reads the PostgreSQL replication slot
(``wal``), the wake-ups that end a poll early and the after-commit policy that sends them
(``wakeups``), consumer groups declared before the first publish (``groups_first``) and the
retention sweep of published rows (``retention``). It imports the kernel, ``storage`` and
``brokers.base``.
"""
