"""A training pass on the torch thread count ``ThreadChoice`` picks for it, on the
CPU only: on a GPU the torch threads do not run the pass, so there is no choice
to make (and no measuring)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from treadle.workers.device import device
from treadle.workers.trainer.thread_choice import ThreadChoice


@contextlib.contextmanager
def pass_threads(
    choice: ThreadChoice, where: torch.device, kind: str, work: float
) -> Iterator[None]:
    """Run the pass (``work`` = tokens x parameters) on the thread count ``choice``
    picks for its kind and size, and report its time (only when it ends without
    raising)."""
    if not device.is_cpu_only(where):
        yield
        return
    available = torch.get_num_threads()
    threads = choice.threads(kind, work, available)
    if threads != available:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        yield
        choice.record(kind, work, available, threads, time.perf_counter() - t0)
    finally:
        if threads != available:
            torch.set_num_threads(available)
