"""The engine's queues as its operators see them: calls waiting per tenant, how
long each waited before it ran, and the bytes of checkpoints written.

Written by the engine thread, read by a metrics scrape on another (hence the
lock). A call is counted from its admission to the scheduler until it starts to
run, or until it is answered without running (timed out, its model deleted or
unloaded, the engine stopping).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

#: upper bounds (seconds) of the wait histogram's buckets (a last one is +Inf)
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class WaitHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS_S) + 1))
    total_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(WAIT_BUCKETS_S, seconds)] += 1
        self.total_s += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, calls at or under it), as a Prometheus histogram's buckets."""
        out, running = [], 0
        for bound, n in zip((*map(str, WAIT_BUCKETS_S), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(frozen=True)
class CallStatsSnapshot:
    queued: dict[str, int]  # tenant -> calls waiting now
    waits: dict[str, WaitHistogram]  # tenant -> waits of the calls that ran
    checkpoints: int
    checkpoint_bytes: int


class CallStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, int], tuple[str, float]] = {}
        self._waits: dict[str, WaitHistogram] = {}
        self._checkpoints = 0
        self._checkpoint_bytes = 0

    def queued(self, model_id: str, seq_id: int, tenant_id: str, arrived_at: float) -> None:
        with self._lock:
            self._waiting[(model_id, seq_id)] = (tenant_id, arrived_at)

    def started(self, model_id: str, seq_id: int) -> None:
        now = time.monotonic()
        with self._lock:
            entry = self._waiting.pop((model_id, seq_id), None)
            if entry is not None:
                tenant, arrived = entry
                self._waits.setdefault(tenant, WaitHistogram()).add(max(0.0, now - arrived))

    def dropped(self, model_id: str, seq_id: int) -> None:
        with self._lock:
            self._waiting.pop((model_id, seq_id), None)

    def checkpoint(self, size_bytes: int) -> None:
        with self._lock:
            self._checkpoints += 1
            self._checkpoint_bytes += size_bytes

    def snapshot(self) -> CallStatsSnapshot:
        with self._lock:
            queued = Counter(tenant for tenant, _ in self._waiting.values())
            waits = {t: WaitHistogram(list(h.counts), h.total_s) for t, h in self._waits.items()}
            return CallStatsSnapshot(dict(queued), waits, self._checkpoints, self._checkpoint_bytes)
