"""Example service: ``python -m examples.orders``."""
