"""The per-unit-of-work cost of noting the active unit of work in a context variable.

Every unit of work (a request's, a handler's) marks itself active on its session when its
block begins and inactive when it ends (``SessionState.push_publisher`` / ``pop_publisher``);
they also keep a tuple of the active units of work in a ``ContextVar``, so that an event
raised on an aggregate in no session can be checked at the commit (it would be lost). This
prints the time of one begin + end with that bookkeeping (library) against the same list
push and pop without it (hand-written baseline), in alternating rounds, and the difference
per unit of work. No server: CPU only.

    python benchmarks/unit_of_work_scope.py            # 7 rounds of 200,000
    python benchmarks/unit_of_work_scope.py --quick    # 3 rounds of 50,000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import fmt, median, table
from fastapi_outbox.write.session_events import SessionState


def _library(n: int) -> float:
    state = SessionState()

    def publish(event: object) -> None:
        pass

    start = time.perf_counter()
    for _ in range(n):
        state.push_publisher(publish)
        state.pop_publisher(publish)
    return time.perf_counter() - start


class _Publishers:
    """The begin and end of a unit of work without the context variable (the session
    state's publisher stack, as it was)."""

    def __init__(self) -> None:
        self._publishers: list[object] = []

    def push_publisher(self, publish: object) -> None:
        self._publishers.append(publish)

    def pop_publisher(self, publish: object) -> None:
        for i in range(len(self._publishers) - 1, -1, -1):
            if self._publishers[i] == publish:
                del self._publishers[i]
                break


def _baseline(n: int) -> float:
    state = _Publishers()

    def publish(event: object) -> None:
        pass

    start = time.perf_counter()
    for _ in range(n):
        state.push_publisher(publish)
        state.pop_publisher(publish)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 rounds of 50,000")
    args = p.parse_args(argv)
    rounds, n = (3, 50_000) if args.quick else (7, 200_000)
    library: list[float] = []
    baseline: list[float] = []
    for _ in range(rounds):  # alternating rounds: A B A B ...
        library.append(_library(n) / n * 1e9)
        baseline.append(_baseline(n) / n * 1e9)
    lib, base = median(library), median(baseline)
    print("== begin + end of one unit of work (ns, medians) ==")
    print(
        table(
            ["variant", "ns per unit of work"],
            [["library (with the context variable)", fmt(lib)], ["baseline", fmt(base)]],
        )
    )
    print(f"added per unit of work: {fmt(lib - base)} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
