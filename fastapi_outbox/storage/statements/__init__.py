"""The SQL statements, one module per caller.

Each module holds the statements of one part of the package (the relays, the unit of work,
the subscribers' inbox, the operations and the dashboard, retention, the CLI) as functions
that build or run them, each with a comment naming its caller and why each part of the
statement is there. :class:`fastapi_outbox.storage.store.Store` composes them; nothing
outside ``storage/`` writes SQL.
"""
