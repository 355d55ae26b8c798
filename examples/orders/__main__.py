"""``python -m examples.orders``: the orders service on http://127.0.0.1:8000."""

from __future__ import annotations

import logging
import os

import uvicorn

from examples.orders.app import (
    BROKER_URL,
    DASHBOARD_TOKEN,
    DASHBOARD_TOKEN_GENERATED,
    DATABASE_URL,
    app,
)
from fastapi_outbox.brokers import redact_url


def main() -> None:
    host = os.environ.get("HOST", "127.0.0.1")
    port = int(os.environ.get("PORT", "8000"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    print(f"orders service on {redact_url(DATABASE_URL)} with broker {redact_url(BROKER_URL)}")
    print(
        f"  place an order:  curl -s -X POST http://{host}:{port}/orders "
        '-H \'content-type: application/json\' -d \'{"customer": "ada", "total": 42}\''
    )
    print(f"  see it published: curl -s http://{host}:{port}/published")
    print(f"  its invoice:      curl -s http://{host}:{port}/invoices")
    print(f"  outbox health:    curl -s http://{host}:{port}/outbox/health")
    # Only a token made up at start is printed: one set in DASHBOARD_TOKEN is the user's
    # secret and never reaches a terminal or a log collector.
    password = DASHBOARD_TOKEN if DASHBOARD_TOKEN_GENERATED else "the DASHBOARD_TOKEN you set"
    print(
        f"  dashboard:        http://{host}:{port}/outbox/dashboard "
        f"(user admin, password {password}"
        + ("; set DASHBOARD_TOKEN to choose it)" if DASHBOARD_TOKEN_GENERATED else ")")
    )
    uvicorn.run(app, host=host, port=port, log_level="info")


if __name__ == "__main__":
    main()
