"""How many CPU cores other processes keep busy: what a second torch thread would
have to share.

A torch op on two threads finishes when both threads have done their half; on a
host whose other core is busy with another process, the second half waits for
the scheduler to give that core back, and every op of a step pays it. Measured
on a 2-core host with two other busy processes: a forward_backward on two
threads took 31x as long per token as on one, a sampler prefill 750x. Trying
two threads there to find out costs seconds per try, so the engine looks first
(``pass_threads``): where fewer cores are spare than its threads, it runs on as
many threads as there are spare cores, without trying more.

Read from ``/proc`` (Linux): the busy time of the cores this process may run on
(its affinity: a container's cpuset) since the last look, less this process's own (every thread of it, which the engine's choices already
account for). Elsewhere, or before two looks, nothing is known (``None``).
"""

from __future__ import annotations

import os
import threading
import time

#: the shortest window a reading averages over (a shorter one is noise)
MIN_WINDOW_S = 0.25
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (a container's cpuset, ``taskset``)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def _host_busy_s(cpus: frozenset[int]) -> float | None:
    """Seconds the CPUs ``cpus`` have spent busy since boot (only those: on a
    shared node, a container's cores are what its threads would share, not the
    node's others)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy, seen = 0, False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
        ticks = [int(x) for x in rest.split()[:8]]
        busy += sum(ticks) - ticks[3] - ticks[4]
        seen = True
    return busy / _CLOCK_TICKS if seen else None


def _own_busy_s() -> float:
    """Seconds this process (all its threads) has spent on a CPU."""
    t = os.times()
    return t.user + t.system


class HostLoad:
    """The cores other processes kept busy, averaged since the previous reading
    (at least ``MIN_WINDOW_S`` ago); thread-safe."""

    def __init__(self) -> None:
        self.cpus = usable_cpus()
        self.cores = len(self.cpus)
        self._lock = threading.Lock()
        self._last: tuple[float, float, float] | None = None
        self._others: float | None = None
        self._sample()

    def _sample(self) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < MIN_WINDOW_S:
            return  # too short a window: the last reading stands (and /proc is not read)
        host = _host_busy_s(self.cpus)
        if host is None:
            return
        own = _own_busy_s()
        if self._last is not None:
            t0, host0, own0 = self._last
            others = (host - host0) - (own - own0)
            self._others = max(0.0, others / (now - t0))
        self._last = (now, host, own)

    def others_busy(self) -> float | None:
        """Cores other processes kept busy lately (None: not known here)."""
        with self._lock:
            self._sample()
            return self._others

    def spare_cores(self) -> float | None:
        """Cores no other process used lately (None: not known here)."""
        others = self.others_busy()
        return None if others is None else max(0.0, self.cores - others)


#: the process's one reader (the engine's passes and the sampler's steps share it)
HOST = HostLoad()
