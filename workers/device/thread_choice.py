"""How many torch threads a training pass or a sampler step gets: measured on this
machine, not guessed.

A ``forward_backward`` of 32 tokens on a 5M-parameter model is thousands of
small ops. Whether a second thread pays for waking it on every op depends on
the machine and on how OpenMP waits (``OMP_WAIT_POLICY``): on one 2-core
machine with sleeping waits, one thread ran such calls 1.5-2.7x faster than
two; on another with spinning waits, two threads were 1.15x faster. A fixed
size threshold is right on one machine and wrong on the next, so the engine
measures instead.

The same holds for the sampler's steps, and more so on a busy host: with two
other busy processes beside a 2-core engine, a sampler step on two threads took
3-10x as long as on one (the threads wait for each other's core), while on an
idle host a 110M model's step is faster on two.

Calls are grouped by kind and size (``work`` = tokens x parameters, in
half-octave buckets). In a bucket the first calls alternate between all
threads (what an unmeasured call would get) and one, until each has ``trials``
timings, or until one timing each already shows one option ``decisive`` times
faster than the other (a 110M-parameter pass on one thread of two costs about
twice the time: three such explorations would cost a short run a third of its
time); after that every call takes the one with the lower median time per unit
of work over its last ``window`` timings. Now and then a call runs the other option once, so a change in the
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


#: (kind, half-octave of the work, threads available)
_Key = tuple[str, int, int]


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
        label: str = "training",
        trials: int = 3,
        window: int = 5,
        decisive: float = 1.5,
        recheck_every: int = 20,
        max_recheck_every: int = 640,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"thread policy must be one of {POLICIES}, got {policy!r}")
        if not 1 <= trials <= window:
            raise ValueError("need 1 <= trials <= window")
        if decisive <= 1.0:
            raise ValueError("need decisive > 1")
        self.policy = policy
        self.label = label
        self.trials = trials
        self.decisive = decisive
        self.window = window
        self.recheck_every = recheck_every
        self.max_recheck_every = max(recheck_every, max_recheck_every)
        self._buckets: dict[_Key, _Bucket] = {}

    def threads(self, kind: str, work: float, available: int) -> int:
        """The thread count for a call of ``kind`` and ``work`` with ``available`` threads."""
        if available <= 1 or work <= 0 or self.policy == "all":
            return available
        if self.policy == "one":
            return 1
        key = self._key(kind, work, available)
        bucket = self._buckets.setdefault(key, _Bucket())
        options = (available, 1)
        rates = {n: bucket.rates.setdefault(n, deque(maxlen=self.window)) for n in options}
        if not bucket.best:
            inherited = self._inherited(key)
            if inherited:
                self._decide(bucket, inherited, key, work, "as the calls beside it")
            elif min(len(r) for r in rates.values()) < self.trials and not self._decisive(rates):
                # Exploring: the option with fewer timings (all threads first).
                return min(options, key=lambda n: len(rates[n]))
        if all(rates.values()):
            best = min(options, key=lambda n: statistics.median(rates[n]))
            if best != bucket.best:  # decided for the first time, or changed its mind
                medians = ", ".join(
                    f"{n} thread{'s' * (n > 1)} {statistics.median(rates[n]) * 1e12:.3g}"
                    for n in sorted(options)
                )
                self._decide(
                    bucket, best, key, work, f"median ms per 1e9 tokens x params: {medians}"
                )
        bucket.until_recheck -= 1
        if bucket.until_recheck > 0:
            return bucket.best
        # Recheck the other option; if the choice holds, wait twice as long next time.
        bucket.recheck_every = min(2 * bucket.recheck_every, self.max_recheck_every)
        bucket.until_recheck = bucket.recheck_every
        return available if bucket.best == 1 else 1

    def _decide(self, bucket: _Bucket, best: int, key: _Key, work: float, why: str) -> None:
        log.info(
            "%s threads: %s calls of ~%.2g tokens x params run on %d (%s)",
            self.label,
            key[0],
            work,
            best,
            why,
        )
        bucket.best, bucket.recheck_every = best, self.recheck_every
        bucket.until_recheck = bucket.recheck_every

    def _decisive(self, rates: dict[int, deque[float]]) -> bool:
        """Whether one timing each already tells the options apart by ``decisive`` times."""
        if not all(rates.values()):
            return False
        fast, slow = sorted(statistics.median(r) for r in rates.values())
        return slow >= self.decisive * fast

    def _inherited(self, key: _Key) -> int:
        """A new bucket's choice where its neighbours of the same kind settle it: one
        thread if a call at least as large runs on one, all if a call at most as large
        runs on all (more work per op only favours more threads); 0 where they do not
        settle it (none decided, or they disagree)."""
        kind, size, available = key
        votes = set()
        for (k, s, a), other in self._buckets.items():
            if (k, a) != (kind, available) or not other.best:
                continue
            if other.best == 1 and s >= size:
                votes.add(1)
            elif other.best == available and s <= size:
                votes.add(available)
        return votes.pop() if len(votes) == 1 else 0

    def record(self, kind: str, work: float, available: int, threads: int, seconds: float) -> None:
        """A call chosen by ``threads(kind, work, available)`` ran ``seconds`` on ``threads``."""
        if self.policy != "measure" or available <= 1 or work <= 0:
            return
        bucket = self._buckets.setdefault(self._key(kind, work, available), _Bucket())
        rates = bucket.rates.setdefault(threads, deque(maxlen=self.window))
        rates.append(seconds / work)

    @staticmethod
    def _key(kind: str, work: float, available: int) -> _Key:
        return kind, round(2 * math.log2(work)), available
