"""Canonical: fastapi_outbox.write.unit_of_work (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.write.unit_of_work import UnitOfWork, UnitOfWorkDep, unit_of_work

__all__ = ["UnitOfWork", "UnitOfWorkDep", "unit_of_work"]
