"""What the Redis publisher and consumer agree on about Redis itself: which reply errors
are broker-wide refusals (an outage of the broker, not a fault of a message)."""

from __future__ import annotations

__all__ = ["REFUSAL_CODES", "refusal_code"]

#: Error codes with which Redis refuses *every* write for a reason of its own: out of
#: memory, a read-only replica (after a failover), a failed RDB save (``MISCONF``), a
#: dataset still loading, a busy script, a cluster without quorum or mid-resharding. They
#: are outages of the broker, not faults of a message: the processor backs off as a whole
#: and no attempt is charged.
REFUSAL_CODES = frozenset(
    {
        "OOM",
        "READONLY",
        "MISCONF",
        "LOADING",
        "BUSY",
        "CLUSTERDOWN",
        "TRYAGAIN",
        "MASTERDOWN",
        "NOREPLICAS",
        "NOTREADY",
    }
)


def refusal_code(error: BaseException | str) -> str | None:
    """The code of a broker-wide refusal in ``error``, else None: the one place where
    Redis errors are told apart. ``error`` is a reply error from redis-py (which strips
    known codes from the text into ``status_code``) or the ``"!<error>"`` text the
    publish script returns for an XADD that Redis refused."""
    code = getattr(error, "status_code", None)
    if not code:
        text = str(error).lstrip("!").lstrip()
        code = text.split(" ", 1)[0]
    code = str(code)  # Redis error codes are upper case: "oom" in a text is not one
    return code if code in REFUSAL_CODES else None
