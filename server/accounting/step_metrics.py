"""The metrics of applied training calls, kept for a run's curves: queued on the
hot path (no database write per call) and written every ``flush_s`` seconds, and
when the server stops, like the usage counters.

A call is queued once, by the call that ended its ops row (``OrderedPipeline``),
and rows are keyed by ``seq_id``, so neither a retry nor a second server writes
a call's metrics twice. A crash loses at most the last ``flush_s`` of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping

from sqlalchemy import Connection

from treadle.server.db.run_metrics import CallMetrics, write_call_metrics

log = logging.getLogger("treadle.server")

#: the ordered calls whose metrics make a run's curves
RECORDED_KINDS = frozenset({"forward_backward", "optim_step"})


class StepMetricsRecorder:
    def __init__(
        self,
        connection: Callable[[], contextlib.AbstractContextManager[Connection]],
        flush_s: float = 2.0,
    ) -> None:
        self.connection = connection
        self.flush_s = flush_s
        self._queued: list[CallMetrics] = []
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None

    def add(self, model_id: str, seq_id: int, kind: str, result: object) -> None:
        """Queue the metrics of an applied call (other kinds are not recorded)."""
        if kind not in RECORDED_KINDS:
            return
        metrics: Mapping[str, float] = getattr(result, "metrics", None) or {}
        if not metrics:
            return
        step = getattr(result, "step", None) if kind == "optim_step" else None
        with self._lock:
            self._queued.append(CallMetrics(model_id, seq_id, kind, step, dict(metrics)))

    def flush(self) -> int:
        """Write what is queued; rows written."""
        with self._lock:
            batch, self._queued = self._queued, []
        if not batch:
            return 0
        try:
            with self.connection() as conn:
                return write_call_metrics(conn, batch)
        except Exception as err:  # keep them for the next flush
            log.error("step metrics: could not write %d calls' metrics: %s", len(batch), err)
            with self._lock:
                self._queued = batch + self._queued
            return 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await asyncio.to_thread(self.flush)
