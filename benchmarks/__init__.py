"""Benchmarks of fastapi-outbox (run with ``nox -s bench``; see benchmarks/README.md)."""
