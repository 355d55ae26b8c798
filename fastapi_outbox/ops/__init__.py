"""Ops: what an operator does with an outbox, through code, HTTP or the command line.

It owns the operations (``operations``: list, show, replay, abandon, cancel, purge), the
health and readiness probes (``health``), the Prometheus and OpenTelemetry metrics
(``metrics``) and the HTML dashboard (``dashboard``). It may import everything below it but
``outbox``: it sees an outbox through its read/act port (``port.OutboxPort``), which
``Outbox`` satisfies structurally (the import-linter contract in pyproject.toml keeps it so).
"""
