"""Lifecycle: how an outbox's long-running side starts and stops in a process.

It owns the one supervision loop that starts and stops the relays, the subscribers and
retention (``supervisor``: `Lifecycle`), the
consumer groups declared before the first publish (``groups``) and the scheduling of the
retention sweep (``retention``; its statements are ``storage``'s). It imports ``consume``
(the subscribers it runs and declares groups for), ``relay``, ``storage`` and the kernel.
"""
