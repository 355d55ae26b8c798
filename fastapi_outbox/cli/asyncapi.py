"""``fastapi-outbox asyncapi --app module:outbox``: print the app's AsyncAPI 3.1 document.

The document is built from what the app declares (events, subscribers, brokers) by
`fastapi_outbox.ops.asyncapi.build_asyncapi`; nothing is connected to.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fastapi_outbox.cli.support import EXIT_OK

__all__ = ["add_command", "run"]


def add_command(sub: Any) -> None:
    """Add the ``asyncapi`` command to the ``fastapi-outbox`` sub-parsers."""
    command = sub.add_parser(
        "asyncapi", help="print the AsyncAPI 3.1 document of the app's events (JSON)"
    )
    command.add_argument("--app", required=True, help="module:attribute naming an Outbox")
    command.add_argument("--title", default="fastapi-outbox events", help="info.title")
    command.add_argument("--version", dest="doc_version", default="1.0.0", help="info.version")


def run(args: argparse.Namespace, outbox: Any) -> int:
    """Print the document of ``outbox`` (loaded from ``--app`` by the caller)."""
    document = outbox.asyncapi(title=args.title, version=args.doc_version)
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK
