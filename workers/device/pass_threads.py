"""A training pass or a sampler step on the torch thread count ``ThreadChoice``
picks for it, on the CPU only: on a GPU the torch threads do not run the pass,
so there is no choice to make (and no measuring).

Under ``"measure"`` the choice is among the threads the host can give: where
other processes keep cores busy (``host_load``), a pass runs on at most as many
threads as there are spare cores, and is not tried on more (each such try cost
seconds on a busy host)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from treadle.workers.device import device, host_load
from treadle.workers.device.host_load import HostLoad
from treadle.workers.device.thread_choice import ThreadChoice


@contextlib.contextmanager
def pass_threads(
    choice: ThreadChoice,
    where: torch.device,
    kind: str,
    work: float,
    host: HostLoad | None = None,
) -> Iterator[None]:
    """Run the pass (``work`` = tokens x parameters) on the thread count ``choice``
    picks for its kind and size, and report its time (only when it ends without
    raising). ``host``: where to read the spare cores (the process's reader)."""
    if not device.is_cpu_only(where):
        yield
        return
    available = torch.get_num_threads()
    usable = available
    if choice.policy == "measure" and available > 1:
        spare = (host or host_load.HOST).spare_cores()
        if spare is not None:
            usable = max(1, min(available, int(spare + 0.5)))
    threads = choice.threads(kind, work, usable)
    if threads != available:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        yield
        choice.record(kind, work, usable, threads, time.perf_counter() - t0)
    finally:
        if threads != available:
            torch.set_num_threads(available)
