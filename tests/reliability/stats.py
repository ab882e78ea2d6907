"""Cases tried per RPC and the statuses they got, printed at the end of the session
(``tests/conftest.py`` calls ``report`` from ``pytest_terminal_summary``)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any

SEEN: dict[str, Counter[str]] = defaultdict(Counter)
STARTED: dict[str, float] = {}
ELAPSED: dict[str, float] = defaultdict(float)


def record(rpc: str, status: str) -> None:
    SEEN[rpc][status] += 1


def report(write_line: Any) -> None:
    if not SEEN:
        return
    write_line("")
    write_line("fuzz: cases tried per RPC and the statuses they got")
    width = max(len(r) for r in SEEN)
    total = 0
    for rpc in sorted(SEEN):
        counts = SEEN[rpc]
        total += sum(counts.values())
        seen = ", ".join(f"{code} {n}" for code, n in counts.most_common())
        write_line(
            f"  {rpc:<{width}}  {sum(counts.values()):>6} cases  {ELAPSED[rpc]:7.1f} s  {seen}"
        )
    write_line(f"  {len(SEEN)} RPCs, {total} cases, {sum(ELAPSED.values()):.1f} s")


class timed:
    """Adds the wall time of a ``with`` block to ``ELAPSED[rpc]``."""

    def __init__(self, rpc: str) -> None:
        self.rpc = rpc

    def __enter__(self) -> None:
        self.t0 = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        ELAPSED[self.rpc] += time.monotonic() - self.t0
