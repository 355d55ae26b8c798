from __future__ import annotations

from fastapi_outbox.cli import main

raise SystemExit(main())
