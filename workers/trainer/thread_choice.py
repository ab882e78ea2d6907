"""How many torch threads a training pass gets: measured on this machine, not guessed.

A ``forward_backward`` of 32 tokens on a 5M-parameter model is thousands of
small ops. Whether a second thread pays for waking it on every op depends on
the machine and on how OpenMP waits (``OMP_WAIT_POLICY``): on one 2-core
machine with sleeping waits, one thread ran such calls 1.5-2.7x faster than
two; on another with spinning waits, two threads were 1.15x faster. A fixed
size threshold is right on one machine and wrong on the next, so the engine
measures instead.

Calls are grouped by kind and size (``work`` = tokens x parameters, in
half-octave buckets). In a bucket the first calls alternate between one thread
and all of them until each has ``trials`` timings; after that every call takes
the one with the lower median time per unit of work over its last ``window``
timings. Now and then a call runs the other option once, so a change in the
machine's load is noticed: after ``recheck_every`` calls, and then twice as
many calls after each recheck that confirmed the choice (up to
``max_recheck_every``), since a recheck costs a slow call. Pure bookkeeping:
no torch, no clock; the engine times the calls and reports them (``record``).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("treadle.engine")

#: the engine's policies: measure per bucket, or always all threads, or always one
#: (the choices of ``--training-threads``; this module imports no torch)
POLICIES: tuple[str, ...] = ("measure", "all", "one")


@dataclass
class _Bucket:
    rates: dict[int, deque[float]] = field(default_factory=dict)  # threads -> seconds / work
    best: int = 0  # the choice when last decided (0: not yet)
    until_recheck: int = 0
    recheck_every: int = 0


class ThreadChoice:
    def __init__(
        self,
        policy: str = "measure",
        *,
        trials: int = 3,
        window: int = 5,
        recheck_every: int = 20,
        max_recheck_every: int = 640,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"thread policy must be one of {POLICIES}, got {policy!r}")
        if not 1 <= trials <= window:
            raise ValueError("need 1 <= trials <= window")
        self.policy = policy
        self.trials = trials
        self.window = window
        self.recheck_every = recheck_every
        self.max_recheck_every = max(recheck_every, max_recheck_every)
        self._buckets: dict[tuple[str, int, int], _Bucket] = {}

    def threads(self, kind: str, work: float, available: int) -> int:
        """The thread count for a call of ``kind`` and ``work`` with ``available`` threads."""
        if available <= 1 or work <= 0 or self.policy == "all":
            return available
        if self.policy == "one":
            return 1
        bucket = self._bucket(kind, work, available)
        options = (1, available)
        counts = {n: len(bucket.rates.setdefault(n, deque(maxlen=self.window))) for n in options}
        if min(counts.values()) < self.trials:
            # Exploring: the option with fewer timings (one thread first).
            return min(options, key=lambda n: counts[n])
        best = min(options, key=lambda n: statistics.median(bucket.rates[n]))
        if best != bucket.best:  # decided for the first time, or changed its mind
            log.info(
                "training threads: %s calls of ~%.2g tokens x params run on %d (median ms "
                "per 1e9 tokens x params: %s)",
                kind,
                work,
                best,
                ", ".join(
                    f"{n} thread{'s' * (n > 1)} {statistics.median(bucket.rates[n]) * 1e12:.3g}"
                    for n in options
                ),
            )
            bucket.best, bucket.recheck_every = best, self.recheck_every
            bucket.until_recheck = bucket.recheck_every
        bucket.until_recheck -= 1
        if bucket.until_recheck > 0:
            return best
        # Recheck the other option; if the choice holds, wait twice as long next time.
        bucket.recheck_every = min(2 * bucket.recheck_every, self.max_recheck_every)
        bucket.until_recheck = bucket.recheck_every
        return available if best == 1 else 1

    def record(self, kind: str, work: float, available: int, threads: int, seconds: float) -> None:
        """A call chosen by ``threads(kind, work, available)`` ran ``seconds`` on ``threads``."""
        if self.policy != "measure" or available <= 1 or work <= 0:
            return
        bucket = self._bucket(kind, work, available)
        rates = bucket.rates.setdefault(threads, deque(maxlen=self.window))
        rates.append(seconds / work)

    def _bucket(self, kind: str, work: float, available: int) -> _Bucket:
        key = (kind, round(2 * math.log2(work)), available)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        return bucket
