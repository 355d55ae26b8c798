"""The example is a model FastAPI service: schemathesis fuzzes its OpenAPI document
— every operation, the dashboard's behind its guard and CSRF check — and no request gets a
5xx or a status the document does not list. On SQLite and on PostgreSQL, whose column types
(``integer`` ids, ``varchar(n)``, no NUL in text) the request models must respect.

The fuzzing runs in a process of its own (``fuzz_example.py``): the example reads
``DATABASE_URL`` when it is imported. Bounded: 12 derandomized examples per operation
(``FUZZ_MAX_EXAMPLES``), about 10 s per database.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_request_gets_a_server_error_or_an_undocumented_status(
    db_url: str, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "BROKER_URL": "memory://",
        "DASHBOARD_TOKEN": "fuzz-dashboard-token",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "acceptance" / "fuzz_example.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-6000:]}"
    summary = re.search(r"^(\d+) operations, (\d+) failed$", result.stdout, re.M)
    assert summary, result.stdout
    assert int(summary[1]) >= 15 and int(summary[2]) == 0, result.stdout
