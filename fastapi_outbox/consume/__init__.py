"""Consume: running the application's handlers on messages from the brokers.

It owns the subscriber options, handler inspection, per-message and batch processing with
the idempotent inbox, and the loop that fetches from a broker's consumer (``subscriber``;
split into those parts in a later step). It imports the kernel, ``storage``, the broker
ports (``brokers.base``, ``brokers.consumer``) and ``write``.
"""
