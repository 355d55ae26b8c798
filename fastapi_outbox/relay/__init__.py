"""Relay: moving committed outbox rows to the brokers.

It owns the loop every relay shares (``loop``: pause on a broker or database outage, hooks,
the envelope of a row), the table relay that claims rows and publishes them (``table``),
the WAL relay that reads the PostgreSQL replication slot (``wal``), the wake-ups that end a
poll early and the after-commit policy that sends them (``wakeups``), and the relays of one
outbox with the wake-ups a commit sends them (``relays``). Starting and stopping them is
the lifecycle's (`fastapi_outbox.lifecycle`). It imports the kernel, ``storage`` and
``brokers.base``.
"""
