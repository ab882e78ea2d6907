"""The thread the torch samplers step on with ``--sampler torch-thread``
(``workers.torch_backend.ThreadTorchBackend``), so that sampling overlaps training.

With a thread of their own, the samplers step
while the engine thread trains: a second core generates while the first runs
``forward_backward``, which is what the async rungs need to pay off
(``docs/async_rl.md``). The samplers read only published weight snapshots
(copies, never the tensors a training step updates in place), so the two
threads share no tensor that either writes. The samplers' bookkeeping (queues,
rows, the KV cache) belongs to the sampler thread alone: the engine thread
hands it work with ``post`` (through the backend), which runs on the sampler thread between two
steps, in the order posted, and never waits for a step to end. An in-flight
weight update (``swap_weights``) is posted like a request, so it lands between
two decode steps and before any request posted after it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import torch

log = logging.getLogger("treadle.engine")


class SamplerLoop:
    """Runs posted work and ``step_all`` on its own thread."""

    def __init__(
        self,
        step_all: Callable[[], None],
        has_work: Callable[[], bool],
        *,
        torch_threads: int = 0,
    ) -> None:
        self._step_all = step_all
        self._has_work = has_work
        self._torch_threads = torch_threads
        self._cv = threading.Condition()
        self._posted: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="treadle-sampler", daemon=True)

    @property
    def running(self) -> bool:
        """Whether the sampler thread is up (so posted work runs there)."""
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Run what was posted, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` where the samplers live: on their thread before its next step.
        ``fn`` handles its own errors."""
        with self._cv:
            self._posted.append(fn)
            self._cv.notify_all()

    def _run(self) -> None:
        if self._torch_threads > 0:
            torch.set_num_threads(self._torch_threads)
        while True:
            with self._cv:
                while not (self._stopping or self._posted or self._has_work()):
                    self._cv.wait()
                posted, stopping = list(self._posted), self._stopping
                self._posted.clear()
            for fn in posted:
                try:
                    fn()
                except Exception:  # posted work reports its own errors; this is a bug
                    log.exception("sampler loop: posted work failed")
            if stopping:
                return
            try:
                self._step_all()
            except Exception:  # step_all handles a sampler's own failure; this is a bug
                log.exception("sampler loop: a step failed")
