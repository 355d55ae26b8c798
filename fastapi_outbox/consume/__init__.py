"""Consume: running the application's handlers on messages from the brokers.

It owns the subscriber options and their checks (``options``), handler inspection and
decoding (``handlers``), the handler's transaction with the idempotent inbox and one
delivery's retries and dead letter (``processing``), fetched batches and a batch handler's
retries (``batches``), and the fetch loop with the ``Subscriber`` that composes them
(``subscriber``). What it uses of its outbox is a ``ConsumeContext`` (``context``) the
composition root builds; it imports the kernel, ``storage``, the broker ports
(``brokers.base``, ``brokers.consumer``) and ``write`` (handlers' units of work).
"""
