"""Logging helpers: safe error text and an optional JSON formatter.

Every log call of the library names an ``action`` and the ids involved in ``extra=``
(``message_id``, ``broker``, ``count``) and never a payload or a credential. Error texts
come from drivers and brokers we do not control, so they go through `safe_error`
first: credentials are masked (`fastapi_outbox.redaction`, also applied to every
line the formatters below write) and SQLAlchemy's ``[SQL: …]`` / ``[parameters: …]``
tails (which can quote row values) are cut off.

``JsonFormatter`` renders one JSON object per line with the ``extra=`` fields at the top
level, for log shippers: ``handler.setFormatter(JsonFormatter())`` or
``fastapi-outbox --log-format json …``.

(The module is called ``log`` rather than ``logging`` so that ``import logging`` inside the
package never means two things.)
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import traceback
from typing import Any

from fastapi_outbox.redaction import redact

__all__ = [
    "ERROR_MAX_CHARS",
    "JsonFormatter",
    "TextFormatter",
    "redact",
    "safe_error",
    "stack",
]

#: Error texts in logs and health bodies are cut to this many characters.
ERROR_MAX_CHARS = 300

# SQLAlchemy appends the statement and its parameters to DBAPI errors.
_SQLALCHEMY_TAIL = re.compile(r"\s*\[(SQL|parameters): .*", re.DOTALL)
_BACKGROUND = re.compile(r"\s*\(Background on this error at: [^)]*\)")

#: Attributes every ``LogRecord`` has; anything else came through ``extra=``.
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "extras",
    "taskName",
}


def _unwrap(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one, as task groups raise."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def safe_error(exc: BaseException, limit: int = ERROR_MAX_CHARS) -> str:
    """``Type: message`` of ``exc`` for logs, ``last_error`` and health bodies: no
    credentials, no SQL parameters, bounded length."""
    exc = _unwrap(exc)
    text = str(exc)
    text = _BACKGROUND.sub("", _SQLALCHEMY_TAIL.sub("", text))
    text = redact(" ".join(text.split()))
    out = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."


def stack(exc: BaseException, frames: int = 6) -> str:
    """Where ``exc`` was raised: the innermost ``frames`` frames as ``file:line func``,
    innermost last. A traceback without the exception's text, which may quote data."""
    summary = traceback.extract_tb(_unwrap(exc).__traceback__)[-frames:]
    return " < ".join(
        f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(summary)
    )


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of ``record``."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS}


def _jsonable(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, int | float | bool):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return redact(str(value))


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``message``, the
    ``extra=`` fields (``action``, ``broker``, ``message_id``…) and ``exc_type`` /
    ``exc`` when an exception is attached (its text passed through `safe_error`;
    tracebacks are left out on purpose: frames can hold payloads)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for key, value in extras(record).items():
            data.setdefault(key, _jsonable(value))
        if record.exc_info and record.exc_info[1] is not None:
            data["exc_type"] = type(record.exc_info[1]).__name__
            data["exc"] = safe_error(record.exc_info[1])
        return json.dumps(data, separators=(",", ":"), default=str)


#: Characters that would end or bend a log line: C0/C1 controls (CR, LF, ESC…) and the
#: Unicode line and paragraph separators.
_LINE_BREAKING = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: A field value shown bare; anything else is quoted, so ``operator="a b=c"`` stays one field.
_BARE_VALUE = re.compile(r"[^\s=\"]*")


def one_line(text: str) -> str:
    """``text`` with every character that could start a new log line (or move the cursor
    of a terminal) written as an escape: a value from a request — an operator name, a
    reason — can never forge a line of its own."""
    return _LINE_BREAKING.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def _field(value: Any) -> str:
    text = str(value)
    if _BARE_VALUE.fullmatch(text):
        return one_line(text)
    return one_line(json.dumps(text, ensure_ascii=False))  # quoted, controls escaped


class TextFormatter(logging.Formatter):
    """``time level logger message key=value…``: the ``extra=`` fields appended. The
    message and the fields are kept on their line (controls escaped, a field with spaces
    quoted); an exception's traceback follows on lines that start with ``  | ``, so no
    line of it can pass for a record of its own."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{self.formatTime(record, self.datefmt)} {record.levelname} {record.name} "
            f"{one_line(record.getMessage())}"
        )
        fields = extras(record)
        if fields:
            line += "".join(f" {k}={_field(v)}" for k, v in fields.items())
        tail = ""
        if record.exc_info and record.exc_info[1] is not None:
            tail += self.formatException(record.exc_info)
        if record.stack_info:
            tail += ("\n" if tail else "") + self.formatStack(record.stack_info)
        if tail:
            line += "".join(f"\n  | {one_line(part)}" for part in tail.splitlines())
        return redact(line)
